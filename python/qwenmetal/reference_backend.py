"""backend="reference": the numpy forward pass (`qwenmetal.reference`) behind the backend contract
(docs/architecture.md). float32 on dequantized weights; the ground truth the other backends are checked
against, meant for small checkpoints."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from .interrupts import sigint_deferred

if TYPE_CHECKING:
    from .reference import ReferenceState
    from .weights import Weights


class ReferenceBackend:
    """numpy reference (`qwenmetal.reference`): float32 on dequantized weights."""

    name = "reference"

    def __init__(self, weights: Weights, dtype: str = "float32", gdn_mode: str = "chunked", chunk_size: int = 64):
        from .reference import ReferenceModel

        need = weights.dense_float32_nbytes()
        total = _total_memory()
        if total and need > 0.75 * total:
            raise MemoryError(
                f"the reference backend dequantizes every weight to float32: {need / 2**30:.1f} GiB, more than "
                f"this machine can hold ({total / 2**30:.1f} GiB). It is meant for small checkpoints.")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if gdn_mode not in ("chunked", "recurrent"):
            raise ValueError(f"gdn_mode must be 'chunked' or 'recurrent', got {gdn_mode!r}")
        self.impl = ReferenceModel(weights.config, weights.dense_float32(), dtype=dtype)
        self.dtype, self.gdn_mode, self.chunk_size = dtype, gdn_mode, int(chunk_size)

    def new_state(self) -> ReferenceState:
        """A zeroed state (position 0)."""
        return self.impl.new_state()

    def forward(self, state: ReferenceState, ids: np.ndarray, logits: str, consumed: list | None = None) -> tuple:
        """Run `ids` after `state` and return (state, logits): computed on a copy, then committed to
        `state` together with `consumed` (a session's token list, extended by `ids`) in one step that a
        Ctrl-C cannot split, so an error or interrupt leaves both unchanged."""
        new = state.copy()
        out = self.impl.forward(new, ids, logits=logits, gdn_mode=self.gdn_mode, chunk_size=self.chunk_size)
        add = [int(i) for i in ids]
        with sigint_deferred():
            vars(state).update(vars(new))
            if consumed is not None:
                consumed.extend(add)
        return state, out

    def state_to_arrays(self, state: ReferenceState) -> dict:
        """The backend-independent state layout of Session.save (see docs/architecture.md)."""
        return state.to_arrays()

    def state_from_arrays(self, arrays: dict) -> ReferenceState:
        """The inverse of `state_to_arrays`."""
        from .reference import ReferenceState
        return ReferenceState.from_arrays(arrays)


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
