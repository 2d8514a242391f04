"""The benchmark checkpoint as a GGUF made by llama.cpp's own converter and quantizer, so that
benchmarks/llama_cpp_compare.py (``--gguf-source llama.cpp|both``) races the peer on its own file, not only
on the one qwenmetal writes (qwenmetal.compare.gguf).

    bash benchmarks/build_llama_cpp.sh                  # once: llama-cpp-python, and its sdist in the cache
    python benchmarks/llama_cpp_gguf.py --layers 4      # writes the GGUF once (cached) and prints its path

Steps (each one-time; the result is cached beside the benchmark checkpoint as
``<checkpoint>.llama-q4_0.gguf``):

1. **The unquantized original**: the benchmark config and seed written in the ``hf-bf16`` layout (what
   transformers' ``save_pretrained`` writes: ``Qwen3_5MoeForConditionalGeneration``, fused experts) by the
   one random-checkpoint writer -- the very tensors the MLX 4-bit benchmark checkpoint is quantized from
   (``qwenmetal.bench.ensure_checkpoint(format="hf-bf16")``). About 2.0 GB per layer + 2.0 GB for the
   embedding and lm_head.
2. **llama.cpp's converter**, ``convert_hf_to_gguf.py --outtype bf16 --no-mtp``, from the llama.cpp sources
   vendored in the llama-cpp-python sdist that benchmarks/build_llama_cpp.sh downloaded (the same
   llama.cpp the installed ``llama_cpp`` runs), with its own ``gguf-py``; it needs torch and transformers.
   ``--no-mtp``: the random checkpoint has no ``mtp.*`` layers. One substitution: the converter
   recognises a BPE pre-tokenizer by hashing how it splits a probe text, and the fixture tokenizer (a small
   BPE trained for the tests) is not in its table, so ``TextModel.get_vocab_base_pre`` answers
   ``"qwen35"``, the pre-tokenizer Qwen3.5/3.6 releases get; the benchmark feeds token ids, so the
   tokenizer never runs.
3. **llama.cpp's quantizer**, ``llama_model_quantize`` (what the ``llama-quantize`` tool calls;
   llama-cpp-python ships the function, not the tool) to ``Q4_0``. Every tensor type is the quantizer's
   own choice (it keeps the router, norms, conv and the SSM scalars in float) except ``output.weight``,
   which its Q4_0 recipe would store as Q6_K: forced to Q4_0 (``llama-quantize --output-tensor-type
   q4_0``), so that the peer reads no more lm_head bytes per decoded token than qwenmetal's 4-bit lm_head
   (Q6_K would read 46 % more and slow llama.cpp down). Q4_0 is what llama.cpp repacks at load for its
   fastest CPU kernels (Q4_0 8x8 on AVX-512 and AVX2).
4. The HF copy and the bf16 GGUF are deleted once the Q4_0 file is in place (``--keep`` keeps them).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: llama-cpp-python's version when none is installed (benchmarks/build_llama_cpp.sh's default)
DEFAULT_LLAMA_CPP_VERSION = "0.3.36"
_VENDOR = "vendor/llama.cpp/"
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# runs llama.cpp's converter with the pre-tokenizer answer of step 2; argv: sources dir, converter arguments
_CONVERT_CHILD = r"""
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the sources must match the library that runs the file)."""
    try:
        import llama_cpp
    except ImportError:
        return os.environ.get("LLAMA_CPP_VERSION", DEFAULT_LLAMA_CPP_VERSION)
    return llama_cpp.__version__


def converter_sources(version: str | None = None) -> Path:
    """llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``) of llama-cpp-python
    `version`, extracted once from the sdist benchmarks/build_llama_cpp.sh cached under
    ``<cache>/sdist`` into ``<cache>/llama.cpp-converter/<version>``."""
    from qwenmetal.paths import cache_dir

    version = version or llama_cpp_version()
    dest = cache_dir("llama.cpp-converter", version)
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    sdist = cache_dir("sdist", f"llama_cpp_python-{version}.tar.gz")
    if not sdist.is_file():
        raise SystemExit(f"{sdist} is missing: run  LLAMA_CPP_VERSION={version} bash benchmarks/build_llama_cpp.sh  "
                         "(it downloads the sdist whose vendored llama.cpp has the converter)")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"llama_cpp_python-{version}/{_VENDOR}"
    with tarfile.open(sdist) as tf:
        members = []
        for m in tf.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel and (m.isfile() or m.isdir()) and any(rel == f or rel.startswith(f) for f in _CONVERTER_FILES):
                m.name = rel
                members.append(m)
        if not members:
            raise SystemExit(f"{sdist} holds no {prefix}convert_hf_to_gguf.py")
        tf.extractall(tmp, members=members, filter="data")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, dest)
    except OSError:                                  # extracted concurrently by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_hf(hf_dir: Path, out: Path, sources: Path) -> None:
    """HF checkpoint -> bf16 GGUF with llama.cpp's own converter (in a child process)."""
    cmd = [sys.executable, "-c", _CONVERT_CHILD, str(sources), str(hf_dir), "--outfile", str(out),
           "--outtype", "bf16", "--no-mtp"]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed (exit status {r.returncode}):\n{r.stderr[-4000:]}")


