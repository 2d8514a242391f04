"""sample family (metal/sample.metal): argmax and the seeded GPU sampler through their host functions
(_core.gpu.ops.argmax / sample / sample_scratch_bytes) on gpu.SimDevice under the three schedules, against
numpy and against the host sampler (python/qwenmetal/sampling.py) given the same uniform u; the token mask
(apply_token_mask: llguidance's bitmask layout) against numpy, and argmax / sample after it.

The GPU draws u from Philox-4x32-10 (key = seed, counter = (position, 0)); philox4x32_10() below is an
independent numpy implementation checked against Random123's known-answer vectors, so every GPU draw can be
replayed through the host Sampler with its generator replaced by that u. Simulator-verified,
hardware-unverified.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_harness import SCHEDULES, gpu, make_device, ops, token_bitmask  # noqa: E402

from qwenmetal.sampling import Sampler  # noqa: E402

REAL_VOCAB = 248320
SORT_MAX = 1024                       # metal/sample.h SAMPLE_SORT_MAX: larger candidate sets take sample_radix
H_TOKEN, H_U, H_MAX, H_ARGMAX, H_NTOPK, H_NKEPT, H_MASS, H_PATH = range(8)
# float32 vs float64: thresholds closer than this to a cumulative sum (absolute, sums normalised to 1) or
# to a probability ratio (min-p, relative) are not compared; the GPU's float32 errors are ~1e-6
TOL = 5e-6

# One device per (schedule, seed) for the whole module (thousands of draws: a device per call would
# mostly measure device set-up).
_DEVICES: dict = {}


def device(schedule: str, seed: int = 0):
    key = (schedule, seed)
    if key not in _DEVICES:
        _DEVICES[key] = make_device(schedule, seed)
    return _DEVICES[key]


# ------------------------------------------------------------------------------------------- the RNG
M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox4x32_10(ctr, key):
    """Philox-4x32-10 (Random123) on python ints: 4 counter words, 2 key words -> 4 output words."""
    c0, c1, c2, c3 = (int(v) & 0xFFFFFFFF for v in ctr)
    k0, k1 = (int(v) & 0xFFFFFFFF for v in key)
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
    return c0, c1, c2, c3


def gpu_uniform(seed: int, position: int) -> float:
    """The u the GPU sampler draws for (seed, position) (docs/metal.md)."""
    out = philox4x32_10((position & 0xFFFFFFFF, position >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return (out[0] >> 8) * 2.0 ** -24


def test_philox_known_answers():
    # Random123 tests/kat_vectors, the three "philox4x32 10" lines
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    f = 0xFFFFFFFF
    assert philox4x32_10((f, f, f, f), (f, f)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


# ------------------------------------------------------------------------------------------- running
def run_argmax(x: np.ndarray, schedule: str = "forward", seed: int = 0) -> int:
    V = x.size
    tok = np.full(1, 0xDEADBEEF, np.uint32)
    scr = np.zeros(ops.sample_scratch_bytes(V) // 4, np.uint32)
    dev = device(schedule, seed)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    ops.argmax(enc, dev.wrap(x), V, dev.wrap(tok), dev.wrap(scr))
    cb.commit()
    cb.wait()
    return int(tok[0])


def run_sample(x: np.ndarray, positions, schedule: str = "forward", dev_seed: int = 0, **params):
    """One sample() per position, all in one command buffer; returns (tokens, headers [n, 16] uint32)."""
    V, n = x.size, len(positions)
    sb = ops.sample_scratch_bytes(V)
    tok = np.full(n, 0xDEADBEEF, np.uint32)
    scr = np.zeros(n * sb // 4, np.uint32)
    dev = device(schedule, dev_seed)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    bx, bt, bs = dev.wrap(x), dev.wrap(tok), dev.wrap(scr)
    for i, pos in enumerate(positions):
        ops.sample(enc, bx, V, bt.view(4 * i, 4), bs.view(sb * i, sb), position=int(pos), **params)
    cb.commit()
    cb.wait()
    return tok.astype(np.int64), scr.reshape(n, sb // 4)[:, :16].copy()


def f32(word) -> float:
    return struct.unpack("<f", struct.pack("<I", int(word)))[0]


# ------------------------------------------------------------------------------------------- the host side
class FixedU:
    """Stands in for the host Sampler's numpy Generator: random() returns the GPU's u."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


