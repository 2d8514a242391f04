"""Expert-streaming figures of a benchmark run: the backend's cumulative expert-cache counters
(``info()["experts"]``: bytes_read, io_seconds, and lookups / hits where the backend reports them) read
before and after a timed block, turned into per-token figures. Where the backend reports no lookup
counts, the hit rate of the block is derived from the bytes it read: every miss reads one expert
(``StreamPlan.expert_bytes``), every token looks up top-k experts in each MoE layer."""
from __future__ import annotations

from typing import Mapping


def expert_counters(model) -> dict | None:
    """The backend's expert stats now (None when it reports none, e.g. a backend without streaming)."""
    info = model._backend.info() if hasattr(model._backend, "info") else {}
    ex = info.get("experts") if isinstance(info, Mapping) else None
    return dict(ex) if ex else None


def per_token(before: Mapping | None, after: Mapping | None, tokens: int, lookups_per_token: int,
              expert_size: int) -> dict | None:
    """Per-token expert figures of a block that ran `tokens` tokens between the two counter readings."""
    if not before or not after or tokens <= 0:
        return None
    read = after["bytes_read"] - before["bytes_read"]
    io = after.get("io_seconds", 0.0) - before.get("io_seconds", 0.0)
    if "lookups" in after and "hits" in after:
        lookups = after["lookups"] - before["lookups"]
        hits = after["hits"] - before["hits"]
        how = "counted"
    else:
        lookups = tokens * lookups_per_token
        hits = lookups - (read / expert_size if expert_size else 0)
        how = "from bytes read"
    return {"streaming": bool(after.get("streaming")), "policy": after.get("policy"),
            "slots_per_layer": after.get("slots_per_layer"),
            "hit_rate": (hits / lookups) if lookups else None, "hit_rate_method": how,
            "bytes_read_per_token": read / tokens, "io_seconds_per_token": io / tokens, "tokens": tokens}
