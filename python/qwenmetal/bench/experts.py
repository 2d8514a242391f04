"""Expert-streaming figures of a benchmark run: the backend's cumulative expert-cache counters
(``expert_counters()``: lookups, hits, bytes_read, io_seconds) read before and after a timed block,
turned into the block's hit rate and per-token bytes read and I/O time."""
from __future__ import annotations

from typing import Mapping


def expert_counters(model) -> dict | None:
    """The backend's raw expert-cache counters now; None for a backend that does not stream."""
    c = model.expert_counters()
    return dict(c) if c and c.get("streaming") else None


def per_token(before: Mapping | None, after: Mapping | None, tokens: int) -> dict | None:
    """The expert figures of a block that ran `tokens` tokens between the two counter readings."""
    if not before or not after or tokens <= 0:
        return None
    lookups = after["lookups"] - before["lookups"]
    return {"streaming": True, "policy": after["policy"], "slots_per_layer": int(after["slots_per_layer"]),
            "hit_rate": (after["hits"] - before["hits"]) / lookups if lookups else None,
            "bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / tokens,
            "io_seconds_per_token": (after["io_seconds"] - before["io_seconds"]) / tokens, "tokens": tokens}
