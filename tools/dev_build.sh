#!/usr/bin/env bash
# Development build without pip: configures build/dev-<tree> once, builds qwenmetal._core and copies
# it into python/qwenmetal/, so `PYTHONPATH=python python -m pytest ...` runs this tree's code.
# Builds on this machine are serialised through a lock (2 cores: one heavy build at a time).
#     tools/dev_build.sh            # from the repository root (any worktree)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bdir="$root/build/dev-cmake"
exec 9>/tmp/qwenmetal-build.lock
flock 9
if [ ! -f "$bdir/build.ninja" ]; then
    cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=qwenmetal \
        -DPython_EXECUTABLE="$(command -v python3)" -Dnanobind_DIR="$(python3 -c 'import nanobind;print(nanobind.cmake_dir())')" >/dev/null
fi
cmake --build "$bdir" -j2 "$@"
cp -f "$bdir"/_core*.so python/qwenmetal/
