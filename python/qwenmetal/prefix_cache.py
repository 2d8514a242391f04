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
token (never by text or by a client-supplied key), then prefills only the rest. A token that holds an image's
features is compared by the image's content hash instead (`qwenmetal.mrope.cache_key`: the image pads of two
different images of the same size are the same token ids; docs/vision.md, "Positions and caches"). Entries are bounded by
bytes (state + logits) with least-recently-used eviction. Everything goes through the backend contract
(``Session.snapshot``/``restore``, i.e. ``state.copy()`` and ``state.nbytes``): no backend needs to truncate.

An optional on-disk tier (:class:`DiskTier`, ``PrefixCache.attach_disk``) keeps chosen entries -- the ends of
chat turns -- as session files in a directory, bounded in bytes, so that another process (a restarted
server) resumes from them: a lookup that finds a longer prefix on disk than in memory loads it.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .mrope import cache_key
from .session import SessionSnapshot
from .session_io import read_tokens

DEFAULT_CHUNK_TOKENS = 2048
DEFAULT_DISK_BYTES = 4 << 30


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
        self.disk: DiskTier | None = None

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

    def lookup(self, tokens: Sequence[int], need_logits: bool = True, images=()) -> CacheEntry | None:
        """The longest entry whose tokens are a prefix of ``tokens``: shorter than ``tokens``, or equal
        to it when the entry holds the next-token logits (and ``need_logits``). Marks it recently used.
        With a disk tier, a longer prefix found on disk is loaded (and kept in memory). ``images``: the
        (start, end, digest) spans of ``tokens`` that hold images (`qwenmetal.mrope.ImageSpan`); an entry
        matches only if its images are the same images at the same places."""
        tokens = cache_key(tokens, images)
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
            if self.disk is not None:
                have = len(best.tokens) if best is not None else 0
                found = self.disk.load_longest(tokens, have, allow_equal=not need_logits)
                if found is not None:
                    best = CacheEntry(found.tokens, found, None, "disk")
                    fk = cache_key(found.tokens, found.images)
                    if best.nbytes <= self.max_bytes and fk not in self._entries:
                        self._entries[fk] = best
                        self._evict()
            if best is None:
                self.misses += 1
                return None
            bk = cache_key(best.tokens, getattr(best.snapshot, "images", ()))
            if bk in self._entries:
                self._entries.move_to_end(bk)
            self.hits += 1
            self.tokens_reused += len(best.tokens)
            return best

    # ---- updates -------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], snapshot: SessionSnapshot, logits: np.ndarray | None = None,
            kind: str = "prompt") -> bool:
        """Store ``snapshot`` (its state must be the state after exactly ``tokens``). An existing entry
        for the same tokens is kept (and gains the logits if it had none). Returns False if the entry
        alone exceeds the budget. The entry is keyed on the tokens and the snapshot's images."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            return False
        key = cache_key(tokens, getattr(snapshot, "images", ()))
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                if old.logits is None and logits is not None:
                    old.logits = np.array(logits, dtype=np.float32, copy=True)
                self._entries.move_to_end(key)
                self._evict()
                return True
            e = CacheEntry(tokens, snapshot, None if logits is None else np.array(logits, np.float32, copy=True), kind)
            if e.nbytes > self.max_bytes:
                return False
            self._entries[key] = e
            self._evict()
            return key in self._entries

    def persist(self, tokens, images=(), **metadata) -> bool:
        """Write the entry for exactly ``tokens`` (with ``images``, as `lookup`) to the disk tier (in the
        background), with JSON-serialisable ``metadata`` beside it. Returns False when there is no disk tier or
        no such entry."""
        with self._lock:
            e = self._entries.get(cache_key(tokens, images))
            if e is None or self.disk is None:
                return False
            self.disk.save(e.tokens, e.snapshot, {"kind": e.kind, **metadata})
            return True

    def attach_disk(self, model, directory: str | os.PathLike, max_bytes: int | None = None) -> "DiskTier":
        """Add an on-disk tier for `model`'s states under `directory` (see :class:`DiskTier`)."""
        self.disk = DiskTier(model, directory, DEFAULT_DISK_BYTES if max_bytes is None else max_bytes)
        return self.disk

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


# ---------------------------------------------------------------------------------------------------
_LIVE_TIERS: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for tier in list(_LIVE_TIERS):
        tier.flush()


