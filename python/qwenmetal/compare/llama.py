"""llama.cpp through llama-cpp-python: open a GGUF, time prefill and decode, teacher-forced logits.

The one implementation behind ``qwenmetal compare``'s llama.cpp engine and benchmarks/llama_cpp_compare.py.
llama-cpp-python is never a dependency of qwenmetal: build it with benchmarks/build_llama_cpp.sh (this
host's SIMD flags, AMX off; docs/benchmarks.md). The timings have the shape of
:func:`qwenmetal.bench.time_prefill` / :func:`qwenmetal.bench.time_decode`.
"""
from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np

from ..bench import fnv1a, synthetic_prompt

GGML_TYPE_F32 = 0
INSTALL_HINT = ("llama-cpp-python is not installed: run  bash benchmarks/build_llama_cpp.sh  (a from-source "
                "build with this host's SIMD flags and AMX off; docs/benchmarks.md)")


def import_llama():
    """The llama_cpp module, or ImportError with how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return llama_cpp


def open_llama(gguf, threads: int, n_ctx: int, n_batch: int, flash_attn: bool, kv_f32: bool = False,
               logits_all: bool = False, repack: bool = True, gpu_layers: int = 0):
    """A ``llama_cpp.Llama`` on `gguf`: n_threads = n_threads_batch = `threads`, n_ubatch min(512, n_batch)
    (llama.cpp's default), the KV cache f16 (its default) or f32, the weights mmap'd, `gpu_layers` layers
    offloaded (-1: all, as on a Mac with the Metal build; 0: the CPU). `repack=False`: no extra
    buffer types, so the weights are used straight from the mmap'd file instead of repacked copies in
    anonymous memory (as large as the weights: they cannot fit a memory limit below twice the model)."""
    llama_cpp = import_llama()
    if not repack:
        import llama_cpp.llama_cpp as lib
        default = lib.llama_model_default_params

        def no_extra_bufts():
            params = default()
            params.use_extra_bufts = False
            return params
        lib.llama_model_default_params = no_extra_bufts
    kw = dict(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(512, n_batch),
              n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn, logits_all=logits_all,
              use_mmap=True, n_gpu_layers=gpu_layers, verbose=False)
    if kv_f32:
        kw.update(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    return llama_cpp.Llama(**kw)


def last_logits(llm) -> np.ndarray:
    """The logits of the last evaluated position (a view into llama.cpp's buffer)."""
    import llama_cpp
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


class SeqState:
    """Save / restore sequence 0 of a llama context (KV cache and recurrent state)."""

    def __init__(self, llm):

        import llama_cpp
        self.llm, self.n_tokens = llm, llm.n_tokens
        ctx = llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        self.buf = (ctypes.c_uint8 * size)()
        self.size = llama_cpp.llama_state_seq_get_data(ctx, self.buf, size, 0)
        if not self.size:
            raise RuntimeError("llama_state_seq_get_data returned 0 bytes")

    def restore(self):
        import llama_cpp
        llm = self.llm
        mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
        llama_cpp.llama_memory_clear(mem, True)
        if not llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, self.buf, self.size, 0):
            raise RuntimeError("llama_state_seq_set_data failed")
        llm.n_tokens = self.n_tokens


def time_prefill(llm, n: int, repeats: int, warmup: int = 1) -> dict:
    """Prefill of the synthetic prompt of `n` tokens through its argmax (`warmup` untimed runs first)."""
    ids = synthetic_prompt(n, llm.n_vocab()).tolist()
    samples = []
    for r in range(warmup + repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        int(np.argmax(last_logits(llm)))
        dt = time.perf_counter() - t
        if r >= warmup:
            samples.append(dt)
    med = statistics.median(samples)
    return {"tokens": n, "seconds": med, "tokens_per_second": n / med, "samples_seconds": samples}


def time_decode(llm, context: int, steps: int, repeats: int, warmup_steps: int = 4, log=None) -> dict:
    """`steps` greedy steps after the synthetic prompt of `context` tokens, every repeat from the same
    context (the sequence state saved after its prefill and restored)."""
    V = llm.n_vocab()
    llm.reset()
    t = time.perf_counter()
    llm.eval(synthetic_prompt(context, V).tolist())
    prefill_s = time.perf_counter() - t
    first = int(np.argmax(last_logits(llm)))
    try:
        saved = SeqState(llm)
    except Exception as e:                      # pragma: no cover - fall back to re-prefilling
        if log:
            log(f"  (llama.cpp sequence state save failed: {e}; re-prefilling before each repeat)")
        saved = None

    def rewind():
        if saved is not None:
            saved.restore()
        else:                                   # pragma: no cover
            llm.reset()
            llm.eval(synthetic_prompt(context, V).tolist())

    rewind()
    tok = first
    for _ in range(warmup_steps):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    samples, digests = [], []
    for _ in range(repeats):
        rewind()
        tok, toks = first, []
        t = time.perf_counter()
        for _ in range(steps):
            llm.eval([tok])
            tok = int(np.argmax(last_logits(llm)))
            toks.append(tok)
        samples.append((time.perf_counter() - t) / steps)
        digests.append(fnv1a(toks))
    med = statistics.median(samples)
    return {"context": context, "steps": steps, "seconds_per_token": med, "ms_per_token": 1e3 * med,
            "tokens_per_second": 1 / med, "samples_ms": [1e3 * x for x in samples], "digest": digests[0],
            "digest_stable": len(set(digests)) == 1, "context_prefill_seconds": prefill_s}


def teacher_forced(llm, tokens) -> np.ndarray:
    """Logits [len(tokens), n_vocab] at every position of `tokens`, one evaluation (`llm` opened with
    ``logits_all=True``)."""
    llm.reset()
    llm.eval([int(t) for t in tokens])
    return np.array(llm.scores[:len(tokens)], np.float32)
