"""Where qwenmetal keeps what it can rebuild (one rule for every cache: fixtures, benchmark
checkpoints, compiled simulator kernels, weight hashes): ``$QWENMETAL_CACHE``, else
``$XDG_CACHE_HOME/qwenmetal``, else ``~/.cache/qwenmetal``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory, or a subdirectory of it (not created here)."""
    env = os.environ.get("QWENMETAL_CACHE")
    if env:
        root = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "qwenmetal"
    return root.joinpath(*parts)
