"""backend="metal-sim" (or "metal" with QWENMETAL_TEST_DEVICE=metal on a Mac): the Metal decode graph (src/gpu/forward.cpp) and every kernel it calls, executed by the
simulator, against the numpy reference and the CPU backend. Simulator-verified, hardware-unverified.

* float build (dtype="float32", float KV) on every fixture format of both architectures: logits of the
  prompt (the chunked prefill graph, tests/metal/test_prefill.py) and of 64 greedy decode steps within 1e-4 of the logit
  range of the reference, identical greedy tokens;
* bfloat build against the reference's bfloat16 mode: teacher-forced top-1 agreement >= 98 % over 64
  positions, an exact tie of the reference's bf16 logits counting for either id, and a mean logit error
  below 1.3e-3 of the range (a rounding point dropped from one kernel fails both; the max error is printed);
* every attention route reached inside the graph (policy thresholds lowered);
* the pipelined decode loop: the same tokens as unpipelined and as the forward() loop, one command buffer
  per token, host waits only for tokens; a stop token discards the extra step without touching the state;
  seeded GPU sampling reproduces; a token mask (structured output) gives the best allowed token greedily and
  only allowed tokens sampled, resident and streaming, and a bad mask raises with the session untouched;
* the Session contract: fork, snapshot/restore, reset, nbytes, save/load across backends, bad input leaves
  the session unchanged; the demo checkpoint generates the CPU backend's tokens.
"""
from __future__ import annotations

import numpy as np
import pytest

import qwenmetal as qm
from qwenmetal.testing import cached_checkpoint

from model_runs import rel_range_err, run_greedy

from .gpu_harness import BACKEND, token_bitmask

PROMPT = [5, 17, 3, 99, 42, 7, 250, 1]
N_DECODE = 64


@pytest.fixture(scope="module")
def reference_runs():
    cache = {}

    def get(preset, fmt, dtype="float32"):
        key = (preset, fmt, dtype)
        if key not in cache:
            m = qm.Model.load(cached_checkpoint(preset, fmt, seed=0), backend="reference", dtype=dtype)
            cache[key] = (m, run_greedy(m, PROMPT, N_DECODE))
        return cache[key]
    return get


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
@pytest.mark.parametrize("fmt", ["mlx-q4", "mlx-q8", "mlx-bf16", "hf-bf16"])
def test_float_build_matches_reference(preset, fmt, reference_runs):
    _, (want_pre, want_dec, want_toks) = reference_runs(preset, fmt)
    model = qm.Model.load(cached_checkpoint(preset, fmt, seed=0), backend=BACKEND, dtype="float32")
    pre, dec, toks = run_greedy(model, PROMPT, N_DECODE)
    assert rel_range_err(pre, want_pre) < 1e-4
    for j in range(N_DECODE):
        assert rel_range_err(dec[j], want_dec[j]) < 1e-4, f"decode step {j}"
    assert toks == want_toks


# the low-bit fixtures: every linear at 2, 3, 5, 6 bits (the qn kernels everywhere, embed and lm_head included),
# and 4 bits with the routed experts at 2 or 3 (qn expert kernels beside 4-bit shared experts); two of them with a
# prompt past the skinny bound (the tiled and grouped prefill GEMMs at the low width), the others through the
# skinny prefill (qmv_b16_qn)
LOW_BIT = [("mlx-q3", 20), ("mlx-q4-e2", 20), ("mlx-q2", 8), ("mlx-q5", 8), ("mlx-q6", 8), ("mlx-q4-e3", 8)]


