"""The C++ CPU backend (``backend="cpu"``): a thin wrapper over ``qwenmetal._core.CpuEngine``.

The loader (`weights.py`) has already mapped and checked every tensor. This module hands C++ the
weights table (`weights_table.weight_table`: each linear tensor as a span of one of the checkpoint's file
mappings, as the Metal backend gets it) and keeps the numpy views alive for as long as the engine lives,
so the weights are used in place: nothing is copied at load and resident memory grows only as pages are
touched. Small tensors (norm weights, conv taps, ``A_log``, ``dt_bias``) are handed over as float32
copies. (``describe`` gives the pointer descriptor of one tensor, for the kernel test hooks.)

Options (``Model.load(path, backend="cpu", **options)``):

* ``threads``: worker threads, default = physical cores of this process's CPU set.
* ``kv_dtype``: ``"bfloat16"`` (default) or ``"float32"`` (exact comparisons with the reference).
* ``prefill_chunk``: tokens per forward chunk (default 512); scratch memory is bounded by it.
* ``quantize``: ``None``, ``4`` or ``8``: quantize a dense (bf16/f16/f32) checkpoint at load with
  MLX's affine algorithm, group 64 (router and shared-expert gate at 8 bits, as mlx-lm does).
* ``activations``: how the inputs of the linear layers over 4-bit group-64 weights (every large matrix
  of the real model) are multiplied (docs/cpu.md, "Integer activations"):

  - ``"int16"``: each input vector is quantized per group of 64 to two int8 planes,
    x ≈ sx·(xq + xq2/256) (≈ 16-bit fixed point per group, relative error ≤ 2^-16 of the group's
    max), and multiplied with exact integer dot products (AVX512-VNNI, AMX for prefill, AVX2 maddubs);
    as accurate as fp32 at the tolerances that matter (1e-5 of the logit range on the fixtures);
  - ``"int8"``: one plane (x ≈ sx·xq, like llama.cpp's Q8 activations) — faster, approximate: it does
    not meet the accuracy contract (KL ~1.5x the bf16 reference's), so it is opt-in;
  - ``"float"``: fp32 FMAs on the dequantized weights, the reference arithmetic;
  - ``"auto"`` (default): the fastest mode that meets the accuracy contract (`qwenmetal.accuracy`: at
    least as accurate as the reference's bfloat16 mode): ``"int16"`` where the CPU has the SIMD integer
    kernels (AVX2, AVX-512), ``"float"`` elsewhere (the portable integer path is scalar; the NEON one is
    qemu-verified only, with no arm64 timing to choose it by).

* ``memory_budget``: ``"auto"`` (default: the memory available to this process), bytes, or ``None``
  (never stream). When the checkpoint does not fit (`qwenmetal.expert_streaming.plan`), the non-expert
  weights stay mapped and the routed experts are **streamed**: the engine owns ``expert_slots`` slots
  per MoE layer, and after routing each layer reads its missing experts with parallel ``pread`` into
  them (`_core.ExpertCache`); the experts' bytes are never read through the mapping. Streaming output
  equals resident output bit for bit (docs/cpu.md, "Streaming experts").
* ``expert_slots``: slots per MoE layer (1 .. num_experts; default: the planner's, from the budget);
  ``expert_policy``: ``"lru"``, ``"lfu"`` or ``"os"`` (default: the planner's). Giving either forces
  the plan's choice (tests stream tiny fixtures with them). ``expert_direct_io``: read the experts past
  the page cache (O_DIRECT / F_NOCACHE), so their bytes are held once, in the slots (default False).

State (``CpuState``) lives in C++: ``position``, ``nbytes``, ``copy()`` (deep). ``forward`` updates
the state in place and returns it: the engine reserves everything it needs (KV growth, scratch)
before touching the state, so an error leaves it unchanged, and the GIL is released during compute.
A call from the main thread runs Python's signal handlers between prefill chunks: a Ctrl-C raises
KeyboardInterrupt there and the engine first restores the state of the call's start (the GDN states
are saved at the start of a multi-chunk call; the KV cache is append-only). A single-chunk call runs
to its end, then the interrupt is delivered with the session advanced by it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..config import VisionConfig, mtp_head_layers, mtp_layer_config
from ..errors import InputError
from ..expert_streaming import expert_stats, stream_spec
from ..expert_streaming import plan as stream_plan
from ..native import core
from ..weights import QuantizedTensor, Weights, to_float32
from ..weights_table import NP_DTYPE_NAMES, config_dict, ptr, weight_table
from .engine import EngineBackend, dflash_arguments, dflash_dims, row_arguments
from .reference_vision import check_inputs

KV_DTYPES = ("bfloat16", "float32")
ACTIVATIONS = ("auto", "int16", "int8", "float")
# canonical tensors passed as float32 vectors (everything else is a linear layer)
_SMALL_SUFFIXES = ("layernorm", "q_norm", "k_norm", "linear_attn.norm", "conv1d", "dt_bias", "A_log",
                   "pre_fc_norm_embedding", "pre_fc_norm_hidden")   # the last two: an MTP head's (mtp_head)




def _rows_contiguous(a: np.ndarray) -> np.ndarray:
    """`a` if each matrix (last two axes) is C-contiguous, else a C-contiguous copy."""
    it = a.itemsize
    if a.ndim >= 2 and a.strides[-1] == it and a.strides[-2] == a.shape[-1] * it:
        return a
    return np.ascontiguousarray(a)


def describe(t, keep: list) -> dict:
    """The C++ descriptor of one linear tensor (dense or MLX-quantized); arrays used go to `keep`."""
    if isinstance(t, QuantizedTensor):
        w = _rows_contiguous(t.weight)
        s, b = _rows_contiguous(t.scales), _rows_contiguous(t.biases)
        if s.dtype == np.dtype(np.float16) or s.dtype not in NP_DTYPE_NAMES:
            s, b = np.ascontiguousarray(s, np.float32), np.ascontiguousarray(b, np.float32)
        if w.ndim == 3 and (s.strides[0] != b.strides[0]):
            s, b = np.ascontiguousarray(s), np.ascontiguousarray(b)
        keep += [w, s, b]
        return dict(bits=t.bits, group_size=t.group_size, dtype="float32", sdtype=NP_DTYPE_NAMES[s.dtype],
                    shape=list(t.shape), data=ptr(w), scales=ptr(s), biases=ptr(b),
                    stride=int(w.strides[0]) if w.ndim == 3 else 0,
                    sstride=int(s.strides[0]) if s.ndim == 3 else 0)
    a = np.asarray(t)
    if a.dtype not in NP_DTYPE_NAMES:
        a = np.asarray(a, np.float32)
    a = _rows_contiguous(a)
    if a.ndim not in (2, 3):
        raise ValueError(f"linear tensor of shape {a.shape} is not supported")
    keep.append(a)
    return dict(bits=0, group_size=0, dtype=NP_DTYPE_NAMES[a.dtype], sdtype="bfloat16", shape=list(a.shape),
                data=ptr(a), scales=0, biases=0, stride=int(a.strides[0]) if a.ndim == 3 else 0, sstride=0)


class _Impl:
    """The engine call, separate from the backend so tests can patch it (like ReferenceBackend.impl)."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, state, ids, logits, consumed=None, rows=None):
        if rows is None:
            return self.engine.forward(state, ids, logits, consumed)
        return self.engine.forward(state, ids, logits, consumed, **row_arguments(rows))