def host_token(x, u, temperature, top_k, top_p, min_p) -> int:
    s = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    s.rng = FixedU(u)
    return s(x)


def host_filter(x, temperature, top_k, top_p, min_p):
    """Sampler._draw's filters, step by step, with ties at the k-th place going to the lower ids (the GPU's
    rule; Sampler's argpartition picks among them arbitrarily, otherwise the two agree): (candidates in rank
    order, their p, the kept count n, and the distance of the top-p / min-p thresholds to the nearest
    cumulative sum / probability ratio, the latter relative)."""
    xs = x.astype(np.float64) / temperature
    cand = np.lexsort((np.arange(xs.size), -xs))          # most likely first, ties by lower id
    if top_k and top_k < xs.size:
        cand = cand[:top_k]
    v = xs[cand]
    p = np.exp(v - v[0])
    p /= p.sum()
    n, margin = p.size, np.inf
    if top_p < 1.0:
        cs = np.cumsum(p)
        n = min(n, int(np.searchsorted(cs, top_p)) + 1)
        margin = min(margin, float(np.abs(cs - top_p).min()))
    if min_p > 0.0:
        r = p[:n] / p[0]
        n = min(n, max(1, int(np.sum(r >= min_p))))
        margin = min(margin, float(np.abs(r / min_p - 1.0).min()) / 2)  # relative: e's error is relative
    return cand, p, n, margin


def topk_boundary_tie(x, top_k) -> bool:
    if not top_k or top_k >= x.size:
        return False
    s = np.sort(x.astype(np.float64))[::-1]
    return s[top_k - 1] == s[top_k]