@pytest.mark.parametrize("fmt,n_prompt", LOW_BIT)
def test_low_bit_fixtures_match_reference(fmt, n_prompt):
    """The float build on the 2/3/5/6-bit and expert-only 2/3-bit fixtures of tiny: the prompt's logits and 3 greedy
    decode steps within 1e-4 of the reference's logit range, the same tokens (about 3 s each: 3 decode steps, not
    64, keep this inside the CI budget)."""
    path = cached_checkpoint("tiny", fmt, seed=0)
    prompt = (PROMPT * 3)[:n_prompt]
    want_pre, want_dec, want_toks = run_greedy(qm.Model.load(path, backend="reference"), prompt, 3)
    pre, dec, toks = run_greedy(qm.Model.load(path, backend=BACKEND, dtype="float32"), prompt, 3)
    assert rel_range_err(pre, want_pre) < 1e-4
    for j in range(3):
        assert rel_range_err(dec[j], want_dec[j]) < 1e-4, f"decode step {j}"
    assert toks == want_toks


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-next"])
def test_bfloat_build_agrees_with_reference_bf16(preset, reference_runs):
    """Teacher-forced on the bf16 reference's own greedy tokens: top-1 agreement >= 98 % over 64 positions (one
    position may differ) and a mean logit error below 1.3e-3 of the range.
    The reference's logits are bf16-rounded, so its top two can tie exactly (a few positions on these
    random weights, where they fall depends on the host's BLAS); there the top-1 is any of the tied ids."""
    ref_model, (want_pre, want_dec, want_toks) = reference_runs(preset, "mlx-q4", "bfloat16")
    model = qm.Model.load(cached_checkpoint(preset, "mlx-q4", seed=0), backend=BACKEND, dtype="bfloat16")
    s = model.new_session()
    got = [model.prefill(s, PROMPT, return_logits="last")]
    for t in want_toks[:N_DECODE - 1]:
        got.append(model.decode_step(s, t))
    want = np.concatenate([want_pre[-1:], want_dec[:N_DECODE - 1]])
    got = np.stack(got)
    top = want[np.arange(len(want)), np.argmax(got, -1)]
    agree = float(np.mean(top == want.max(-1)))          # got's argmax is (one of) the reference's maxima
    err = max(rel_range_err(g, w) for g, w in zip(got, want))
    mean_err = float(np.mean([np.abs(g - w).mean() / np.ptp(w) for g, w in zip(got, want)]))
    print(f"{preset}: bf16 top-1 agreement {agree:.3f}, max logit error {err:.2e} of the range, mean {mean_err:.2e}")
    # the build reaches 1.000 and a mean error of 6.5e-4 of the range (both presets); one rounding point
    # dropped from rmsnorm gives 0.953 and 2.4e-3 (docs/verification.md): one flip of 64 is allowed, for a
    # float32 re-association that tips a near-tie, and twice the build's mean error
    assert agree >= 0.98
    assert mean_err < 1.3e-3


def test_attention_routes_in_graph(reference_runs):
    """Thresholds lowered so that a 72-token run goes through single-pass, split-K and two-pass attention."""
    _, (want_pre, want_dec, want_toks) = reference_runs("tiny", "mlx-q4")
    routes = {"single_pass_max": 6, "split_max": 24, "split_block": 4, "long_block": 8}
    model = qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=BACKEND, dtype="float32",
                          attention=routes)
    pre, dec, toks = run_greedy(model, PROMPT, N_DECODE)
    assert rel_range_err(pre, want_pre) < 1e-4
    assert max(rel_range_err(d, w) for d, w in zip(dec, want_dec)) < 1e-4
    assert toks == want_toks


@pytest.fixture(scope="module")
def sim_model():
    return qm.Model.load(cached_checkpoint("tiny", "mlx-q4", seed=0), backend=BACKEND, dtype="float32")


def test_pipelined_decode(sim_model):
    m = sim_model
    be = m._backend
    s = m.new_session()
    logits = m.prefill(s, PROMPT)
    first = int(np.argmax(logits))
    # the forward() loop (host argmax)
    ref = s.fork()
    want, t = [], first
    for _ in range(12):
        t = int(np.argmax(m.decode_step(ref, t)))
        want.append(t)
    a, b = s.fork(), s.fork()
    be.device.reset_counters()
    got = be.decode(a._state, first, 12)
    k = be.device.counters()
    assert got == want
    assert k["command_buffers"] == 12 and k["host_waits"] == 12      # one per token, waits only for tokens
    assert be.decode(b._state, first, 12, pipelined=False) == want
    assert a._state.position == b._state.position == s.position + 12


def test_stop_token_discards_the_extra_step(sim_model):
    m = sim_model
    be = m._backend
    s = m.new_session()
    first = int(np.argmax(m.prefill(s, PROMPT)))
    full = be.decode(s.fork()._state, first, 10)
    stop = full[3]
    k = full.index(stop)
    st = s.fork()._state
    part = be.decode(st, first, 10, stop_ids=[stop])
    assert part == full[:k + 1]
    assert st.position == s.position + k + 1
    # the state is exactly that of the uninterrupted run after k + 1 tokens
    rest = be.decode(st, part[-1], len(full) - k - 1)
    assert part + rest == full


