"""The accuracy contract: how close a model's next-token distributions are to the float reference's.

A model (any backend, any options) is run *teacher-forced* on a fixed token sequence — a prompt and the
reference's own greedy continuation — and its logits at every position are compared with those of the
float32 reference (``backend="reference"``) on the same tokens. The prompt runs as one prefill (the GEMM
paths), every continuation token as one decode step (the GEMV paths), so both are measured.

Measures (`measures`), over all positions:

* ``kl_mean`` / ``kl_max``: KL(reference || model) of the softmax distributions, in nats (float64);
* ``top1_agree``: the fraction of positions whose argmax equals the reference's;
* ``max_abs_err_rel``: max over positions of max |Δlogit| / that position's reference logit range;
* ``rms_rel``: rms of Δlogit over all positions / rms deviation of the reference logits from their
  per-position mean (the logits' spread).

The contract (docs/cpu.md, "Accuracy contract"): the default path of a backend is at least as accurate
as the reference's ``dtype="bfloat16"`` mode (what MLX computes on a Mac) in mean KL, top-1 agreement and
max logit error — `meets`. ``benchmarks/accuracy.py`` and ``tests/test_accuracy.py`` both compute the
figures of every mode of `MODES` with this module (`load_mode`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .backends.reference import ReferenceBackend, ReferenceModel
from .model import Model

MEASURES = ("kl_mean", "kl_max", "top1_agree", "max_abs_err_rel", "rms_rel")
# the measures the contract compares (the three: KL, top-1 agreement, max logit error); the others
# are reported beside them
CONTRACT = ("kl_mean", "top1_agree", "max_abs_err_rel")
# the modes whose figures docs/cpu.md states: name -> (backend, options). "reference bfloat16" is the bar;
# "cpu default" is what Model.load(path, backend="cpu") runs (activations="auto", bf16 KV cache).
MODES = {
    "reference bfloat16": ("reference", {"dtype": "bfloat16"}),
    "cpu default": ("cpu", {}),
    "cpu float, f32 KV": ("cpu", {"activations": "float", "kv_dtype": "float32"}),
    "cpu float": ("cpu", {"activations": "float"}),
    "cpu int16, f32 KV": ("cpu", {"activations": "int16", "kv_dtype": "float32"}),
    "cpu int16": ("cpu", {"activations": "int16"}),
    "cpu int8, f32 KV": ("cpu", {"activations": "int8", "kv_dtype": "float32"}),
    "cpu int8": ("cpu", {"activations": "int8"}),
}


def load_mode(name: str, path, reference):
    """The model of mode `name` (a key of `MODES`) on the checkpoint at `path`. `reference` is the float32
    reference Model of that checkpoint: the bfloat16 reference is a twin of it over the same dequantized
    float32 weights (no second copy: ~16 GiB at real width, 4 layers); `reference` is left unchanged."""

    backend, options = MODES[name]
    if backend != "reference":
        return Model.load(path, backend=backend, **options)
    impl = reference.reference_model
    return reference.with_backend(ReferenceBackend.over(ReferenceModel(reference.config, impl.params, **options)))


def prompt(vocab_size: int, n: int, seed: int = 0) -> list:
    """`n` token ids drawn uniformly from the vocabulary (seeded): the prompt of the figures."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, n)]


def run_greedy(model, ids: Sequence[int], n: int):
    """Prefill logits of every position of `ids`, then `n` greedy steps: (prefill [L, V], decode rows [n, V],
    tokens) with tokens the n + 1 argmaxes (the first from the prefill's last row)."""
    s = model.new_session()
    pre = model.prefill(s, ids, return_logits="all")
    toks, rows = [int(np.argmax(pre[-1]))], []
    for _ in range(n):
        rows.append(model.decode_step(s, toks[-1]))
        toks.append(int(np.argmax(rows[-1])))
    return pre, np.stack(rows).reshape(n, pre.shape[1]), toks


def greedy_sequence(reference, prompt: Sequence[int], n: int) -> tuple[list, np.ndarray]:
    """`prompt` followed by `n` tokens of `reference`'s greedy continuation, and the reference's logits at
    every position of that sequence ([len(prompt) + n, V]: exactly what `teacher_forced` gives on it)."""
    if len(prompt) < 1 or n < 0:
        raise ValueError(f"need a non-empty prompt and n >= 0, got {len(prompt)} prompt tokens and n={n}")
    pre, dec, toks = run_greedy(reference, prompt, n)
    return [int(t) for t in prompt] + toks[:n], np.concatenate([pre, dec])


