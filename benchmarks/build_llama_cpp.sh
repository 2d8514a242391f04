#!/usr/bin/env bash
# Build llama-cpp-python (the llama.cpp CPU peer for benchmarks/llama_cpp_compare.py) from source with the
# fastest flags that run safely on this host, into a wheel cached under <cache>/wheels (the cache rule of
# docs/usage.md, "Cache directory"), and install it. It is an optional benchmark tool, never a runtime or
# test dependency of qwenmetal.
#
# Why not `pip install llama-cpp-python`: its default build is -march=native, which on CPUs with AMX
# (Sapphire Rapids and newer) crashes in ggml_backend_amx_mul_mat on quantized weights; the crash can be
# avoided with use_extra_bufts=False, but that also turns off the repacked Q4_0 kernels (about 1.5x slower
# decode). Here: GGML_NATIVE=OFF, the host's own AVX/AVX2/FMA/F16C/BMI2/AVX-512 flags spelled out as
# -DGGML_...=ON (read from /proc/cpuinfo), and AMX off. See docs/benchmarks.md.
#
#   bash benchmarks/build_llama_cpp.sh            # build (about 4.5 min on 2 cores) unless cached, then install
#   LLAMA_CPP_VERSION=0.3.36 FORCE=1 bash benchmarks/build_llama_cpp.sh
set -euo pipefail

VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
CACHE="${QWENMETAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qwenmetal}"   # qwenmetal.paths.cache_dir's rule
WHEELS="$CACHE/wheels"
SDIST_DIR="$CACHE/sdist"
mkdir -p "$WHEELS" "$SDIST_DIR"

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
on_off() { if has "$1"; then echo ON; else echo OFF; fi; }

ARGS="-DGGML_NATIVE=OFF"
ARGS+=" -DGGML_AVX=$(on_off avx) -DGGML_AVX2=$(on_off avx2) -DGGML_FMA=$(on_off fma)"
ARGS+=" -DGGML_F16C=$(on_off f16c) -DGGML_BMI2=$(on_off bmi2) -DGGML_AVX_VNNI=$(on_off avx_vnni)"
if has avx512f && has avx512bw && has avx512dq && has avx512vl; then
  ARGS+=" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=$(on_off avx512vbmi)"
  ARGS+=" -DGGML_AVX512_VNNI=$(on_off avx512_vnni) -DGGML_AVX512_BF16=$(on_off avx512_bf16)"
else
  ARGS+=" -DGGML_AVX512=OFF"
fi
ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# tag the wheel cache entry with the flags so a different host (or flag set) rebuilds
TAG="$(echo "$VERSION $ARGS" | sha256sum | cut -c1-12)"
DEST="$WHEELS/llama-cpp-python-$VERSION-$TAG"
mkdir -p "$DEST"

echo "llama-cpp-python $VERSION, CMAKE_ARGS: $ARGS"
if [[ -n "${FORCE:-}" ]]; then rm -f "$DEST"/*.whl; fi
if ! ls "$DEST"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  sdist="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    # only this package from source; its build requirements may come as wheels
    pip download --no-deps --no-build-isolation --no-binary llama-cpp-python \
      "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
  fi
  start=$(date +%s)
  CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    pip wheel --no-deps -w "$DEST" "$sdist"
  echo "built in $(( $(date +%s) - start )) s"
  echo "$ARGS" > "$DEST/CMAKE_ARGS.txt"
fi
pip install --no-deps --force-reinstall "$DEST"/llama_cpp_python-*.whl
pip install "$DEST"/llama_cpp_python-*.whl       # its own dependencies (diskcache, jinja2, ...), if missing
python - <<'EOF'
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "|", llama_cpp.llama_print_system_info().decode())
EOF