def check_against_host(x, toks, hdr, positions, seed, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Every draw: u is Philox's, the kept set's size is the host's, the token is never outside the host's
    kept set and is the host's for that u (unless u or a threshold lies within TOL of a cumulative sum);
    without a tie at the k-th place the host is the real Sampler. Returns the number of tokens compared."""
    cand, p, n, margin = host_filter(x, temperature, top_k, top_p, min_p)
    V = x.size
    ntopk = top_k if 0 < top_k < V else V
    sampler_ok = not topk_boundary_tie(x, top_k)
    q = np.cumsum(p[:n] / p[:n].sum())
    compared = 0
    for tok, h, pos in zip(toks, hdr, positions):
        u = gpu_uniform(seed, int(pos))
        assert f32(h[H_U]) == u
        assert h[H_TOKEN] == tok
        assert h[H_ARGMAX] == int(np.argmax(x))
        assert f32(h[H_MAX]) == x.max()
        assert h[H_NTOPK] == ntopk
        assert h[H_PATH] == (1 if ntopk <= SORT_MAX else 2)
        if margin < TOL:
            continue                      # the kept set may differ by the boundary token
        assert h[H_NKEPT] == n
        assert int(tok) in set(cand[:n].tolist())
        e = np.exp((x[cand[:n]].astype(np.float64) - x.astype(np.float64).max()) / temperature)
        assert abs(f32(h[H_MASS]) - e.sum()) <= 1e-4 * e.sum()
        if np.abs(q[:-1] - u).min(initial=np.inf) < TOL:
            continue                      # u at a boundary between two tokens
        want = int(cand[min(int(np.searchsorted(q, u, side="right")), n - 1)])
        if sampler_ok:
            assert want == host_token(x, u, temperature, top_k, top_p, min_p)
        assert int(tok) == want
        compared += 1
    return compared


# ------------------------------------------------------------------------------------------- argmax
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("V", [1, 2, 31, 32, 33, 100, 511, 512, 513, 4095, 4096, 4097, 8193, 70001])
def test_argmax_sizes(V, schedule):
    rng = np.random.default_rng(V)
    x = rng.standard_normal(V).astype(np.float32)
    assert run_argmax(x, schedule, seed=V) == int(np.argmax(x))
    # ties: several copies of the max, the lowest index wins
    if V > 3:
        idx = rng.choice(V, size=3, replace=False)
        x[idx] = x.max() + 1.0
        assert run_argmax(x, schedule) == int(idx.min())
    # the max at the very end (vocab not a multiple of anything)
    x[-1] = x.max() + 2.0
    assert run_argmax(x, schedule) == V - 1


@settings(max_examples=40, deadline=None, derandomize=True)
@given(V=st.integers(1, 9000), data_seed=st.integers(0, 2**32 - 1), schedule=st.sampled_from(SCHEDULES),
       levels=st.integers(1, 6), ninf=st.floats(0.0, 1.0))
def test_argmax_random(V, data_seed, schedule, levels, ninf):
    rng = np.random.default_rng(data_seed)
    # few distinct values (many ties), some -inf
    x = rng.integers(-levels, levels + 1, size=V).astype(np.float32)
    x[rng.random(V) < ninf] = -np.inf
    assert run_argmax(x, schedule, seed=data_seed % 7) == int(np.argmax(x))


def test_argmax_special_values():
    assert run_argmax(np.full(5, -np.inf, np.float32)) == 0
    assert run_argmax(np.array([-np.inf, -3.0, -np.inf], np.float32)) == 1
    assert run_argmax(np.array([-1.0, -0.0, 0.0, -2.0], np.float32)) == 1      # -0 ties with +0
    assert run_argmax(np.array([1.0, np.inf, 2.0, np.inf], np.float32)) == 1
    assert run_argmax(np.array([np.nan, 1.0, 2.0], np.float32)) == 2             # NaN ranks below -inf
    assert run_argmax(np.array([-3e38, -np.inf, -1e-45], np.float32)) == 2       # denormals are ordered


def test_argmax_real_vocab_and_300000():
    rng = np.random.default_rng(7)
    for V in (REAL_VOCAB, 300000):
        x = (rng.standard_normal(V) * 4).astype(np.float32)
        assert run_argmax(x, "random", seed=3) == int(np.argmax(x))
        x[[17, V - 3]] = 1e4
        assert run_argmax(x) == 17


# ------------------------------------------------------------------------------------------- sample
def test_u_is_philox():
    x = np.zeros(8, np.float32)
    cases = [(0, 0), (1, 0), (0, 1), (2**64 - 1, 2**64 - 1), (0x123456789ABCDEF, 2**33 + 5), (42, 1000)]
    for seed, pos in cases:
        _, h = run_sample(x, [pos], seed=seed, temperature=1.0)
        assert f32(h[0, H_U]) == gpu_uniform(seed, pos)


@pytest.mark.parametrize("V,params", [
    (300, dict(temperature=0.8, top_k=40, top_p=0.9)),                # sample_sorted
    (3000, dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02)),  # sample_sorted after a radix top-k
    (2500, dict(temperature=1.2, top_p=0.9, min_p=0.01)),             # sample_radix
])
def test_reproducible_under_every_schedule(V, params):
    x = (np.random.default_rng(V).standard_normal(V) * 2).astype(np.float32)
    positions = [0, 1, 2, 77, 2**40 + 3]
    ref_t, ref_h = run_sample(x, positions, "forward", seed=11, **params)
    for schedule, dev_seed in (("forward", 0), ("reverse", 0), ("random", 1), ("random", 5)):
        t, h = run_sample(x, positions, schedule, dev_seed, seed=11, **params)
        np.testing.assert_array_equal(t, ref_t)
        np.testing.assert_array_equal(h, ref_h)   # u, kept counts and the kept mass bit for bit


def test_positions_and_seeds_give_different_draws():
    x = np.zeros(1000, np.float32)                  # uniform over 1000 tokens (ties: all kept)
    t, h = run_sample(x, range(64), seed=3, temperature=1.0)
    assert len(set(h[:, H_U].tolist())) == 64
    assert len(set(t.tolist())) >= 50               # 64 uniform draws from 1000: ~62 distinct
    t2, _ = run_sample(x, range(64), seed=4, temperature=1.0)
    assert (t2 != t).sum() >= 50
    # the same (seed, position) in another command buffer, alone: the same token
    t3, _ = run_sample(x, [5], seed=3, temperature=1.0)
    assert t3[0] == t[5]


def draw_params():
    return st.fixed_dictionaries(dict(
        temperature=st.sampled_from([0.25, 0.7, 1.0, 1.6, 5.0]),
        top_k=st.one_of(st.just(0), st.integers(1, 50), st.integers(900, 1100), st.integers(2500, 4000)),
        top_p=st.one_of(st.sampled_from([1.0, 0.5, 0.8, 0.9, 0.95]), st.floats(0.05, 0.999)),
        min_p=st.one_of(st.sampled_from([0.0, 0.01, 0.05]), st.floats(0.001, 0.6)),
    ))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(V=st.one_of(st.integers(1, 64), st.integers(65, 1024), st.integers(1025, 3000)),
       data_seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.5, 2.0, 6.0]), params=draw_params(),
       seed=st.integers(0, 2**64 - 1), pos0=st.integers(0, 2**64 - 64), schedule=st.sampled_from(SCHEDULES),
       ninf=st.sampled_from([0.0, 0.0, 0.3]), quantize=st.booleans())
def test_sample_matches_host(V, data_seed, scale, params, seed, pos0, schedule, ninf, quantize):
    rng = np.random.default_rng(data_seed)
    x = (rng.standard_normal(V) * scale).astype(np.float32)
    x[rng.random(V) < ninf] = -np.inf
    if quantize:
        x = np.round(x * 2.0) / 2.0               # many ties, also at the k-th place and inside the kept set
    x[rng.integers(V)] = scale                      # at least one finite logit
    positions = [pos0 + i for i in range(4)]
    toks, hdr = run_sample(x, positions, schedule, seed=seed, **params)
    check_against_host(x, toks, hdr, positions, seed, **params)


# (vocab, top_k, top_p, min_p): every path of the host function and every stage of each
GRID = [
    (200, 0, 1.0, 0.0), (200, 10, 1.0, 0.0), (200, 0, 0.9, 0.0), (200, 0, 1.0, 0.05), (200, 50, 0.8, 0.02),
    (1024, 0, 0.95, 0.0),                                                        # sorted, all candidates
    (3000, 20, 0.95, 0.0), (3000, 1024, 1.0, 0.0), (3000, 500, 0.9, 0.01),     # radix top-k, then sorted
    (3000, 0, 1.0, 0.0), (3000, 0, 0.9, 0.0), (3000, 0, 1.0, 0.02), (3000, 0, 0.7, 0.1),   # radix
    (3000, 1025, 1.0, 0.0), (3000, 2000, 0.9, 0.0), (3000, 1500, 0.95, 0.01),  # radix with radix top-k
]


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("V,top_k,top_p,min_p", GRID)
def test_sample_grid(V, top_k, top_p, min_p, ties):
    params = dict(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    for attempt in range(20):                     # logits whose thresholds are clear of float rounding
        rng = np.random.default_rng([V, top_k, attempt])
        x = (rng.standard_normal(V) * 1.5).astype(np.float32)
        if ties:
            x = np.round(x * 4.0) / 4.0           # ~40 distinct values: ties at every threshold
        if host_filter(x, **params)[3] >= TOL:
            break
    positions = list(range(1000, 1016))
    schedule = SCHEDULES[(V + top_k) % 3]
    toks, hdr = run_sample(x, positions, schedule, seed=31337, **params)
    assert check_against_host(x, toks, hdr, positions, 31337, **params) >= 12


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2_check(toks, kept, probs, n):
    """Pearson's statistic of the GPU draws against the host probabilities over the kept tokens (cells
    with an expectation below 5 pooled), at a 1e-4 level: with fixed seeds the outcome is fixed, and a
    wrong distribution fails."""
    counts = {t: 0 for t in kept}
    for t in toks:
        assert int(t) in counts, f"token {t} outside the host's kept set"
        counts[int(t)] += 1
    obs = np.array([counts[t] for t in kept], np.float64)
    exp = np.asarray(probs, np.float64) * n
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    if e[-1] < 5:                                # pool the small cell into the smallest big one
        j = int(np.argmin(e[:-1]))
        o[j] += o[-1]
        e[j] += e[-1]
        o, e = o[:-1], e[:-1]
    if e.size < 2:
        return 0.0
    stat = float(((o - e) ** 2 / e).sum())
    assert stat < chi2_critical(e.size - 1), (stat, o, e)
    return stat


def test_chi2_check_can_fail():
    """The distribution test's statistic rejects draws from a slightly different temperature."""
    x = (np.random.default_rng(16).standard_normal(16) * 1.5).astype(np.float64)
    p_true = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    p_hot = np.exp((x - x.max()) / 0.8) / np.exp((x - x.max()) / 0.8).sum()
    draws = np.random.default_rng(1).choice(16, size=2000, p=p_hot)
    chi2_check(draws, list(range(16)), p_hot, 2000)
    with pytest.raises(AssertionError, match=r"^\(\d+\.\d+"):   # the message starts with the statistic
        chi2_check(draws, list(range(16)), p_true, 2000)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05),
])
def test_distribution_small_vocab(params):
    V, n = 16, 2000
    x = (np.random.default_rng(16).standard_normal(V) * 1.5).astype(np.float32)
    toks, hdr = run_sample(x, range(n), "random", seed=2024, **params)
    cand, p, k, margin = host_filter(x, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0),
                                     params.get("min_p", 0.0))
    assert margin > TOL
    assert (hdr[:, H_NKEPT] == k).all()
    chi2_check(toks, cand[:k].tolist(), p[:k] / p[:k].sum(), n)
    # and draw by draw, the host's token for the same u
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | params
    assert check_against_host(x, toks[:300], hdr[:300], range(300), 2024, **full) >= 290