def teacher_forced(model, tokens: Sequence[int], prompt_len: int) -> np.ndarray:
    """Logits [len(tokens), V] of `model` at every position of `tokens`: the first `prompt_len` tokens as
    one prefill, each later token as one decode step."""
    if not 1 <= prompt_len <= len(tokens):
        raise ValueError(f"prompt_len must be in 1..{len(tokens)} (the number of tokens), got {prompt_len}")
    s = model.new_session()
    rows = [model.prefill(s, tokens[:prompt_len], return_logits="all")]
    rows += [model.decode_step(s, int(t))[None] for t in tokens[prompt_len:]]
    return np.concatenate(rows)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def measures(want: np.ndarray, got: np.ndarray) -> dict:
    """The contract's measures (module docstring) of logits `got` against the reference's `want`, both
    [positions, V]; also ``positions``."""
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    if want.ndim != 2 or want.shape != got.shape:
        raise ValueError(f"logits must both be [positions, vocab], got {want.shape} and {got.shape}")
    if not np.isfinite(got).all():
        raise ValueError("the compared logits contain NaN or inf")
    lp, lq = _log_softmax(want), _log_softmax(got)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    d = got - want
    span = np.maximum(want.max(axis=-1) - want.min(axis=-1), 1e-30)
    spread = np.sqrt(np.mean((want - want.mean(axis=-1, keepdims=True)) ** 2))
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
            "max_abs_err_rel": float((np.abs(d).max(axis=-1) / span).max()),
            "rms_rel": float(np.sqrt(np.mean(d * d)) / max(spread, 1e-30)),
            "positions": int(want.shape[0])}


def perplexity(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] under logits[:-1] (logits [len(tokens), V] at
    every position, teacher-forced): the text's perplexity under the model."""
    z = np.asarray(logits, np.float64)
    t = np.asarray(tokens, np.int64)
    if z.ndim != 2 or z.shape[0] != t.shape[0] or t.shape[0] < 2:
        raise ValueError(f"need logits [n, vocab] for n >= 2 tokens, got {z.shape} for {t.shape[0]} tokens")
    if t.min() < 0 or t.max() >= z.shape[1]:
        raise ValueError(f"token ids must be in 0..{z.shape[1] - 1}")
    lp = _log_softmax(z[:-1])
    return float(np.exp(-lp[np.arange(t.shape[0] - 1), t[1:]].mean()))


def agreement(base: np.ndarray, other: np.ndarray, tokens: Sequence[int]) -> dict:
    """How `other`'s teacher-forced logits on `tokens` agree with `base`'s (both [len(tokens), V]; a longer
    vocabulary is cut to the common one): ``top1_agree`` (the fraction of positions with the same argmax),
    ``ppl_base`` / ``ppl_other`` and ``ppl_ratio`` = other / base (`perplexity`), ``max_abs_diff`` /
    ``mean_abs_diff`` of the logits, ``kl_mean`` (KL(base || other), nats) and ``positions``."""
    base, other = np.asarray(base, np.float64), np.asarray(other, np.float64)
    if base.ndim != 2 or other.ndim != 2 or base.shape[0] != other.shape[0]:
        raise ValueError(f"logits must both be [positions, vocab], got {base.shape} and {other.shape}")
    v = min(base.shape[1], other.shape[1])
    base, other = base[:, :v], other[:, :v]
    m = measures(base, other)
    d = np.abs(other - base)
    pb, po = perplexity(base, tokens), perplexity(other, tokens)
    return {"top1_agree": m["top1_agree"], "ppl_base": pb, "ppl_other": po, "ppl_ratio": po / pb,
            "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "kl_mean": m["kl_mean"],
            "positions": m["positions"], "vocab": int(v)}


def compare(model, reference, tokens: Sequence[int], prompt_len: int) -> dict:
    """`measures` of `model` against `reference` (a Model, normally the float32 reference backend, or its
    teacher-forced logits on `tokens`) on `tokens`, teacher-forced with the first `prompt_len` as prefill."""
    want = reference if isinstance(reference, np.ndarray) else teacher_forced(reference, tokens, prompt_len)
    return measures(want, teacher_forced(model, tokens, prompt_len))


def meets(m: dict, bar: dict) -> list:
    """The contract's measures in which `m` is less accurate than `bar` (empty: `m` meets the contract set
    by `bar`): lower is better for each except ``top1_agree``."""
    worse = []
    for k in CONTRACT:
        if (m[k] < bar[k]) if k == "top1_agree" else (m[k] > bar[k]):
            worse.append(f"{k} {m[k]:.3g} vs {bar[k]:.3g}")
    return worse