def quantize(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's quantizer: Q4_0 with output.weight forced to Q4_0 (see the module docstring, step 3)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.output_tensor_type = llama_cpp.GGML_TYPE_Q4_0
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise RuntimeError(f"llama_model_quantize({src}) failed with status {rc}")


def gguf_path(checkpoint: Path) -> Path:
    """Where the llama.cpp-made GGUF of a benchmark checkpoint is cached (beside qwenmetal's own GGUF)."""
    return checkpoint.parent / f"{checkpoint.name}.llama-q4_0.gguf"


def ensure_llama_gguf(cfg: dict, seed: int, checkpoint: Path, threads: int = 2, keep: bool = False,
                      log=log) -> Path:
    """The cached llama.cpp-made Q4_0 GGUF of benchmark config `cfg` / `seed` (whose MLX checkpoint is
    `checkpoint`), written on first use by steps 1-4 of the module docstring."""
    from qwenmetal.bench import ensure_checkpoint

    dst = gguf_path(checkpoint)
    if dst.is_file():
        return dst
    sources = converter_sources()
    t0 = time.perf_counter()
    hf = ensure_checkpoint(cfg, seed, log=log, format="hf-bf16")
    log(f"  HF bf16 original: {hf} ({time.perf_counter() - t0:.0f} s)")
    bf16 = dst.with_name(dst.name.replace(".llama-q4_0.", ".llama-bf16."))
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    try:
        t = time.perf_counter()
        if not bf16.is_file():
            convert_hf(hf, bf16.with_name(bf16.name + ".part"), sources)
            os.rename(bf16.with_name(bf16.name + ".part"), bf16)
        log(f"  llama.cpp converter -> {bf16.name} ({time.perf_counter() - t:.0f} s)")
        t = time.perf_counter()
        quantize(bf16, tmp, threads)
        os.rename(tmp, dst)
        log(f"  llama.cpp quantizer -> {dst.name} ({time.perf_counter() - t:.0f} s)")
    finally:
        for p in (tmp, bf16.with_name(bf16.name + ".part")):
            p.unlink(missing_ok=True)
    if not keep:
        bf16.unlink(missing_ok=True)
        shutil.rmtree(hf, ignore_errors=True)
    log(f"  {dst} written in {time.perf_counter() - t0:.0f} s")
    return dst


def provenance(sources: Path | None = None) -> dict:
    """What made the file: llama-cpp-python's version (its vendored llama.cpp), the converter's gguf-py."""
    sources = sources or converter_sources()
    gguf_version = None
    toml = sources / "gguf-py" / "pyproject.toml"
    if toml.is_file():
        for line in toml.read_text(encoding="utf-8").splitlines():
            if line.startswith("version"):
                gguf_version = line.split("=", 1)[1].strip().strip('"')
                break
    return {"tools": "convert_hf_to_gguf.py --outtype bf16 --no-mtp; llama_model_quantize Q4_0, "
                     "output_tensor_type Q4_0", "llama_cpp_python": llama_cpp_version(),
            "converter_gguf_py": gguf_version, "converter_sources": str(sources)}


def main(argv=None) -> int:
    from qwenmetal.bench import ensure_checkpoint, resolve_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--config", default="real")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="quantizer threads")
    p.add_argument("--keep", action="store_true", help="keep the HF bf16 copy and the bf16 GGUF")
    a = p.parse_args(argv)
    cfg = resolve_config(a.config, a.layers)
    print(ensure_llama_gguf(cfg, a.seed, ensure_checkpoint(cfg, a.seed, log=log), a.threads, a.keep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