def test_distribution_radix_path():
    """sample_radix (top-k off, vocab > SAMPLE_SORT_MAX): 12 likely tokens among 1100, full-vocab top-p."""
    V, n = 1100, 500
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(V) - 8.0).astype(np.float32)
    hot = rng.choice(V, 12, replace=False)
    x[hot] = rng.standard_normal(12).astype(np.float32)
    params = dict(temperature=1.1, top_p=0.97)
    toks, hdr = run_sample(x, range(n), "forward", seed=99, **params)
    assert (hdr[:, H_PATH] == 2).all()
    cand, p, k, margin = host_filter(x, 1.1, 0, 0.97, 0.0)
    assert margin > TOL and (hdr[:, H_NKEPT] == k).all()
    chi2_check(toks, cand[:k].tolist(), p[:k] / p[:k].sum(), n)
    assert check_against_host(x, toks, hdr, range(n), 99, temperature=1.1, top_k=0, top_p=0.97, min_p=0.0) >= 490


@pytest.mark.parametrize("V", [4, 1100])
def test_top_p_keeps_the_token_that_reaches_it(V):
    """Four equal logits (the rest -inf): cumulative p is exactly 0.25, 0.5, 0.75, 1, so top_p = 0.5 keeps
    two tokens (the one reaching 0.5 is kept, no more) and 0.75 three -- the lowest ids among the ties.
    V = 1100 goes through sample_radix's inclusive selection, V = 4 through sample_sorted."""
    x = np.full(V, -np.inf, np.float32)
    hot = np.array([1, 2, V - 2, V - 1]) if V > 4 else np.arange(4)
    x[hot] = 1.5
    for top_p, n in ((0.5, 2), (0.75, 3), (0.5000001, 3), (0.25, 1)):
        toks, hdr = run_sample(x, range(120), seed=8, temperature=0.9, top_p=top_p)
        assert (hdr[:, H_NKEPT] == n).all() and (hdr[:, H_PATH] == (1 if V <= SORT_MAX else 2)).all()
        assert set(toks.tolist()) == set(hot[:n].tolist())


