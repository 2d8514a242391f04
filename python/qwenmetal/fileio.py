"""Atomic writes: a file or a directory appears complete under its name or not at all.

Both write into a temporary sibling (same directory, so the final rename is atomic on POSIX) and
rename it into place on success; on any exception — a full disk, a permission error, a
KeyboardInterrupt — the temporary is removed and nothing partial is left. Errors name the user's
path, not the temporary one.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _named(e: OSError, path: Path, what: str) -> OSError:
    """`e` re-raised as the same OSError subclass, naming `path` instead of a temporary file."""
    err = type(e)(e.errno, f"cannot {what} {path}: {e.strerror or e}")
    err.filename = os.fspath(path)
    return err


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


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory of `dest` to fill; on success it is renamed to `dest`
    (which must be absent or an empty directory)."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(17, f"{dest} exists and is not an empty directory", os.fspath(dest))
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
