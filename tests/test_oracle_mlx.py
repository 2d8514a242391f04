"""qwenmetal's numpy reference against mlx-lm (MLX CPU, float32) on real-format MLX checkpoints.

The random HF models of ``test_oracle_hf`` are converted with ``mlx_lm.convert`` exactly as a real checkpoint
is: 4-bit group-64 affine with bf16 scales/biases, router and shared_expert_gate 8-bit, stacked experts, norms
stored shifted (1 + w), conv1d as [C, K, 1]; our own fixtures at 3/5 bits and with 2-bit experts, and
`qwenmetal convert --expert-bits 2`'s output, and mlx-lm's mixed_3_6 recipe are run by mlx-lm as they are. mlx-lm runs the *same quantized weights* with every floating
parameter cast to float32 (bf16 -> f32 is exact), so the reference, which dequantizes to float32, must agree
with it to 1e-4. The unquantized conversion (float32) must agree with both mlx-lm and HF.
"""
import tempfile
from pathlib import Path

import numpy as np
import pytest

from oracles import (KINDS, N_DECODE, assert_close, assert_same_greedy, greedy_rows, hf_model, mlx_convert,
                     mlx_load_f32, mlx_logits, prompt, qm_logits, random_config_strategy, require, save_hf)

require("torch")
require("transformers")
require("mlx.core")
require("mlx_lm")
qm = require("qwenmetal")

ATOL = 1e-4

# (kind, bits, group size); bits None = unquantized float32 conversion
QUANT_CASES = [(k, 4, 64) for k in KINDS] + [("qwen3_5_moe", 8, 64), ("qwen3_next", 4, 32)]


def load(path, **kw):
    return qm.Model.load(str(path), backend="reference", **kw)


def _id(case):
    k, b, g = case
    return f"{k}-q{b}g{g}" if b else f"{k}-f32"


# ---- the oracles against each other -------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_mlx_unquantized_conversion_matches_hf(oracle, kind):
    """Harness check: mlx-lm on the unquantized float32 conversion reproduces HF's logits (prefill at every
    position + cached greedy decode) and greedy tokens, so both oracles implement the same model."""
    ref, mx_ = oracle.hf(kind), oracle.mlx(kind, None)
    assert_close(f"{kind} mlx-lm f32 prefill vs HF", mx_.pre, ref.pre, ATOL)
    assert_close(f"{kind} mlx-lm f32 decode vs HF", mx_.dec, ref.dec, ATOL)
    np.testing.assert_array_equal(mx_.toks, ref.toks)


@pytest.mark.parametrize("kind", KINDS)
def test_mlx_quantized_cache_path_matches_full_forward(oracle, kind):
    """Harness check: mlx-lm's cached prefill + decode on the q4 checkpoint equals one cache-free forward over
    the whole sequence; and the quantized model really differs from the unquantized one (the comparison
    below is not vacuous)."""
    import mlx.core as mx

    q = oracle.mlx(kind, 4, 64)
    model = mlx_load_f32(q.dir)
    full = np.array(model(mx.array([list(q.ids) + q.toks.tolist()]))[0].astype(mx.float32))
    L = len(q.ids)
    assert_close(f"{kind} mlx-lm q4 prefill vs full forward", q.pre, full[:L], ATOL)
    assert_close(f"{kind} mlx-lm q4 decode vs full forward", q.dec, full[L:], ATOL)
    assert np.abs(q.pre - oracle.hf(kind).pre).max() > 1e-2


# ---- qwenmetal vs mlx-lm ------------------------------------------------------------------------
@pytest.mark.parametrize("case", QUANT_CASES, ids=_id)
def test_quantized_checkpoint_matches_mlx(oracle, case):
    """mlx_lm.convert -q checkpoint: 32-token prefill (every position) and 16 greedy decode steps agree with
    mlx-lm float32 within 1e-4; greedy tokens identical."""
    kind, bits, gs = case
    ref = oracle.mlx(kind, bits, gs)
    model = load(ref.dir)
    pre, dec, toks = qm_logits(model, ref.ids, N_DECODE, forced_tokens=ref.toks)
    assert_close(f"{_id(case)} prefill logits vs mlx-lm", pre, ref.pre, ATOL)
    assert_close(f"{_id(case)} decode logits vs mlx-lm", dec, ref.dec, ATOL)
    assert_same_greedy(_id(case), toks, ref.toks, greedy_rows(ref.pre, ref.dec))


