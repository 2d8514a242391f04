#!/usr/bin/env bash
# Development build without pip: configures build/dev-<tree> once, builds qwenmetal._core and copies
# it into python/qwenmetal/, so `PYTHONPATH=python python -m pytest ...` runs this tree's code.
# Builds on this machine are serialised through a lock (2 cores: one heavy build at a time).
#     tools/dev_build.sh            # from the repository root (any worktree)
# The interpreter is $PYTHON, else the first `python` on PATH (an activated venv's); nanobind, cmake and
# ninja must be installed in its environment (pip install ".[test]").
set -euo pipefail
python="${PYTHON:-$(command -v python)}"
cd "$(dirname "$0")/.."
root=$(pwd)
bdir="$root/build/dev-cmake"
exec 9>/tmp/qwenmetal-build.lock
flock 9
# ccache, when installed, shares objects between worktrees of one checkout (paths made relative to
# the directory above the repository, so /work/main and /work/wt-x hit the same entries)
launcher=()
if command -v ccache >/dev/null; then
    export CCACHE_BASEDIR="$(dirname "$root")" CCACHE_NOHASHDIR=1
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
if [ ! -f "$bdir/build.ninja" ]; then
    cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=qwenmetal "${launcher[@]}" \
        -DPython_EXECUTABLE="$python" -Dnanobind_DIR="$("$python" -c 'import nanobind;print(nanobind.cmake_dir())')" >/dev/null
fi
cmake --build "$bdir" -j2 "$@"
# replaced by a rename, not rewritten in place: a process that has the old module loaded (a benchmark
# running from this tree) keeps its copy instead of crashing on a truncated mapping
for so in "$bdir"/_core*.so; do
    cp -f "$so" "python/qwenmetal/.$(basename "$so").tmp"
    mv -f "python/qwenmetal/.$(basename "$so").tmp" "python/qwenmetal/$(basename "$so")"
done
