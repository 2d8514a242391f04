"""The compiled extension, ``qwenmetal._core`` (the C++ engines, the simulator, the kernels' test hooks),
imported where it is first needed: a source tree that was never built still imports every Python module,
and the backends that need the extension say how to build it."""
from __future__ import annotations


def core():
    """The compiled module ``qwenmetal._core``; ImportError saying how to build it if it is absent."""
    try:
        from . import _core  # the compiled module: absent in a source tree that was never built
    except ImportError as e:
        raise ImportError("qwenmetal's compiled extension (qwenmetal._core) is not built: install the package "
                          "with `pip install .` (or build it in place with tools/dev_build.sh)") from e
    return _core


def available() -> bool:
    """Whether the compiled extension imports."""
    try:
        core()
    except ImportError:
        return False
    return True
