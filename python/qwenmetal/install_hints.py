"""How to install one of qwenmetal's extras, as the installed copy needs it said.

qwenmetal installed from a package index takes ``pip install 'qwenmetal[server]'``; a copy installed from a
source tree (``pip install .``, ``pip install -e .``) or run from one (``PYTHONPATH=python``) takes
``pip install ".[server]"`` in that tree, since an index's qwenmetal may be another project or another
version. Where it cannot tell (an archive or a VCS URL), both forms are given.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse


def _source_tree() -> Path | None:
    """The source tree this copy of the package is imported from (an editable install or PYTHONPATH), if
    it is one: the package's grandparent holds the project's pyproject.toml."""
    root = Path(__file__).resolve().parent.parent.parent
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "qwenmetal"' in text else None


def _direct_url() -> dict | None:
    """The installed distribution's direct_url.json (PEP 610: where pip installed it from when that was not
    an index), or None: installed from an index, or not installed at all."""
    try:
        text = metadata.distribution("qwenmetal").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def install_hint(extra: str) -> str:
    """The pip command that installs `extra` (e.g. "server") for the qwenmetal that is running."""
    root = _source_tree()
    if root is None:
        d = _direct_url()
        if d is None:
            return f"pip install 'qwenmetal[{extra}]'"
        url = urlparse(str(d.get("url", "")))
        if "dir_info" in d and url.scheme == "file":
            root = Path(unquote(url.path))
        else:
            return f"pip install 'qwenmetal[{extra}]', or pip install \".[{extra}]\" in qwenmetal's source tree"
    return f"pip install \".[{extra}]\" in the source tree {root}"
