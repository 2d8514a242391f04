"""Where things are: the cache qwenmetal keeps what it can rebuild in (one rule for every cache: fixtures,
benchmark checkpoints, compiled simulator kernels, weight hashes: ``$QWENMETAL_CACHE``, else
``$XDG_CACHE_HOME/qwenmetal``, else ``~/.cache/qwenmetal``), and a checkpoint given as a directory or a
Hugging Face hub id."""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def cache_dir(*parts: str) -> Path:
    """The cache directory, or a subdirectory of it (not created here)."""
    env = os.environ.get("QWENMETAL_CACHE")
    if env:
        root = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "qwenmetal"
    return root.joinpath(*parts)


def resolve_checkpoint(path_or_id: str | os.PathLike, revision: str | None = None) -> str:
    """A local directory as is; otherwise a Hugging Face hub id downloaded (or taken from the
    local hub cache) with huggingface_hub, which shows its own progress bars."""
    p = os.fspath(path_or_id)
    if os.path.isdir(p):
        return p
    if os.path.exists(p):
        raise CheckpointError(f"{p}: expected a checkpoint directory, got a file")
    if not _HUB_ID.match(p):
        raise CheckpointError(f"{p}: no such directory, and not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(p, revision=revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:  # network, auth, missing repo: say which and how to work offline
        raise CheckpointError(
            f"could not get {p!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Download it once with network access (or pass a local directory).") from e
