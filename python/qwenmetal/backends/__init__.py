"""The backend registry: which backends exist, which this build and machine can run, and what
``backend="auto"`` picks. Each backend is a factory ``(weights, **options) -> backend`` implementing the
contract of docs/architecture.md."""
from __future__ import annotations

from typing import Callable

from .cpu import CpuBackend
from .cpu import available as cpu_available
from .metal import MetalBackend, MetalSimBackend, metal_available, sim_available
from .reference import ReferenceBackend

#: every backend qwenmetal has (some need a build option or a machine: "metal" a Mac with a Metal device)
ALL_BACKENDS = ("reference", "cpu", "metal", "metal-sim")
#: name -> factory(weights, **options), for the backends available here
BACKENDS: dict[str, Callable] = {
    "reference": ReferenceBackend, **({"cpu": CpuBackend} if cpu_available() else {}),
    **({"metal-sim": MetalSimBackend} if sim_available() else {}),
    **({"metal": MetalBackend} if metal_available() else {})}
#: what backend="auto" picks: the first of these that is available (metal only on a Mac with a Metal
#: device; metal-sim never: it is a verification tool, not a fast path)
AUTO_ORDER = ("metal", "cpu", "reference")


def resolve_backend(name: str) -> str:
    """The backend `name` stands for here ("auto": the first available of `AUTO_ORDER`). Raises ValueError
    for an unknown name or one not available in this build / on this machine, listing the available ones."""
    if name == "auto":
        return next(b for b in AUTO_ORDER if b in BACKENDS)
    if name not in BACKENDS:
        if name in ALL_BACKENDS:
            raise ValueError(f"backend {name!r} is not available in this build or on this machine; "
                             f"available: {tuple(BACKENDS)}")
        raise ValueError(f"unknown backend {name!r}; the backends are {ALL_BACKENDS} (available here: "
                         f"{tuple(BACKENDS)}) and 'auto'")
    return name


def backend_factory(name: str) -> Callable:
    """The factory of backend `name` (see `resolve_backend`)."""
    return BACKENDS[resolve_backend(name)]
