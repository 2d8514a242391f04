"""Token sampling from float32 logits.

Greedy (argmax) at temperature 0. Otherwise temperature, then top-k, then top-p (nucleus) on the
tempered distribution, drawn with a seeded numpy Generator so seeded runs repeat exactly.
Ids at or beyond the tokenizer's vocabulary (the padded rows of lm_head) are never chosen.
"""
from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if not (temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray, vocab_used: int | None = None) -> int:
        x = np.asarray(logits, dtype=np.float32)
        if vocab_used is not None:
            x = x[:vocab_used]
        if self.temperature == 0.0:
            return int(np.argmax(x))
        x = x.astype(np.float64) / self.temperature
        if self.top_k and self.top_k < x.size:
            kth = np.partition(x, -self.top_k)[-self.top_k]
            x = np.where(x < kth, -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))
