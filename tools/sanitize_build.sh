#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of qwenmetal._core (docs/verification.md,
# "Sanitizers"). Configures build/asan once (QWENMETAL_SANITIZE=ON, g++ unless $CXX), builds _core
# there (ninja: incremental) under the machine-wide build lock, and lays out build/asan/pkg/qwenmetal:
# a symlink to each entry of python/qwenmetal (modules, subpackages) plus the instrumented _core*.so, so that
#     PYTHONPATH=build/asan/pkg LD_PRELOAD="$(g++ -print-file-name=libasan.so)" python ...
# imports this checkout's package with the instrumented extension (tests/test_sanitizers.py does this).
# The interpreter is $PYTHON (tests/test_sanitizers.py passes its own, sys.executable); nanobind, cmake and
# ninja come from that interpreter's environment (the `test` extra declares them).
set -euo pipefail
python="${PYTHON:?set PYTHON to the interpreter that will import the build (e.g. PYTHON=\$(command -v python))}"
cd "$(dirname "$0")/.."
root=$(pwd)
bdir="$root/build/asan"
cxx="${CXX:-g++}"
exec 9>/tmp/qwenmetal-build.lock
flock 9
if [ ! -f "$bdir/build.ninja" ]; then
    cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSKBUILD_PROJECT_NAME=qwenmetal \
        -DCMAKE_CXX_COMPILER="$cxx" -DQWENMETAL_SANITIZE=ON -DQWENMETAL_UNITY=ON \
        -DPython_EXECUTABLE="$python" \
        -Dnanobind_DIR="$("$python" -c 'import nanobind;print(nanobind.cmake_dir())')" >/dev/null
fi
cmake --build "$bdir" -j"${QWENMETAL_BUILD_JOBS:-2}" --target _core
# updated in place (a run of the previous build may be importing from it): links refreshed, dangling
# ones dropped, the module replaced by a rename (a new inode; never rewritten under a live mapping)
pkg="$bdir/pkg/qwenmetal"
mkdir -p "$pkg"
for f in "$root"/python/qwenmetal/*; do
    case "$(basename "$f")" in _core*.so|__pycache__) continue ;; esac
    ln -sfn "$f" "$pkg/"
done
find "$pkg" -xtype l -delete
for so in "$bdir"/_core*.so; do
    cp -f "$so" "$pkg/.tmp.$(basename "$so")"
    mv -f "$pkg/.tmp.$(basename "$so")" "$pkg/$(basename "$so")"
done
