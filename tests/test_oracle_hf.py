"""qwenmetal's numpy reference against HF transformers (torch CPU, float32) on tiny random models.

The random models (``oracles.hf_model``) have every weight re-randomised (norms, A_log, dt_bias, conv
included) and rounded to bf16-representable values, so a bf16 checkpoint is lossless and the only
differences left are float32 rounding: HF and the reference must agree to 1e-4 on every logit.
"""
import tempfile

import numpy as np
import pytest

from oracles import (HF_LAYOUTS, KINDS, N_DECODE, assert_close, assert_same_greedy, greedy_rows, hf_full_logits,
                     hf_logits, hf_model, prompt, qm_logits, random_config_strategy, require, save_hf)

require("torch")
require("transformers")
qm = require("qwenmetal")

ATOL = 1e-4

CASES = [(k, layout) for k in KINDS for layout in HF_LAYOUTS[k]]


def load(path, **kw):
    return qm.Model.load(str(path), backend="reference", **kw)


# ---- the oracle itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_hf_oracle_cache_path_matches_full_forward(oracle, kind):
    """Harness check: HF prefill-with-cache + cached greedy decode equal one cache-free forward over the
    whole sequence (so the HF oracle's decode path is itself sound)."""
    ref = oracle.hf(kind)
    full = hf_full_logits(ref.model, list(ref.ids) + ref.toks.tolist())
    L = len(ref.ids)
    assert_close("HF prefill vs full forward", ref.pre, full[:L], ATOL)
    assert_close("HF cached decode vs full forward", ref.dec, full[L:], ATOL)
    assert np.abs(ref.pre).max() > 1.0  # the random model produces non-trivial logits


# ---- qwenmetal vs HF -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout", CASES)
def test_prefill_and_decode_match_hf(oracle, kind, layout):
    """32-token prefill (logits at every position) and 16 greedy decode steps agree with HF within 1e-4;
    greedy tokens identical. Layouts: fused / per-expert experts, bf16 / f32 on disk, and the published
    multimodal (ConditionalGeneration) layout for qwen3_5_moe."""
    ref = oracle.hf(kind)
    model = load(oracle.hf_dir(kind, layout))
    pre, dec, toks = qm_logits(model, ref.ids, N_DECODE, forced_tokens=ref.toks)
    assert_close(f"{kind}/{layout} prefill logits vs HF", pre, ref.pre, ATOL)
    assert_close(f"{kind}/{layout} decode logits vs HF", dec, ref.dec, ATOL)
    assert_same_greedy(f"{kind}/{layout}", toks, ref.toks, greedy_rows(ref.pre, ref.dec))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gdn_mode,chunk_size", [("chunked", 8), ("chunked", 5), ("recurrent", 64)])
def test_gdn_modes_match_hf(oracle, kind, gdn_mode, chunk_size):
    """The chunked GDN prefill with several chunks (incl. a ragged last one) and the token-by-token recurrent
    form both agree with HF."""
    ref = oracle.hf(kind)
    model = load(oracle.hf_dir(kind, HF_LAYOUTS[kind][0]), gdn_mode=gdn_mode, chunk_size=chunk_size)
    pre, dec, toks = qm_logits(model, ref.ids, 4, forced_tokens=ref.toks)
    assert_close(f"{kind} {gdn_mode}/{chunk_size} prefill vs HF", pre, ref.pre, ATOL)
    assert_close(f"{kind} {gdn_mode}/{chunk_size} decode vs HF", dec, ref.dec[:4], ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_split_prefill_and_last_logits_match_hf(oracle, kind):
    """Prefill in three pieces (conv / recurrent / KV state carried across calls) gives HF's logits at every
    position; return_logits="last" is the last row."""
    ref = oracle.hf(kind)
    model = load(oracle.hf_dir(kind, HF_LAYOUTS[kind][0]))
    s = model.new_session()
    parts = [model.prefill(s, ref.ids[a:b], return_logits="all") for a, b in ((0, 3), (3, 20), (20, 32))]
    assert_close(f"{kind} split prefill vs HF", np.concatenate(parts, axis=0), ref.pre, ATOL)
    s2 = model.new_session()
    last = model.prefill(s2, ref.ids, return_logits="last")
    assert np.asarray(last).shape == (model.config.vocab_size,)
    assert_close(f"{kind} last logits vs HF", last, ref.pre[-1], ATOL)


# ---- random configs ------------------------------------------------------------------------------
hyp = require("hypothesis")


@pytest.mark.parametrize("kind", KINDS)
@hyp.settings(max_examples=8, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(hyp.HealthCheck))
@hyp.given(data=hyp.strategies.data())
def test_random_configs_match_hf(kind, data):
    """Random small configs (head counts, GQA ratios, GDN value/key head ratios and head dims, conv width,
    experts/top-k, layer schedules incl. non-periodic layer_types, partial rotary, rope theta, tied
    embeddings, qwen3_next norm_topk_prob and dense mlp_only_layers / decoder_sparse_step): prefill + 3 decode
    steps agree with HF."""
    case = data.draw(random_config_strategy(kinds=[kind]), label="case")
    kind, ov, n_prompt, seed = case
    model = hf_model(kind, ov, seed=seed)
    ids = prompt(n_prompt, model.config.vocab_size, seed=seed)
    pre, dec, toks = hf_logits(model, ids, 3)
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, d)
        qmm = load(d)
        got_pre, got_dec, got_toks = qm_logits(qmm, ids, 3, forced_tokens=toks)
    what = f"{kind} {ov}"
    assert_close(f"prefill vs HF [{what}]", got_pre, pre, ATOL)
    assert_close(f"decode vs HF [{what}]", got_dec, dec, ATOL)
    assert_same_greedy(what, got_toks, toks, greedy_rows(pre, dec), margin=10 * ATOL)