@pytest.fixture(scope="module")
def converted_e2(tmp_path_factory):
    """`qwenmetal convert --bits 4 --expert-bits 2` of the tiny hf-bf16 fixture."""
    from qwenmetal.convert import convert
    from qwenmetal.testing import cached_checkpoint
    return convert(cached_checkpoint("tiny", "hf-bf16"), tmp_path_factory.mktemp("e2") / "out", expert_bits=2)


@pytest.fixture(scope="module")
def mlx_mixed_3_6(tmp_path_factory):
    """`mlx_lm.convert(..., quant_predicate="mixed_3_6")` of the tiny hf-bf16 fixture: mlx-lm's own mixed
    recipe (3 bits, 6 for lm_head and some layers' v_proj / down_proj), a width per path in config.json."""
    import contextlib
    import io

    import mlx_lm
    from qwenmetal.testing import cached_checkpoint
    out = tmp_path_factory.mktemp("mixed") / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(cached_checkpoint("tiny", "hf-bf16")), str(out), quantize=True, q_group_size=64,
                       quant_predicate="mixed_3_6")
    return out


# source -> (embedding bits, layer 0's / layer 3's routed down_proj bits)
LOW_BIT_SOURCES = {"mlx-q3": (3, 3, 3), "mlx-q5": (5, 5, 5), "mlx-q4-e2": (4, 2, 2),
                   "convert --expert-bits 2": (4, 2, 2), "mlx_lm.convert mixed_3_6": (3, 3, 6)}


@pytest.mark.parametrize("source", LOW_BIT_SOURCES)
def test_low_bit_and_mixed_checkpoints_match_mlx(source, request):
    """Our fixtures at 3 and 5 bits and with 2-bit experts (config.json's per-path overrides), the output of
    `convert --expert-bits 2`, and mlx-lm's own mixed_3_6 recipe (widths differing per layer), as mlx-lm loads
    them (each layer at the width the file says): a 16-token prefill and 4 greedy decode steps agree with
    mlx-lm float32 within 1e-4 on the reference backend."""
    from qwenmetal.testing import cached_checkpoint
    path = (request.getfixturevalue("converted_e2") if source.startswith("convert") else
            request.getfixturevalue("mlx_mixed_3_6") if source.startswith("mlx_lm") else cached_checkpoint("tiny", source))
    mx_model = mlx_load_f32(path)
    lm = mx_model.language_model.model
    assert (lm.embed_tokens.bits, lm.layers[0].mlp.switch_mlp.down_proj.bits,
            lm.layers[3].mlp.switch_mlp.down_proj.bits) == LOW_BIT_SOURCES[source]
    ids = prompt(16, 414, seed=7)
    pre, dec, toks = mlx_logits(mx_model, ids, 4)
    got_pre, got_dec, got_toks = qm_logits(load(path), ids, 4, forced_tokens=toks)
    assert_close(f"{source} prefill vs mlx-lm", got_pre, pre, ATOL)
    assert_close(f"{source} decode vs mlx-lm", got_dec, dec, ATOL)
    assert_same_greedy(source, got_toks, toks, greedy_rows(pre, dec))