class DiskTier:
    """Prefix-cache entries as session files (`qwenmetal.session_io`'s format, written atomically) in
    ``directory/<model identity>/``, at most ``max_bytes`` of them (least recently used removed first).

    Writes run on a background thread (``flush()`` waits for them; they are flushed at exit). The index of
    the files' token sequences is read when the tier is made and refreshed when a lookup finds nothing (at
    most every ``RESCAN_SECONDS``), so files written by another process are found too. A file that cannot
    be read (removed by another process, truncated, of another model) is skipped, never an error."""

    RESCAN_SECONDS = 2.0                           # a lookup that misses re-reads the directory at most this often

    def __init__(self, model, directory: str | os.PathLike, max_bytes: int = DEFAULT_DISK_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
            raise ValueError(f"the disk cache size must be a positive number of bytes, got {max_bytes!r}")
        self.model = model
        self.max_bytes = int(max_bytes)
        self.directory = Path(directory) / model.identity["identity"][:16]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot create the prompt cache directory {directory}: {e.strerror}") from None
        self._index: dict = {}                    # file name -> (tokens, metadata)
        self._skipped: set = set()
        self._lock = threading.RLock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.writes = self.loads = 0
        self.scan()

    # ---- index -----------------------------------------------------------------------------------------
    def scan(self) -> None:
        """Index the files not indexed yet (and forget removed ones)."""
        with self._lock:
            self._scanned = time.monotonic()
            names = {p.name for p in self.directory.glob("*.safetensors")}
            for gone in set(self._index) - names:
                del self._index[gone]
            for name in sorted(names - set(self._index) - self._skipped):
                path = self.directory / name
                try:
                    tokens, header = read_tokens(path)
                except (OSError, ValueError):      # unreadable or half-removed: not a cache entry
                    self._skipped.add(name)
                    continue
                if tokens:
                    self._index[name] = (tuple(tokens), header.get("metadata") or {},
                                         cache_key(tokens, header.get("images", ())))

    def entries(self) -> list:
        """``(tokens, metadata)`` of every file, as indexed."""
        with self._lock:
            return [(t, md) for t, md, _ in self._index.values()]

    def _longest(self, tokens: tuple, longer_than: int, allow_equal: bool) -> str | None:
        best, best_len = None, longer_than
        for name, (_, _, t) in self._index.items():
            k = len(t)
            if k <= best_len or k > len(tokens) or (k == len(tokens) and not allow_equal):
                continue
            if tokens[:k] == t:
                best, best_len = name, k
        return best

    def load_longest(self, tokens, longer_than: int = 0, allow_equal: bool = False):
        """The snapshot of the longest file whose tokens are a prefix of `tokens` (a `cache_key`) and longer
        than `longer_than` (equal to `tokens` only if `allow_equal`), or None."""
        tokens = tuple(tokens)
        with self._lock:
            name = self._longest(tokens, longer_than, allow_equal)
            if name is None and time.monotonic() - self._scanned > self.RESCAN_SECONDS:
                self.scan()                        # files another process wrote meanwhile
                name = self._longest(tokens, longer_than, allow_equal)
            while name is not None:
                path = self.directory / name
                try:
                    snap = SessionSnapshot.load(path, self.model)
                    os.utime(path)                 # recently used
                except (OSError, ValueError):      # removed meanwhile, or not readable after all
                    self._index.pop(name, None)
                    self._skipped.add(name)
                    name = self._longest(tokens, longer_than, allow_equal)
                    continue
                self.loads += 1
                return snap
            return None

    # ---- writes ----------------------------------------------------------------------------------------
    def save(self, tokens, snapshot, metadata: dict | None = None) -> None:
        """Queue writing `snapshot` (the state after exactly `tokens`) with `metadata`."""
        self._queue.put((tuple(int(t) for t in tokens), snapshot, dict(metadata or {})))
        with self._lock:
            if self._thread is None:              # the writer runs while there is work, then ends
                _LIVE_TIERS.add(self)
                self._thread = threading.Thread(target=self._work, name="qwenmetal-prompt-cache", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()

    def _work(self) -> None:
        while True:
            with self._lock:
                try:
                    tokens, snap, md = self._queue.get_nowait()
                except queue.Empty:
                    self._thread = None
                    return
            try:
                self._write(tokens, snap, md)
            except Exception:  # noqa: BLE001 - a full disk or a backend without state export: no entry
                pass
            finally:
                self._queue.task_done()

    def _write(self, tokens: tuple, snap, md: dict) -> None:
        h = hashlib.sha256(np.asarray(tokens, np.int64).tobytes())
        for a, b, d in getattr(snap, "images", ()):   # a text-only entry keeps its name of before
            h.update(f"|{a}:{b}:{d}".encode())
        name = h.hexdigest()[:32] + ".safetensors"
        path = self.directory / name
        snap.save(path, md)
        with self._lock:
            self._index[name] = (tokens, md, cache_key(tokens, getattr(snap, "images", ())))
            self._skipped.discard(name)
            self.writes += 1
            self._evict()

    def _evict(self) -> None:
        files = []
        for p in self.directory.glob("*.safetensors"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(f[1] for f in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            self._index.pop(p.name, None)
            total -= size
        now = time.time()                          # partial files of writers that died (an hour old)
        for p in self.directory.glob(".*.partial"):
            try:
                if now - p.stat().st_mtime > 3600:
                    p.unlink(missing_ok=True)
            except OSError:
                continue

    @property
    def nbytes(self) -> int:
        """Bytes of the cache files in the directory."""
        total = 0
        for p in self.directory.glob("*.safetensors"):
            try:
                total += p.stat().st_size
            except OSError:                        # removed meanwhile
                continue
        return total

    def __repr__(self) -> str:
        return f"DiskTier({self.directory}, {len(self._index)} files, at most {self.max_bytes / 2**20:.0f} MiB)"