def test_ties_and_special_values():
    # equal logits: top-k keeps the lowest ids (the GPU's documented rule for ties at the k-th place)
    x = np.zeros(40, np.float32)
    toks, hdr = run_sample(x, range(200), seed=1, temperature=1.0, top_k=3)
    assert set(toks.tolist()) == {0, 1, 2}
    # -inf logits are never drawn; NaN counts as -inf
    x = np.array([-np.inf, 0.0, -np.inf, 1.0, np.nan, -np.inf], np.float32)
    toks, hdr = run_sample(x, range(300), seed=2, temperature=3.0)
    assert set(toks.tolist()) == {1, 3}
    # +inf: only the +inf logits (uniformly), as the limit of the distribution
    x = np.array([0.0, np.inf, 5.0, np.inf], np.float32)
    toks, _ = run_sample(x, range(100), seed=3, temperature=1.0)
    assert set(toks.tolist()) == {1, 3}
    # vocab 1
    toks, _ = run_sample(np.array([3.0], np.float32), range(5), seed=4, top_p=0.5, min_p=0.5, top_k=1)
    assert set(toks.tolist()) == {0}
    # a tiny temperature is greedy in effect; temperature 0 is argmax
    x = np.array([0.0, 2.0, 1.9, -1.0], np.float32)
    toks, _ = run_sample(x, range(20), seed=5, temperature=1e-3)
    assert set(toks.tolist()) == {1}
    toks, _ = run_sample(x, [0], seed=5, temperature=0.0)
    assert toks[0] == 1


