"""Prefix cache for hybrid (Gated DeltaNet + attention) models.

The attention KV cache could be truncated to any shorter prefix, but the GDN conv and recurrent states
cannot: they summarise *all* tokens seen so far. So instead of truncating, generation keeps immutable
snapshots of the whole session state at a few points of every prompt --

* at chunk boundaries while prefilling (absolute positions that are multiples of ``chunk_tokens``): the
  ones at ``chunk_tokens`` times a power of two, and the last two before the end of the prompt -- a few
  snapshots per prompt, so that copying the growing state stays linear in the prompt's length,
* where the conversation's messages end and the generation prompt starts (``model.chat``),
* the end of the prompt (with the logits of its last token, so an identical prompt needs no prefill),
* the end of the turn (prompt + generated tokens),

and a new prompt resumes from the longest snapshot whose tokens are a prefix of it, compared token by
token (never by text or by a client-supplied key), then prefills only the rest. Entries are bounded by
bytes (state + logits) with least-recently-used eviction. Everything goes through the backend contract
(``Session.snapshot``/``restore``, i.e. ``state.copy()`` and ``state.nbytes``): no backend needs to truncate.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .model import SessionSnapshot

DEFAULT_CHUNK_TOKENS = 2048


def default_max_bytes() -> int:
    """10 % of physical memory, at most 8 GiB (256 MiB if the size is unknown: sysconf missing, failing or
    reporting -1)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return min(8 << 30, total // 10) if total > 0 else 256 << 20


@dataclass
class CacheEntry:
    """One cached state: the session after exactly `tokens`, and (kind "prompt"/"turn") the next logits."""

    tokens: tuple
    snapshot: object = field(repr=False)          # a SessionSnapshot
    logits: np.ndarray | None = field(default=None, repr=False)   # next-token logits after `tokens`
    kind: str = "prompt"

    @property
    def nbytes(self) -> int:
        """Bytes held by the snapshot and the logits."""
        return int(self.snapshot.state.nbytes) + (0 if self.logits is None else int(self.logits.nbytes))


class PrefixCache:
    """LRU cache of session snapshots keyed by their exact token sequence.

    ``max_bytes``: budget for states + logits (default :func:`default_max_bytes`); ``chunk_tokens``: the
    prefill chunk and snapshot interval. ``model.prefix_cache`` is one of these (set it to ``None`` to
    disable caching for a model, or pass ``cache=False`` to a single call).
    """

    def __init__(self, max_bytes: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self.chunk_tokens = int(chunk_tokens)
        self._entries: "OrderedDict[tuple, CacheEntry]" = OrderedDict()
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = 0
        self.tokens_reused = 0

    # ---- queries -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by all entries."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> list:
        """(length, kind, bytes) of every entry, most recently used last."""
        with self._lock:
            return [(len(e.tokens), e.kind, e.nbytes) for e in self._entries.values()]

    def lookup(self, tokens: Sequence[int], need_logits: bool = True) -> CacheEntry | None:
        """The longest entry whose tokens are a prefix of ``tokens``: shorter than ``tokens``, or equal
        to it when the entry holds the next-token logits (and ``need_logits``). Marks it recently used."""
        tokens = tuple(int(t) for t in tokens)
        n = len(tokens)
        best = None
        with self._lock:
            for key, e in self._entries.items():
                k = len(key)
                if k > n or (best is not None and k <= len(best.tokens)):
                    continue
                if k == n and need_logits and e.logits is None:
                    continue
                if tokens[:k] == key:
                    best = e
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best.tokens)
            self.hits += 1
            self.tokens_reused += len(best.tokens)
            return best

    # ---- updates -------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], snapshot: SessionSnapshot, logits: np.ndarray | None = None,
            kind: str = "prompt") -> bool:
        """Store ``snapshot`` (its state must be the state after exactly ``tokens``). An existing entry
        for the same tokens is kept (and gains the logits if it had none). Returns False if the entry
        alone exceeds the budget."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            return False
        with self._lock:
            old = self._entries.get(tokens)
            if old is not None:
                if old.logits is None and logits is not None:
                    old.logits = np.array(logits, dtype=np.float32, copy=True)
                self._entries.move_to_end(tokens)
                self._evict()
                return True
            e = CacheEntry(tokens, snapshot, None if logits is None else np.array(logits, np.float32, copy=True), kind)
            if e.nbytes > self.max_bytes:
                return False
            self._entries[tokens] = e
            self._evict()
            return tokens in self._entries

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        while total > self.max_bytes and self._entries:
            _, e = self._entries.popitem(last=False)
            total -= e.nbytes
            self.evictions += 1

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self)} entries, {self.nbytes / 2**20:.1f} / {self.max_bytes / 2**20:.0f} MiB, "
                f"chunk {self.chunk_tokens} tokens, {self.hits} hits / {self.misses} misses)")
