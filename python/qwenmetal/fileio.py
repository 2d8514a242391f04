"""Atomic writes (a file or a directory appears complete under its name or not at all) and strict JSON
parsing of the files qwenmetal reads.

`atomic_file` and `atomic_dir` write into a temporary sibling (same directory, so the final rename is atomic on POSIX) and
rename it into place on success; on any exception — a full disk, a permission error, a
KeyboardInterrupt — the temporary is removed and nothing partial is left. Errors name the user's
path, not the temporary one. A file that already exists under the name is untouched until the rename.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _named(e: OSError, path: Path, what: str) -> OSError:
    """`e` as the same OSError subclass (same errno), naming `path` once instead of a temporary file."""
    if e.errno is None:
        return type(e)(f"cannot {what} {path}: {e}")
    return type(e)(e.errno, f"cannot {what} {path}: {e.strerror}")


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return d


def parse_json(data: bytes | str, where: str, error: type[Exception] = ValueError) -> Any:
    """`data` parsed as strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting. Anything
    else raises `error` with a message starting with `where` (the file, and the field if any)."""
    def constant(name):
        raise ValueError(f"{name} is not valid JSON")

    def finite(s):
        if not math.isfinite(v := float(s)):
            raise ValueError(f"number {s[:20]} is out of range")
        return v

    try:
        text = bytes(data).decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=constant, parse_float=finite)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:        # JSONDecodeError, UnicodeDecodeError, duplicates, int digits limit
        raise error(f"{where}: invalid JSON: {e}") from None


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path` to write; on success it replaces `path`."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(2, f"cannot write {path}: the directory {parent} does not exist", os.fspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=parent)
        os.close(fd)
    except OSError as e:
        raise _named(e, path, "write") from None
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _named(e, path, "write") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_free_dir(dest: str | os.PathLike) -> None:
    """Raise FileExistsError unless `dest` is absent or an empty directory (what `atomic_dir` needs; call
    it first to fail before expensive work)."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(17, f"{dest} exists and is not an empty directory")


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory of `dest` to fill; on success it is renamed to `dest`
    (which must be absent or an empty directory)."""
    dest = Path(dest)
    check_free_dir(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    except OSError as e:
        raise _named(e, dest, "create") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)          # also replaces an empty directory
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _named(e, dest, "write") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