def test_real_vocab():
    rng = np.random.default_rng(248)
    x = (rng.standard_normal(REAL_VOCAB) * 2.5).astype(np.float32)
    for params in (dict(temperature=0.6, top_k=20, top_p=0.95),          # Qwen's recommended settings
                   dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),  # full-vocabulary top-p: radix
                   dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.05)):
        positions = [3, 4]
        toks, hdr = run_sample(x, positions, "forward", seed=12345, **params)
        check_against_host(x, toks, hdr, positions, 12345, **params)


def test_argument_checks():
    V = 100
    x = np.zeros(V, np.float32)
    tok = np.zeros(1, np.uint32)
    dev = device("forward")
    enc = gpu.Encoder(dev, dev.command_buffer())
    sb = ops.sample_scratch_bytes(V)
    scr = np.zeros(sb // 4, np.uint32)
    bx, bt, bs = dev.wrap(x), dev.wrap(tok), dev.wrap(scr)
    with pytest.raises(ValueError, match="scratch"):
        ops.argmax(enc, bx, V, bt, bs.view(0, sb - 4))
    with pytest.raises(ValueError, match="scratch"):
        ops.sample(enc, bx, V, bt, bs.view(0, sb - 4))
    with pytest.raises(ValueError, match="logits"):
        ops.sample(enc, bx, V + 1, bt, dev.wrap(np.zeros(ops.sample_scratch_bytes(V + 1), np.uint8)))
    with pytest.raises(ValueError, match="token"):
        ops.argmax(enc, bx, V, bx.view(0, 2), bs)
    with pytest.raises(ValueError, match="vocab"):
        ops.argmax(enc, bx, 0, bt, bs)
    for bad, match in ((dict(temperature=-1.0), r"temperature must be finite and >= 0, got -1"),
                       (dict(temperature=float("nan")), r"temperature must be finite and >= 0, got nan"),
                       (dict(temperature=float("inf")), r"temperature must be finite and >= 0, got inf"),
                       (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0"),
                       (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
                       (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
                       (dict(min_p=1.1), r"min_p must be in \[0, 1\], got 1.1"),
                       (dict(top_p=float("nan")), r"top_p must be in \(0, 1\], got nan")):
        with pytest.raises(ValueError, match=r"^sample: " + match):
            ops.sample(enc, bx, V, bt, bs, **bad)
    with pytest.raises(TypeError, match="incompatible function arguments"):   # sampling parameters are keyword-only
        ops.sample(enc, bx, V, bt, bs, 1.0)
    assert enc.dispatches == 0
    assert ops.sample_scratch_bytes(REAL_VOCAB) >= 64 + 8 * (REAL_VOCAB // 4096)


# ------------------------------------------------------------------------------------------- token mask
def masked_reference(x: np.ndarray, words: np.ndarray, V: int) -> np.ndarray:
    i = np.arange(x.size)
    keep = (i >= V) | (((words[np.minimum(i // 32, words.size - 1)] >> (i % 32).astype(np.uint32)) & 1) == 1)
    return np.where(keep, x, np.float32(-np.inf)).astype(np.float32)


def run_mask(x: np.ndarray, words: np.ndarray, V: int, schedule: str = "forward", seed: int = 0, then=None):
    """apply_token_mask over x[:V] in place (x may be longer: the rest must stay), then `then` (argmax or
    sample) in the same command buffer; returns the token it wrote (or None)."""
    tok = np.full(1, 0xDEADBEEF, np.uint32)
    scr = np.zeros(ops.sample_scratch_bytes(V) // 4, np.uint32)
    dev = device(schedule, seed)
    cb = dev.command_buffer()
    enc = gpu.Encoder(dev, cb)
    bx = dev.wrap(x)
    ops.apply_token_mask(enc, bx, V, dev.wrap(words))
    if then is not None:
        then(enc, bx, V, dev.wrap(tok), dev.wrap(scr))
    cb.commit()
    cb.wait()
    return None if then is None else int(tok[0])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 257, 1000, 4099])
def test_token_mask_matches_numpy(V, schedule):
    rng = np.random.default_rng([V, 17])
    x = rng.standard_normal(V + 40).astype(np.float32)       # 40 logits past vocab: never touched
    n_words = ops.token_mask_words(V)
    assert n_words == -(-V // 32)
    words = rng.integers(0, 2**32, size=n_words + 2, dtype=np.uint32)   # extra words (the model's width) are read
    words[0] = 0                                                        # a whole word masked ...
    if n_words > 2:
        words[1] = 0xFFFFFFFF                                           # ... and one kept
    want = masked_reference(x, words, V)
    run_mask(x, words, V, schedule, seed=V)
    np.testing.assert_array_equal(x, want)


def test_token_mask_bit_order_is_llguidance():
    """Bit j of word w is token 32 w + j, least significant bit first (numpy's little-endian packbits of the
    allowed flags viewed as uint32 words, as llguidance's fill_next_token_bitmask writes them)."""
    V = 70
    allowed = np.zeros(96, np.uint8)
    allowed[[0, 9, 31, 32, 63, 64, 69]] = 1
    words = np.packbits(allowed, bitorder="little").view("<u4").astype(np.uint32)
    np.testing.assert_array_equal(words, token_bitmask([0, 9, 31, 32, 63, 64, 69], 3))
    x = np.arange(V, dtype=np.float32)
    run_mask(x, words, V)
    assert np.flatnonzero(np.isfinite(x)).tolist() == [0, 9, 31, 32, 63, 64, 69]


@pytest.mark.parametrize("V", [45, 1100])
def test_argmax_and_sample_after_the_mask(V):
    """The masked argmax is the best allowed token (the unmasked argmax is masked out); sampled tokens stay in
    the mask on both samplers (V = 45: sample_sorted, 1100: sample_radix), the mask's last word partial."""
    rng = np.random.default_rng(V)
    x = rng.standard_normal(V).astype(np.float32)
    best = int(np.argmax(x))
    allowed = rng.choice(np.setdiff1d(np.arange(V), [best]), size=5, replace=False)
    allowed[-1] = V - 1 if best != V - 1 else V - 2
    words = token_bitmask(allowed, ops.token_mask_words(V))
    want = int(allowed[np.argmax(x[allowed])])
    assert run_mask(x.copy(), words, V, then=ops.argmax) == want
    seen = set()
    for pos in range(40):
        draw = lambda e, bx, n, bt, bs, pos=pos: ops.sample(e, bx, n, bt, bs, temperature=1.0, seed=9, position=pos)
        seen.add(run_mask(x.copy(), words, V, "random", pos % 3, then=draw))
    assert seen <= set(allowed.tolist()) and len(seen) >= 2


def test_token_mask_argument_checks():
    V = 100
    dev = device("forward")
    enc = gpu.Encoder(dev, dev.command_buffer())
    bx = dev.wrap(np.zeros(V, np.float32))
    words = np.zeros(4, np.uint32)
    with pytest.raises(ValueError, match=r"^apply_token_mask: mask holds 12 bytes, needs 16"):
        ops.apply_token_mask(enc, bx, V, dev.wrap(words[:3]))
    with pytest.raises(ValueError, match=r"^apply_token_mask: logits holds 400 bytes, needs 404"):
        ops.apply_token_mask(enc, bx, V + 1, dev.wrap(words))
    with pytest.raises(ValueError, match=r"^apply_token_mask: vocab must be positive"):
        ops.apply_token_mask(enc, bx, 0, dev.wrap(words))
    assert enc.dispatches == 0
