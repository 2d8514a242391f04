#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of qwenmetal._core (docs/verification.md,
# "Sanitizers"). Configures build/asan once (QWENMETAL_SANITIZE=ON, g++ unless $CXX), builds _core
# there (ninja: incremental) under the machine-wide build lock, and lays out build/asan/pkg/qwenmetal:
# a symlink to each python/qwenmetal source file plus the instrumented _core*.so, so that
#     PYTHONPATH=build/asan/pkg LD_PRELOAD="$(g++ -print-file-name=libasan.so)" python ...
# imports this checkout's package with the instrumented extension (tests/test_sanitizers.py does this).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bdir="$root/build/asan"
cxx="${CXX:-g++}"
exec 9>/tmp/qwenmetal-build.lock
flock 9
if [ ! -f "$bdir/build.ninja" ]; then
    cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=qwenmetal \
        -DCMAKE_CXX_COMPILER="$cxx" -DQWENMETAL_SANITIZE=ON \
        -DPython_EXECUTABLE="$(command -v python3)" \
        -Dnanobind_DIR="$(python3 -c 'import nanobind;print(nanobind.cmake_dir())')" >/dev/null
fi
cmake --build "$bdir" -j"${QWENMETAL_BUILD_JOBS:-2}" --target _core
pkg="$bdir/pkg/qwenmetal"
rm -rf "$bdir/pkg"
mkdir -p "$pkg"
for f in "$root"/python/qwenmetal/*.py "$root"/python/qwenmetal/py.typed; do
    ln -s "$f" "$pkg/"
done
cp -f "$bdir"/_core*.so "$pkg/"