class CpuBackend(EngineBackend):
    """C++ threads + SIMD on the checkpoint's own (mmap'd, usually 4-bit) weights."""

    name = "cpu"
    row_inputs = True            # prefill takes explicit M-RoPE positions and embedding rows (RowInputs)

    def __init__(self, weights: Weights, threads: int | None = None, kv_dtype: str = "bfloat16",
                 prefill_chunk: int = 512, quantize: int | None = None, activations: str = "auto",
                 memory_budget: int | str | None = "auto", expert_slots: int | None = None,
                 expert_policy: str | None = None, expert_direct_io: bool = False):
        ext = core()
        if threads is None:
            threads = ext.cpu_physical_cores()
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        if quantize not in (None, 4, 8) or isinstance(quantize, bool):
            raise ValueError(f"quantize must be None, 4 or 8, got {quantize!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if activations == "auto":
            activations = "int16" if ext.cpu_isa() in ("avx2", "avx512") else "float"

        c = weights.config
        self.plan = stream_plan(c, weights, memory_budget, slots_per_layer=expert_slots, policy=expert_policy,
                                direct_io=expert_direct_io)
        stream = stream_spec(weights, self.plan) if self.plan.stream else None
        linear, small = {}, {}
        for name, t in weights.tensors.items():
            if stream is not None and name in stream["stacks"]:
                continue                      # streamed: never handed over as pointers into the mapping
            if name.endswith(_SMALL_SUFFIXES) or name == "norm":
                small[name] = np.ascontiguousarray(np.asarray(t, np.float32).reshape(-1))
            elif isinstance(t, QuantizedTensor) and t.scales.dtype == np.dtype(np.float16):
                # the engine reads bf16 or float32 scales: float16 ones are widened once (exact)
                linear[name] = QuantizedTensor(t.weight, t.scales.astype(np.float32), t.biases.astype(np.float32),
                                               t.bits, t.group_size)
            else:
                linear[name] = t
        mappings, tensors, keep = weight_table(weights, linear)
        self.weights = weights
        self.threads = int(threads)
        self.kv_dtype = kv_dtype
        self.prefill_chunk = int(prefill_chunk)
        self.quantize = quantize
        self.activations = activations
        self.engine = ext.CpuEngine(config_dict(c), mappings, tensors, small, self.threads, kv_dtype == "float32",
                                     self.prefill_chunk, int(quantize or 0), keep,
                                     activations=activations, stream=stream)
        self.impl = _Impl(self.engine)

    def new_state(self):
        return self.engine.new_state()

    def forward(self, state, ids: np.ndarray, logits: str, consumed: list | None = None, rows=None):
        """Run `ids` on `state` in place (all-or-nothing) and return (state, logits); `ids` are appended to
        `consumed` (a session's token list) inside the engine call, together with the state's advance.
        `rows`: explicit M-RoPE positions and embedding rows (`qwenmetal.mrope.RowInputs`)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = self.impl.forward(state, ids, logits, consumed) if rows is None else \
            self.impl.forward(state, ids, logits, consumed, rows)
        return state, out

    # ---- speculative decoding (qwenmetal.speculative) ---------------------------------------------
    native_verify = True             # verify / rewind below (qwenmetal.speculative)

    def verify(self, state, ids: np.ndarray, consumed: list | None = None, return_hidden: bool = False,
               features=None):
        """Run `ids` with the logits of each ([n, vocab]), every row bit for bit a one-token call's, keeping
        what `rewind` needs (consecutive calls chain); at most 32 ids (and `prefill_chunk`) per call.
        `return_hidden`: (logits, the final-normed hidden rows [n, hidden]) -- an MTP head's input.
        `features` (decoder-layer indices): (logits, the outputs of those layers for every row
        [n, len(features) * hidden]) -- a DFlash draft's context; not together with `return_hidden`."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if features is not None:
            if return_hidden:
                raise ValueError("verify returns hidden states or layer features, not both")
            return self.engine.verify(state, ids, consumed, features=features)
        return self.engine.verify(state, ids, consumed, return_hidden=1 if return_hidden else 0)

    @property
    def max_verify_rows(self) -> int:
        """The most rows of one `verify` call, and of one open chain of them (the engine's speculative limit)."""
        return min(32, self.prefill_chunk)

    @property
    def max_batch_rows(self) -> int:
        """The most rows of one `decode_batch` (the MoE decode path's limit, and at most `prefill_chunk`)."""
        return min(32, self.prefill_chunk)

    def decode_batch(self, states: list, ids: np.ndarray, consumed: list | None = None) -> np.ndarray:
        """One decode step for each state (distinct), row i running ids[i] on states[i] at its own position:
        logits [n, vocab], row i bit for bit states[i]'s own one-token `forward`; the weights are read once
        for all rows. All-or-nothing for every state; ids[i] is appended to consumed[i]."""
        return self.engine.decode_batch(list(states), np.ascontiguousarray(ids, dtype=np.int64), consumed)

    def forward_hidden(self, state, ids: np.ndarray, logits: str, consumed: list | None = None):
        """`forward` that also returns every row's final-normed hidden state: (logits or None, [n, hidden]),
        for an MTP head's cache over a prompt."""
        return self.engine.forward(state, np.ascontiguousarray(ids, dtype=np.int64), logits, consumed,
                                   return_hidden=2)

    def forward_features(self, state, ids: np.ndarray, logits: str, consumed: list | None, layers) -> tuple:
        """`forward` that also returns the outputs of the decoder layers `layers` (0-based, distinct, 1..8, any
        order) for every row, concatenated in that order ([n, len(layers) * hidden], float32; the residual
        stream after each layer, before the final norm): a DFlash draft's context features, copied while the
        forward runs (across its prefill chunks). Returns (logits or None, features); all-or-nothing."""
        return self.engine.forward(state, np.ascontiguousarray(ids, dtype=np.int64), logits, consumed,
                                   features=layers)

    def mtp_head(self, params: dict) -> "CpuMtpHead":
        """The MTP head `params` (`Weights.mtp` names: fc, pre_fc_norm_*, norm, layers.0.* .. layers.{n-1}.*)
        natively: one one-layer head engine per decoder layer over this model's embedding and lm_head, with
        this backend's threads and activations (`CpuMtpHead`)."""
        return CpuMtpHead(self, params)

    def dflash_draft(self, draft) -> "CpuDFlash":
        """The forward of the DFlash draft `draft` (a `qwenmetal.dflash.DFlashDraft`) on this engine: over this
        model's embedding and lm_head (in place, in their own format) and on its threads, the draft's own
        weights read in place (bf16 or MLX-quantized); DFlash and DFlash2 (its convolutions and candidate
        selector too). ValueError for a draft that does not fit this model."""
        return CpuDFlash(self, draft)

    def vision_encoder(self, weights: Weights | None = None) -> "CpuVisionEncoder":
        """The vision tower of `weights` (default: this backend's) on this engine's threads
        (`CpuVisionEncoder`; `ModelBase.vision_encoder`). InputError when the checkpoint has no tower."""
        w = self.weights if weights is None else weights
        return CpuVisionEncoder(w.vision, w.config.vision, engine=self.engine)

    def kv_saved(self, a: np.ndarray, position: int) -> np.ndarray:
        """The engine's [P, nkv * hd] rows (bfloat16 exported as uint16) -> [nkv, P, hd]."""
        c = self.weights.config
        if a.dtype == np.uint16:
            a = a.view(ml_dtypes.bfloat16)
        return np.ascontiguousarray(a.reshape(position, c.num_key_value_heads, c.head_dim).transpose(1, 0, 2))

    def kv_rows(self, a: np.ndarray, position: int) -> np.ndarray:
        """[nkv, P, hd] -> the engine's [P, nkv * hd] rows."""
        c = self.weights.config
        return np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(position, c.num_key_value_heads * c.head_dim)

    def info(self) -> dict:
        """What the engine runs with (benchmarks record it): SIMD kernels, activation arithmetic, AMX, and
        the expert streaming state with its statistics since the last generation started."""

        ext = core()
        return {"isa": ext.cpu_isa(), "activations": self.activations,
                "amx": ext.cpu_amx(),
                "threads": self.threads, "kv_dtype": self.kv_dtype, "prefill_chunk": self.prefill_chunk,
                "experts": expert_stats(self.expert_counters())}

    def __repr__(self) -> str:
        return (f"CpuBackend(threads={self.threads}, kv_dtype={self.kv_dtype!r}, prefill_chunk={self.prefill_chunk}, "
                f"quantize={self.quantize}, activations={self.activations!r}, isa={core().cpu_isa()!r})")


# a DFlash draft's tensors passed as float32 vectors (the rest are its linear layers, DFlash2's kernel
# projections and candidate selector among them)
_DFLASH_SMALL = ("layernorm", "q_norm", "k_norm", ".bias", ".base_kernel")


class CpuDFlash:
    """A DFlash draft's forward on the cpu engine (`CpuBackend.dflash_draft`; src/cpu/dflash.h): the float32
    computation of `qwenmetal.dflash.DFlashReference.forward` + ``logits`` for the block rows 1.. (`forward`),
    and with the drafts of ``DFlashReference.propose`` (`propose`: argmax, or DFlash2's candidate selector), on
    the target engine's threads (one call at a time with the target's own). Its context cache (`new_cache`, a
    ``_core.CpuDFlashCache`` with ``position``) belongs to the caller."""

    def __init__(self, backend: CpuBackend, draft):
        c = draft.config
        t = backend.weights.config
        if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(f"{draft.path}: hidden_size {c.hidden_size} / vocab_size {c.vocab_size} do not match "
                             f"the target's {t.hidden_size} / {t.vocab_size}")
        self.config = c
        keep: list = []
        linear, small = {}, {}
        for name, a in draft.tensors.items():
            if name.endswith(_DFLASH_SMALL) or name in ("hidden_norm", "norm"):
                small[name] = np.ascontiguousarray(np.asarray(a, np.float32).reshape(-1))
            else:
                linear[name] = describe(a, keep)
        self.impl = core().CpuDFlashDraft(backend.engine, dflash_dims(c), linear, small, (keep, draft.source))

    def new_cache(self):
        """An empty context cache (``position`` 0)."""
        return self.impl.new_cache()

    def forward(self, cache, features, block, commit: bool = True) -> np.ndarray:
        """One draft call: the context features [n, len(target_layer_ids) * hidden] (n may be 0) of the tokens
        the target accepted since the last committed call, and the block's token ids [L] (L >= 1). Returns the
        logits of block rows 1..L-1 [L - 1, vocab] float32. With `commit` the context rows join `cache`; without
        it, and on any error, `cache` is left as it was."""
        return self.impl.forward(cache, *dflash_arguments(self.config, features, block), bool(commit))

    def propose(self, cache, features, block, commit: bool = True) -> tuple:
        """`forward` and the block's greedy drafts, as ``DFlashReference.propose`` gives them: (drafts [L - 1]
        int64, logits [L - 1, vocab]); the drafts are each row's argmax (ties to the lower id), for a DFlash2
        draft its candidate selector's walk from ``block[0]``."""
        return self.impl.propose(cache, *dflash_arguments(self.config, features, block), bool(commit))

    @property
    def weight_nbytes(self) -> int:
        return self.impl.weight_nbytes


# the tower's tensors handed over as float32 copies (everything else is a linear layer, read in place)
def _vision_small(name: str) -> bool:
    return name.endswith((".bias", "norm1", "norm2", "merger.norm")) or name == "pos_embed"


class CpuVisionEncoder:
    """The vision tower on the cpu engine (src/cpu/vision.h; docs/vision.md, "The vision tower on the cpu
    engine"): `encode(pixel_values, grid_thw) -> [n_merged, out_hidden_size]` float32, the computation of
    `reference_vision.VisionTower` with float32 activations on the linear weights as the checkpoint stores them
    (bf16, f16, f32 or MLX-quantized; read in place, biases / norms / the position table copied to float32).

    ``params`` are `Weights.vision`'s canonical tensors, ``vision_config`` the checkpoint's `VisionConfig`. With
    ``engine`` (a ``_core.CpuEngine``) it runs on that engine's threads, one call at a time with its forward;
    without, on ``threads`` threads of its own (default: the physical cores). Inputs are checked as the
    reference checks them (`reference_vision.check_inputs`: InputError naming the argument) before anything
    runs; the tower holds no state between calls."""

    def __init__(self, params, vision_config: VisionConfig, engine=None, threads: int | None = None):
        if not isinstance(vision_config, VisionConfig):
            raise TypeError(f"vision_config must be a VisionConfig, not {type(vision_config).__name__}")
        if not params:
            raise InputError("the checkpoint has no vision tower (no model.visual.* / vision_tower.* tensors)",
                             param="params")
        ext = core()
        if engine is None:
            threads = ext.cpu_physical_cores() if threads is None else threads
            if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
                raise ValueError(f"threads must be a positive integer, got {threads!r}")
        vc = vision_config
        keep: list = []
        linear, small = {}, {}
        for name, t in params.items():
            if _vision_small(name):
                small[name] = np.ascontiguousarray(to_float32(t).reshape(-1))
            else:
                linear[name] = describe(t, keep)
        dims = dict(hidden_size=vc.hidden_size, num_heads=vc.num_heads, head_dim=vc.head_dim,
                    intermediate_size=vc.intermediate_size, depth=vc.depth, in_channels=vc.in_channels,
                    temporal_patch_size=vc.temporal_patch_size, patch_size=vc.patch_size,
                    spatial_merge_size=vc.spatial_merge_size, grid_side=vc.grid_side,
                    out_hidden_size=vc.out_hidden_size, hidden_act=vc.hidden_act, rope_theta=float(vc.rope_theta))
        try:
            self.impl = ext.CpuVisionTower(dims, linear, small, engine=engine,
                                           threads=int(threads) if engine is None else 1, keepalive=keep)
        except ValueError as e:
            raise InputError(str(e), param="params") from None
        self.config = vc

    def encode(self, pixel_values, grid_thw) -> np.ndarray:
        """[n_merged, out_hidden_size] float32: the merged rows of every image, images in order."""
        pixels, g = check_inputs(self.config, pixel_values, grid_thw)
        return self.impl.encode(pixels, np.ascontiguousarray(g, dtype=np.int64))

    __call__ = encode

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the linear weights the tower reads in place."""
        return self.impl.weight_nbytes


def available() -> bool:
    """True when the compiled extension with the CPU engine is importable."""
    try:
        _core = core()
    except ImportError:
        return False
    return hasattr(_core, "CpuEngine")


class CpuMtpHead:
    """The MTP head on the cpu engine (qwenmetal.mtp; semantics: `ReferenceMtp`): decoder layer j as a one-layer
    head engine of its own (its tensors as ``layers.0``; fc, the pre-fc norms, ``norm``, the embedding and the
    lm_head shared, read in place), whose input is fc([RMSNorm(embedding); RMSNorm(hidden)]) of the main model's
    hidden rows. ``engine`` is layer 0's (it holds the context's pairs); `draft` runs a round."""

    def __init__(self, backend: CpuBackend, params: dict):
        c = backend.weights.config
        n = mtp_head_layers(params)
        hc = mtp_layer_config(c)
        shared = {k: v for k, v in params.items() if not k.startswith("layers.")}
        shared["embed_tokens"] = backend.weights.tensors["embed_tokens"]
        if not c.tie_word_embeddings:
            shared["lm_head"] = backend.weights.tensors["lm_head"]
        self.backends = []
        for j in range(n):
            pre = f"layers.{j}."
            t = dict(shared)
            t.update({"layers.0." + k[len(pre):]: v for k, v in params.items() if k.startswith(pre)})
            head = Weights(hc, t, backend.weights.layout, backend.weights.path, backend.weights.source)
            self.backends.append(CpuBackend(head, threads=backend.threads, kv_dtype=backend.kv_dtype,
                                            prefill_chunk=backend.prefill_chunk, activations=backend.activations,
                                            memory_budget=None))
        self.engines = [b.engine for b in self.backends]
        self.engine = self.engines[0]
        self.n_layers = n

    def new_state(self):
        """Layer 0's state: the context's pairs (the other layers' states live for one round)."""
        return self.engine.new_state()

    def draft(self, state, hidden: np.ndarray, ids: np.ndarray, k: int, vocab: int, return_logits: bool = False):
        """One round: the pairs (hidden[r], ids[r]) through layer 0 at `state`'s next rows (kept), then k greedy
        drafts among [0, vocab): draft 1 from the last pair, draft j + 1 from (step j's normed output, draft j)
        through layer j mod n at RoPE position one past step j's (a verify chain on layer 0's state, rewound;
        fresh states for the other layers). Returns the drafts, or (drafts, every step's logits [k, vocab])."""
        eng = self.engine
        if state.rewindable:              # drafts of an interrupted round are not the context's
            eng.rewind(state, 0)
        state.rope_delta = 0
        logits, h = eng.forward(state, np.ascontiguousarray(ids, dtype=np.int64), "last", None,
                                hidden=np.ascontiguousarray(hidden, dtype=np.float32), return_hidden=1)
        d = int(np.argmax(logits[:vocab]))
        drafts, rows, p = [d], [logits], state.position - 1     # p: the last pair's RoPE position
        others: dict = {}
        try:
            for j in range(1, k):
                lay = j % self.n_layers
                st = state if lay == 0 else others.setdefault(lay, self.engines[lay].new_state())
                st.rope_delta = p + j - st.position          # the entry at row st.position, RoPE position p + j
                lg, hh = self.engines[lay].verify(st, np.asarray([d], dtype=np.int64), None, hidden=h[None],
                                                  return_hidden=1)
                d, h = int(np.argmax(lg[0][:vocab])), hh[0]
                drafts.append(d)
                rows.append(lg[0])
        finally:
            state.rope_delta = 0
            if state.rewindable:
                eng.rewind(state, 0)
        return (drafts, np.stack(rows)) if return_logits else drafts
