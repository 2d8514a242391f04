"""Token sampling from float32 logits.

``Sampler(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed)``.
The pipeline, in this order (documented in docs/usage.md):

1. Ids at or beyond the tokenizer's vocabulary (the padded rows of lm_head) are dropped: never sampled.
2. Reported log-probabilities are ``log_softmax`` of these raw logits -- the model's own distribution,
   before penalties, temperature and filters (as mlx-lm and vLLM report them).
3. ``repetition_penalty`` (HF/vLLM convention, multiplicative and sign-aware: a positive logit is divided
   by it, a negative one multiplied) on every distinct id in the context: the prompt *and* the generated
   tokens.
4. ``presence_penalty`` / ``frequency_penalty`` (OpenAI/vLLM convention, additive) on the tokens generated
   in this call: ``logit -= presence * [count > 0] + frequency * count``.
   With a grammar (`qwenmetal.grammar`), the ids its token mask excludes are set to -inf here: they are
   never chosen, and top-k, top-p and min-p see only the allowed ids.
5. ``temperature == 0``: greedy (argmax of the penalised logits; the lowest id wins an exact tie).
6. Otherwise divide by the temperature, then keep the ``top_k`` most likely ids (0 = off), then the
   smallest set whose probability reaches ``top_p`` (1 = off), then drop ids whose probability is below
   ``min_p`` times the most likely one's (0 = off) -- HF's order -- and draw from what is left with the
   sampler's seeded numpy Generator: the same seed gives the same tokens.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import InputError

#: the sampling parameters (each is checked by `check_sampling`)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")
#: generation_config.json keys that give sampling defaults
GENERATION_CONFIG_KEYS = SAMPLING_KEYS[:-1]


def config_defaults(generation_config: dict | None) -> dict:
    """The sampling defaults a checkpoint's generation_config.json gives (``do_sample: false`` there means
    greedy: temperature 0); its numbers only, checked later where they are used."""
    g = generation_config or {}
    kw = {k: g[k] for k in GENERATION_CONFIG_KEYS
          if isinstance(g.get(k), numbers.Real) and not isinstance(g.get(k), bool)}
    if g.get("do_sample") is False:
        kw["temperature"] = 0.0
    return kw


def _number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
        raise InputError(f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def check_sampling(name: str, value: object) -> float | int | None:
    """The one check of a sampling parameter (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``seed``): returns it normalised
    (float, or int for ``top_k``; ``seed`` an int or None) or raises `InputError` (a ValueError) naming it."""
    if name == "seed":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise InputError(f"seed must be an integer or None, got {value!r}", name)
        if value is not None and value < 0:
            raise InputError(f"seed must be >= 0 (or None), got {int(value)}", name)
        return None if value is None else int(value)
    if name == "top_k":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) and not (
                isinstance(value, float) and value.is_integer()):
            raise InputError(f"top_k must be an integer, got {value!r}", name)
        if value < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {int(value)}", name)
        return int(value)
    v = _number(name, value)
    if name == "temperature" and v < 0.0:
        raise InputError(f"temperature must be >= 0, got {v}", name)
    if name == "top_p" and not (0.0 < v <= 1.0):
        raise InputError(f"top_p must be in (0, 1], got {v}", name)
    if name == "min_p" and not (0.0 <= v <= 1.0):
        raise InputError(f"min_p must be in [0, 1], got {v}", name)
    if name == "repetition_penalty" and v <= 0.0:
        raise InputError(f"repetition_penalty must be > 0 (1 = off), got {v}", name)
    return v


@dataclass
class SampleResult:
    """One sampled token, with its log-probability and the alternatives when they were asked for."""

    token: int
    logprob: float | None = None                          # of `token` under the raw model distribution
    top_logprobs: list | None = None                      # [(id, logprob)] most likely first


def _drafted(draft_probs, n: int, draft: int) -> np.ndarray:
    """`verify_draft`'s drafted distribution, checked: a probability vector over (at least) the `n` logits that
    could have produced `draft`; ValueError otherwise."""
    q = np.asarray(draft_probs, dtype=np.float64)
    if q.ndim != 1 or q.size < n:
        raise ValueError(f"draft_probs must be a probability vector over the {n} logits, got shape {q.shape}")
    if not (q.min() >= 0.0 and abs(q.sum() - 1.0) <= 1e-6):
        raise ValueError(f"draft_probs must be non-negative and sum to 1 (sum {q.sum():.6g}, min {q.min():.3g})")
    if not 0 <= draft < q.size or not q[draft] > 0.0:
        raise ValueError(f"draft {draft} has no probability under draft_probs: it was not drawn from them")
    return q


class Sampler:
    """Turns logits into a token id. See the module docstring for the exact pipeline."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 seed: int | None = None):
        self.temperature = check_sampling("temperature", temperature)
        self.top_k = check_sampling("top_k", top_k)
        self.top_p = check_sampling("top_p", top_p)
        self.min_p = check_sampling("min_p", min_p)
        self.repetition_penalty = check_sampling("repetition_penalty", repetition_penalty)
        self.presence_penalty = check_sampling("presence_penalty", presence_penalty)
        self.frequency_penalty = check_sampling("frequency_penalty", frequency_penalty)
        self.seed = check_sampling("seed", seed)
        self.rng = np.random.default_rng(self.seed)

    @classmethod
    def from_generation_config(cls, generation_config: dict | None, **overrides) -> "Sampler":
        """Defaults from a checkpoint's generation_config.json (``do_sample: false`` means greedy), with
        ``overrides`` (``None`` values ignored) on top: ``GenerationOptions(**overrides).sampler(...)``."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - set(SAMPLING_KEYS)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**{**config_defaults(generation_config), **given})

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token, no randomness."""
        return self.temperature == 0.0

    def __repr__(self) -> str:
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"min_p={self.min_p}, repetition_penalty={self.repetition_penalty}, "
                f"presence_penalty={self.presence_penalty}, frequency_penalty={self.frequency_penalty}, "
                f"seed={self.seed})")

    # -----------------------------------------------------------------------------------------------
    def __call__(self, logits: np.ndarray, vocab_used: int | None = None, *, context: Sequence[int] = (),
                 generated: Sequence[int] = ()) -> int:
        return self.sample(logits, vocab_used, context=context, generated=generated).token

    def sample(self, logits: np.ndarray, vocab_used: int | None = None, *, context: Sequence[int] = (),
               generated: Sequence[int] = (), logprobs: bool = False, top_logprobs: int = 0,
               allowed: np.ndarray | None = None) -> SampleResult:
        """One token. ``context``: every token before this one (prompt and generated, for the repetition
        penalty); ``generated``: the tokens generated so far in this call (presence/frequency penalties).
        With ``logprobs``/``top_logprobs`` the result carries the chosen token's log-probability and the
        ``top_logprobs`` most likely alternatives under the raw model distribution. ``allowed``: a bool mask
        over the ids (a grammar's, `qwenmetal.grammar`): the others are never drawn (after the penalties,
        before temperature and the filters; log-probabilities stay the raw model's)."""
        raw, x = self._penalised(logits, vocab_used, context, generated, allowed)
        tok = int(np.argmax(x)) if self.temperature == 0.0 else self._draw(x / self.temperature)
        return self._result(raw, tok, logprobs, top_logprobs)

    def verify_draft(self, logits: np.ndarray, draft: int, vocab_used: int | None = None, *,
                     context: Sequence[int] = (), generated: Sequence[int] = (), logprobs: bool = False,
                     top_logprobs: int = 0, draft_probs: np.ndarray | None = None,
                     allowed: np.ndarray | None = None) -> tuple[SampleResult, bool]:
        """The token at a drafted position and whether it is the draft (`qwenmetal.speculative`): the
        distribution is `sample`'s (same penalties, filters, temperature) and so is the token's law. Greedy:
        the argmax, accepted when it equals the draft. Sampling: the rejection rule of speculative sampling
        (Leviathan et al., Chen et al.). A point proposal (`draft_probs` None: the draft was chosen, not drawn)
        is accepted with probability p(draft), otherwise a draw from p with the draft removed, renormalised.
        A draft drawn from `draft_probs` = q (a probability vector over the vocabulary) is accepted with
        probability min(1, p(draft) / q(draft)), otherwise a draw from max(p - q, 0), renormalised (from p
        where that is all zero). Either way the token's law is exactly p. ``allowed``: `sample`'s mask, so a
        draft the grammar does not allow is never kept."""
        raw, x = self._penalised(logits, vocab_used, context, generated, allowed)
        if self.temperature == 0.0:
            tok = int(np.argmax(x))
        elif draft_probs is None:
            cand, p = self._distribution(x / self.temperature)
            hit = np.flatnonzero(cand == int(draft))
            pd = float(p[hit[0]]) if hit.size else 0.0
            if self.rng.random() < pd:
                tok = int(draft)
            else:
                if hit.size:                       # pd < 1 here, so another candidate is left
                    cand, p = np.delete(cand, hit[0]), np.delete(p, hit[0])
                    p = p / p.sum()
                tok = self._pick(cand, p)
        else:
            q = _drafted(draft_probs, x.size, int(draft))
            cand, p = self._distribution(x / self.temperature)
            hit = np.flatnonzero(cand == int(draft))
            pd = float(p[hit[0]]) if hit.size else 0.0
            if self.rng.random() * q[int(draft)] < pd:
                tok = int(draft)
            else:    # p(draft) < q(draft) here, so p - q has positive mass elsewhere: the residual is a law
                resid = np.maximum(p - q[cand], 0.0)
                tok = self._pick(cand, resid / resid.sum())
        return self._result(raw, tok, logprobs, top_logprobs), tok == int(draft)

    def _penalised(self, logits, vocab_used, context, generated, allowed=None) -> tuple[np.ndarray, np.ndarray]:
        """(raw logits, penalised logits), float64, cut to `vocab_used` (steps 1-4 of the pipeline), the ids
        outside `allowed` at -inf."""
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"logits must be 1-D, got shape {x.shape}")
        if vocab_used is not None:
            x = x[:vocab_used]
        x = x.astype(np.float64)
        raw = x
        if self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty:
            x = x.copy()
            if self.repetition_penalty != 1.0:
                ids = np.unique(np.asarray([*context, *generated], dtype=np.int64))
                ids = ids[(ids >= 0) & (ids < x.size)]
                v = x[ids]
                x[ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
            if (self.presence_penalty or self.frequency_penalty) and len(generated):
                ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
                keep = (ids >= 0) & (ids < x.size)
                ids, counts = ids[keep], counts[keep]
                x[ids] -= self.presence_penalty + self.frequency_penalty * counts
        if allowed is not None:
            keep = np.asarray(allowed, dtype=bool)[:x.size]
            if keep.size < x.size:
                keep = np.concatenate([keep, np.zeros(x.size - keep.size, dtype=bool)])
            if not keep.any():
                raise ValueError("the token mask allows no token")
            x = np.where(keep, x, -np.inf)
        return raw, x

    @staticmethod
    def _result(raw: np.ndarray, tok: int, logprobs: bool, top_logprobs: int) -> SampleResult:
        res = SampleResult(tok)
        if logprobs or top_logprobs:
            m = raw.max()
            lse = m + np.log(np.sum(np.exp(raw - m)))
            res.logprob = float(raw[tok] - lse)
            if top_logprobs:
                n = min(int(top_logprobs), raw.size)
                idx = np.argpartition(-raw, n - 1)[:n]
                idx = idx[np.lexsort((idx, -raw[idx]))]
                res.top_logprobs = [(int(i), float(raw[i] - lse)) for i in idx]
        return res

    def _draw(self, x: np.ndarray) -> int:
        """Filters (top-k, top-p, min-p) on tempered logits `x`, then one seeded draw."""
        return self._pick(*self._distribution(x))

    def _distribution(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, their probabilities) after top-k, top-p and min-p on tempered logits `x`, most
        likely first (ties by lower id)."""
        cand = np.arange(x.size)
        if self.top_k and self.top_k < x.size:
            cand = np.argpartition(-x, self.top_k - 1)[:self.top_k]
        v = x[cand]
        order = np.lexsort((cand, -v))                 # most likely first, ties by lower id
        cand, v = cand[order], v[order]
        p = np.exp(v - v[0])
        p /= p.sum()
        n = int(np.count_nonzero(np.isfinite(v)))      # ids a token mask removed are never candidates
        if self.top_p < 1.0:
            n = min(n, int(np.searchsorted(np.cumsum(p), self.top_p)) + 1)
        if self.min_p > 0.0:
            n = min(n, max(1, int(np.sum(p[:n] >= self.min_p * p[0]))))
        return cand[:n], p[:n] / p[:n].sum()

    def _pick(self, cand: np.ndarray, p: np.ndarray) -> int:
        """One seeded draw from `cand` with probabilities `p`."""
        u = self.rng.random()
        j = min(int(np.searchsorted(np.cumsum(p), u, side="right")), p.size - 1)
        return int(cand[j])