@pytest.mark.parametrize("kind", KINDS)
def test_unquantized_conversion_matches_mlx_and_hf(oracle, kind):
    """mlx_lm.convert without -q (float32, MLX layout: shifted norms, [C,K,1] conv, stacked experts) loads
    and agrees with mlx-lm and with HF."""
    ref, hf = oracle.mlx(kind, None), oracle.hf(kind)
    model = load(ref.dir)
    pre, dec, toks = qm_logits(model, ref.ids, N_DECODE, forced_tokens=ref.toks)
    assert_close(f"{kind}-f32 prefill vs mlx-lm", pre, ref.pre, ATOL)
    assert_close(f"{kind}-f32 decode vs mlx-lm", dec, ref.dec, ATOL)
    assert_close(f"{kind}-f32 prefill vs HF", pre, hf.pre, ATOL)
    assert_close(f"{kind}-f32 decode vs HF", dec, hf.dec, ATOL)
    assert_same_greedy(f"{kind}-f32", toks, ref.toks, greedy_rows(ref.pre, ref.dec))


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_chunked_and_recurrent_gdn_match_mlx(oracle, kind):
    """The q4 checkpoint with several GDN chunks, and with the recurrent form, still matches mlx-lm (whose CPU
    path is the token-by-token recurrence)."""
    ref = oracle.mlx(kind, 4, 64)
    for mode, cs in (("chunked", 7), ("recurrent", 64)):
        model = load(ref.dir, gdn_mode=mode, chunk_size=cs)
        pre, dec, _ = qm_logits(model, ref.ids, 4, forced_tokens=ref.toks)
        assert_close(f"{kind}-q4 {mode}/{cs} prefill vs mlx-lm", pre, ref.pre, ATOL)
        assert_close(f"{kind}-q4 {mode}/{cs} decode vs mlx-lm", dec, ref.dec[:4], ATOL)


# ---- random configs ------------------------------------------------------------------------------
hyp = require("hypothesis")


@pytest.mark.parametrize("kind", KINDS)
@hyp.settings(max_examples=4, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(hyp.HealthCheck))
@hyp.given(data=hyp.strategies.data())
def test_random_configs_match_mlx(kind, data):
    """Random small configs converted by mlx_lm.convert (4/8-bit, group 32/64, or unquantized). Linears whose
    input dim is not a multiple of the group size stay unquantized (mlx-lm's rule), so these checkpoints mix
    quantized and bf16 tensors. Prefill + 3 decode steps agree with mlx-lm float32."""
    case = data.draw(random_config_strategy(kinds=[kind], periodic_only=True), label="case")
    quant = data.draw(hyp.strategies.sampled_from([(4, 64), (8, 64), (4, 32), (None, 64)]), label="quant")
    kind, ov, n_prompt, seed = case
    bits, gs = quant
    hyp.assume(ov["hidden_size"] % 64 == 0)  # the 8-bit g64 router override needs it (mlx-lm)
    # mlx-lm takes its GDN mask from layer 0's cache: layer 0 must be a GDN layer (interval >= 2)
    hyp.assume(ov["full_attention_interval"] >= 2)
    if kind == "qwen3_next":  # mlx-lm's qwen3_next sanitize needs at least one MoE layer
        step = ov.get("decoder_sparse_step", 1)
        hyp.assume(any(i not in ov["mlp_only_layers"] and (i + 1) % step == 0
                       for i in range(ov["num_hidden_layers"])))
    model = hf_model(kind, ov, seed=seed)
    ids = prompt(n_prompt, model.config.vocab_size, seed=seed)
    with tempfile.TemporaryDirectory() as d:
        hf_dir, mlx_dir = save_hf(model, Path(d) / "hf"), Path(d) / "mlx"
        mlx_convert(hf_dir, mlx_dir, q_bits=bits, group_size=gs)
        pre, dec, toks = mlx_logits(mlx_dir, ids, 3)
        got_pre, got_dec, got_toks = qm_logits(load(mlx_dir), ids, 3, forced_tokens=toks)
    what = f"{kind} q{bits}g{gs} {ov}"
    assert_close(f"prefill vs mlx-lm [{what}]", got_pre, pre, ATOL)
    assert_close(f"decode vs mlx-lm [{what}]", got_dec, dec, ATOL)
    assert_same_greedy(what, got_toks, toks, greedy_rows(pre, dec), margin=10 * ATOL)