def test_gpu_sampling_is_seeded(sim_model):
    m = sim_model
    be = m._backend
    s = m.new_session()
    first = int(np.argmax(m.prefill(s, PROMPT)))
    runs = [be.decode(s.fork()._state, first, 8, temperature=1.5, top_k=50, top_p=0.95, seed=seed)
            for seed in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def mask_case(m):
    """(session after PROMPT, first token, the step's host logits ranked, a mask allowing four tokens ranked 5,
    9, 20 and 40 -- not the unmasked argmax -- and those tokens)."""
    s = m.new_session()
    first = int(np.argmax(m.prefill(s, PROMPT)))
    host = m.decode_step(s.fork(), first)
    order = np.argsort(-host, kind="stable")
    allowed = order[[5, 9, 20, 40]]
    # the masked argmax is clear of the float noise between the decode step and the decode loop
    assert host[allowed[0]] - host[allowed[1]] > 1e-3 * np.ptp(host)
    return s, first, order, token_bitmask(allowed, -(-m.config.vocab_size // 32)), allowed


def test_token_mask_in_the_decode_loop(sim_model):
    m = sim_model
    s, first, order, words, allowed = mask_case(m)
    assert m.decode_loop(s.fork(), first, 1) == [int(order[0])]
    a = s.fork()
    assert m.decode_loop(a, first, 1, mask=words) == [int(allowed[0])]         # greedy: the best allowed token
    assert a.position == s.position + 1 and a.tokens == s.tokens + (first,)
    assert m.decode_loop(s.fork(), first, 1, mask=words.view(np.int32)) == [int(allowed[0])]   # int32 words
    # sampled (temperature 1, seeded): allowed tokens only, reproducibly
    draws = [m.decode_loop(s.fork(), first, 1, mask=words, temperature=1.0, seed=seed)[0] for seed in range(6)]
    assert set(draws) <= set(allowed.tolist()) and len(set(draws)) >= 2
    assert m.decode_loop(s.fork(), first, 1, mask=words, temperature=1.0, seed=4) == [draws[4]]
    # the mask is the step's only: the next call without one chooses among every token again
    nxt = m.decode_step(a.fork(), int(allowed[0]))
    assert m.decode_loop(a, int(allowed[0]), 1) == [int(np.argmax(nxt))]


def test_token_mask_with_streamed_experts(sim_model):
    """The streaming decode (one command buffer per layer) applies the mask in its head as well."""
    streamed = qm.Model.load(sim_model.path, backend=BACKEND, dtype="float32", expert_slots=2)
    s, first, _, words, allowed = mask_case(streamed)
    assert streamed.decode_loop(s, first, 1, mask=words) == [int(allowed[0])]


def test_bad_token_masks_leave_the_session_untouched(sim_model):
    m = sim_model
    V = m.config.vocab_size
    W = -(-V // 32)
    s = m.new_session()
    first = int(np.argmax(m.prefill(s, PROMPT)))
    ref, pos, toks = s.fork(), s.position, s.tokens
    ok, top = token_bitmask([3], W), token_bitmask([V - 1], W)
    for n, kw, match in (
            (2, dict(mask=ok), r"a token mask decodes one token per call \(n must be 1, got 2\)"),
            (1, dict(mask=ok[:-1]), rf"ceil\(vocab_size / 32\) = {W} words, got {W - 1}"),
            (1, dict(mask=np.concatenate([ok, ok])), rf"= {W} words, got {2 * W}"),
            (1, dict(mask=ok.astype(np.int64)), "must be a 1-D C-contiguous uint32 or int32 numpy array"),
            (1, dict(mask=ok.astype(np.float32)), "must be a 1-D C-contiguous uint32 or int32 numpy array"),
            (1, dict(mask=np.stack([ok, ok])), "must be a 1-D C-contiguous uint32 or int32 numpy array"),
            (1, dict(mask=np.zeros(W, np.uint32)), rf"the token mask allows no token in \[0, {V}\)"),
            # bits only above the tokens chosen from (vocab): nothing to choose
            (1, dict(mask=top, vocab=V - 10), rf"allows no token in \[0, {V - 10}\)"),
            (1, dict(mask=top, vocab=V - 10, temperature=1.0), rf"allows no token in \[0, {V - 10}\)")):
        with pytest.raises(ValueError, match=match):
            m.decode_loop(s, first, n, **kw)
        assert s.position == pos and s.tokens == toks
    assert m.decode_loop(s, first, 3) == m.decode_loop(ref, first, 3)
    assert m.decode_loop(ref.fork(), 5, 1, mask=ok) == [3]


def test_session_contract(sim_model, tmp_path):
    m = sim_model
    s = m.new_session()
    m.prefill(s, PROMPT[:5])
    snap = s.snapshot()
    f = s.fork()
    a = m.decode_step(s, 7)
    b = m.decode_step(f, 7)
    np.testing.assert_array_equal(a, b)
    s.restore(snap)
    assert s.position == 5
    np.testing.assert_array_equal(m.decode_step(s, 7), a)
    n_before = s.nbytes
    with pytest.raises(ValueError, match=r"token id \d+ at index 2 is outside the vocabulary \[0, \d+\)"):
        m.prefill(s, [1, 2, m.config.vocab_size])
    assert s.position == 6 and s.nbytes == n_before
    # save on metal-sim, load on the reference and on metal-sim: the same next logits
    s.save(tmp_path / "s.safetensors")
    ref = qm.Model.load(m.path, backend="reference")
    r = qm.Session.load(tmp_path / "s.safetensors", ref)
    again = qm.Session.load(tmp_path / "s.safetensors", m)
    want = ref.decode_step(r, 9)
    got = m.decode_step(again, 9)
    assert rel_range_err(got, want) < 1e-4
    np.testing.assert_array_equal(got, m.decode_step(s, 9))
    s.reset()
    assert s.position == 0


def test_demo_checkpoint_generates_the_cpu_tokens():
    """Default options on both (metal-sim: the float build)."""
    path = cached_checkpoint("tiny", "mlx-q4", seed=0)
    toks = {}
    for backend in ("cpu", BACKEND):
        m = qm.Model.load(path, backend=backend, **({"dtype": "float32"} if backend == "metal" else {}))
        toks[backend] = [o.token for o in m.generate("The quick brown fox", max_tokens=16, temperature=0.0)]
    assert toks[BACKEND] == toks["cpu"]


def test_generate_takes_the_pipelined_gpu_path(sim_model):
    """Model.generate on a Metal backend decodes with the GPU loop (one command buffer per token) when nothing
    needs the host (penalties, logprobs, stop strings): the same greedy tokens and the same session as the
    host path (logprobs=True forces it)."""
    m = sim_model
    dev = m._backend.device
    runs = {}
    for host in (False, True):
        s = m.new_session()
        dev.reset_counters()
        outs = list(m.generate(PROMPT, max_tokens=40, temperature=0.0, session=s, cache=False, logprobs=host))
        k = dev.counters()
        runs[host] = ([o.token for o in outs], list(s.tokens), s.position, k)
    gpu, host = runs[False], runs[True]
    assert gpu[0] == host[0] and gpu[1] == host[1] and gpu[2] == host[2]
    assert gpu[2] == len(PROMPT) + 39              # the last token is sampled, not consumed
    # GPU path: one command buffer for the prompt (one prefill chunk) and one per decoded token, read back
    # 4 bytes at a time
    assert gpu[3]["command_buffers"] == 1 + 39
    seeded = [[o.token for o in m.generate(PROMPT, max_tokens=12, temperature=1.2, top_p=0.9, seed=5, cache=False)]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_gpu_path_keeps_the_turn_in_the_prefix_cache(sim_model):
    """The end of a turn decoded by the GPU loop (prompt + generated tokens but the last) goes into the prefix
    cache like the host path's, so the next turn of a chat, which starts with them, reuses all of them."""
    m = sim_model
    m.prefix_cache = qm.PrefixCache()
    gen = [o.token for o in m.generate(PROMPT, max_tokens=6, temperature=0.0)]
    assert (len(PROMPT) + 5, "turn") in [(n, kind) for n, kind, _ in m.prefix_cache.entries()]
    nxt = list(PROMPT) + gen + [7]
    out = list(m.generate(nxt, max_tokens=1, temperature=0.0))
    assert out[-1].stats["cached_tokens"] == len(PROMPT) + 5
