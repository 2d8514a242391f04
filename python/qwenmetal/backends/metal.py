"""The Metal backends: the C++ decode and prefill graphs (``src/gpu/``) on a GPU device.

* ``backend="metal"`` (macOS, Apple Silicon): the graph on the real GPU through ``MetalDevice``.
* ``backend="metal-sim"`` (every platform): the same graph and the same kernels executed by the
  Metal-on-CPU simulator (``SimDevice``), with its checks on (barriers, divergence, uninitialised
  threadgroup memory, bounds, missing memory barriers between dispatches). It is slow — a tiny model
  runs a few tokens per second — and exists to verify the graph in CI.

Everything Metal is **simulator-verified, hardware-unverified** until a Mac has run it
(docs/mac-first-run.md).

Options (``Model.load(path, backend="metal-sim", **options)``):

* ``dtype``: activation type of every kernel, ``"bfloat16"`` (production; the default of ``metal``) or
  ``"float32"`` (exact against the float32 reference; the default of ``metal-sim``, a verification backend:
  its tokens are the CPU backend's). The bfloat build rounds where MLX's bf16 graph rounds.
* ``kv_dtype``: KV cache element type, ``"bfloat16"`` (default) or ``"float32"``; ``dtype="float32"``
  defaults it to ``"float32"``.
* ``attention``: overrides of the decode-attention policy, e.g. ``{"single_pass_max": 8}`` (tests use
  it to reach every route on short contexts).
* ``prefill_chunk``: tokens per prefill chunk (default 4096, the modelled-cost optimum on the real config:
  docs/metal.md, "The prefill graph"); each chunk runs as command buffers committed back to back, and the
  prefill scratch is sized for it. The prefix cache snapshots at these chunk boundaries (``Model.load`` sets its ``chunk_tokens``).
* ``gemm_route``: the prefill GEMMs' route, ``"auto"`` (the device's: Metal 4 tensor ops on M5, else
  ``simdgroup_matrix``), ``"simdgroup"`` or ``"tensor"``.
* ``gdn_route``: the Gated DeltaNet prefill, ``"auto"`` (by chunk length from the cost model), ``"scan"``
  or ``"chunked"`` (the WY/UT form).
* ``memory_budget`` (``"auto"``, the default: the memory available here; bytes; or ``None``: never stream),
  ``expert_slots``, ``expert_policy`` (``"lfu"`` | ``"lru"`` | ``"os"``), ``expert_direct_io``: expert streaming
  (``qwenmetal.expert_streaming``). When the checkpoint does not fit the budget, the routed experts are read from
  the files into ``expert_slots`` slot stacks per MoE layer (device buffers) as the routing asks for them,
  and a token runs as per-layer command buffers (docs/metal.md, "Streaming mode"); everything else stays
  as below. ``expert_slots`` / ``expert_policy`` force streaming on any checkpoint (tests).
* metal-sim only: ``schedule`` (``"forward"``, ``"reverse"``, ``"random"``: the order the simulator
  runs the threads of a threadgroup in) and ``seed``.

Prefill runs the prompt in chunks of ``prefill_chunk`` tokens, each cut into command buffers committed back to
back (under a modelled time budget: docs/metal.md, "Runtime limits") with no host read-back inside it (docs/metal.md, "The prefill graph"). Weights are used
in place: each safetensors file is one device buffer wrapping its memory map, tensors are bound by
offset (``weight_table``); the stacked projections are built at load (their bytes are reported as
``copied_bytes``).
"""
from __future__ import annotations

import operator

import ml_dtypes
import numpy as np

from ..config import mtp_head_layers, mtp_layer_config
from ..errors import InputError
from ..expert_streaming import expert_stats, stream_spec
from ..native import core
from ..weights import Weights
from ..weights_table import config_dict, weight_table
from ..working_set import DEFAULT_CONTEXT
from ..working_set import plan as memory_plan
from .engine import EngineBackend, dflash_arguments, dflash_dims, row_arguments
from .reference_vision import check_inputs as check_vision_inputs

DTYPES = ("bfloat16", "float32")
# SimDevice's modelled Mac limits a metal-sim model can be given (device_options; docs/metal.md, "Runtime limits")
# (and count_banks: the simulator's per-kernel bank-conflict counting, docs/metal.md, "What the simulator counts")
SIM_DEVICE_OPTIONS = {"pipeline_max_threads", "working_set", "watchdog_seconds", "count_banks"}
GEMM_ROUTES = ("auto", "simdgroup", "tensor")
GDN_ROUTES = ("auto", "scan", "chunked")
DEFAULT_PREFILL_CHUNK = 4096


def prefill_options(prefill_chunk, gemm_route: str, gdn_route: str, command_buffer_seconds=None) -> dict:
    """The engine's prefill options, validated (ValueError naming the option)."""
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    if gemm_route not in GEMM_ROUTES:
        raise ValueError(f"gemm_route must be one of {GEMM_ROUTES}, got {gemm_route!r}")
    if gdn_route not in GDN_ROUTES:
        raise ValueError(f"gdn_route must be one of {GDN_ROUTES}, got {gdn_route!r}")
    out = {"chunk": int(prefill_chunk), "gemm_route": gemm_route, "gdn_route": gdn_route}
    if command_buffer_seconds is not None:
        if isinstance(command_buffer_seconds, bool) or not isinstance(command_buffer_seconds, (int, float)) \
                or not command_buffer_seconds >= 0:
            raise ValueError(f"command_buffer_seconds must be a number >= 0, got {command_buffer_seconds!r}")
        out["command_buffer_seconds"] = float(command_buffer_seconds)
    return out




def _layer_list(layers) -> list:
    """Decoder-layer indices as the engine takes them (it checks range, count and duplicates itself)."""
    try:
        out = [operator.index(i) for i in layers]
    except TypeError:
        raise ValueError(f"feature layers must be a sequence of layer indices, got {layers!r}") from None
    if isinstance(layers, (str, bytes)) or any(isinstance(i, bool) for i in layers):
        raise ValueError(f"feature layers must be a sequence of layer indices, got {layers!r}")
    return out


# ------------------------------------------------------------------------------------------ backends
class _GpuBackend(EngineBackend):
    """What metal and metal-sim share: the engine on a device, the state, Session.save/load."""

    name = ""

    def __init__(self, weights: Weights, device, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 gemm_route: str = "auto", gdn_route: str = "auto", memory_budget="auto", expert_slots=None,
                 expert_policy=None, expert_direct_io=False, max_context: int = DEFAULT_CONTEXT,
                 command_buffer_seconds: float | None = None):
        prefill = prefill_options(prefill_chunk, gemm_route, gdn_route, command_buffer_seconds)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kv_dtype is None:
            kv_dtype = dtype
        if kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {DTYPES}, got {kv_dtype!r}")
        # against the GPU's working set (recommendedMaxWorkingSetSize): resident, a smaller chunk, or streaming
        self.memory = memory_plan(weights.config, weights, int(device.info["working_set"]), context=max_context,
                                  chunk=prefill["chunk"], dtype=dtype, kv_dtype=kv_dtype, memory_budget=memory_budget,
                                  expert_slots=expert_slots, expert_policy=expert_policy,
                                  expert_direct_io=expert_direct_io)
        prefill["chunk"] = self.memory.chunk
        self.plan = self.memory.stream
        streaming = stream_spec(weights, self.plan) if self.plan.stream else None
        self.weights = weights
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.attention = dict(attention or {})
        mappings, tensors, keep = weight_table(weights)
        self.device = device
        self.engine = core().gpu.GpuEngine(device, config_dict(weights.config), mappings, tensors,
                                            "f32" if dtype == "float32" else "bf16", kv_dtype == "float32",
                                            self.attention, keep, prefill, streaming)
        self.prefill_chunk = int(self.engine.prefill_chunk)
        self.gemm_route = str(self.engine.gemm_route)
        self.gdn_route = gdn_route

    @property
    def snapshot_chunk(self) -> int:
        """The prefix cache's snapshot interval (``PrefixCache.chunk_tokens``): the prefill chunk, so every
        snapshot is the state at a chunk boundary of the GPU prefill."""
        return self.prefill_chunk

    def new_state(self):
        return self.engine.new_state()

    #: prefill takes explicit M-RoPE positions and embedding rows (RowInputs; chunked prefill, resident experts:
    #: with expert streaming the engine refuses them with ValueError)
    row_inputs = True

    def forward(self, state, ids: np.ndarray, logits: str, consumed: list | None = None, rows=None):
        """Run `ids` on `state` in place (all-or-nothing; a Ctrl-C between chunks restores it) and return
        (state, logits); `ids` are appended to `consumed` (a session's token list) inside the call. `rows`:
        explicit M-RoPE positions and embedding rows (`qwenmetal.mrope.RowInputs`)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if rows is None:
            return state, self.engine.forward(state, ids, logits, consumed)
        return state, self.engine.forward(state, ids, logits, consumed, **row_arguments(rows))

    def forward_hidden(self, state, ids: np.ndarray, logits: str, consumed: list | None = None):
        """`forward` that also returns every row's final-normed hidden state: (logits or None, [n, hidden] float32),
        for an MTP head's cache over a prompt (the chunk's final RMSNorm, one more dispatch per chunk)."""
        return self.engine.forward_hidden(state, np.ascontiguousarray(ids, dtype=np.int64), logits, consumed)

    def forward_features(self, state, ids: np.ndarray, logits: str, consumed: list | None, layers) -> tuple:
        """`forward` that also returns the outputs of the decoder layers `layers` (0-based, distinct, 1..8, any
        order) for every row, concatenated ([n, len(layers) * hidden], float32; the residual stream after each
        layer as the graph holds it, widened to float): a DFlash draft's context features, copied out in the
        same pass (prefill chunks, or the decode step for one token). Returns (logits, features). Bad layers:
        ValueError, the state untouched."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return self.engine.forward_features(state, ids, logits, consumed, _layer_list(layers))

    def decode(self, state, first: int, n: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, seed: int = 0, stop_ids=(), pipelined: bool = True, vocab: int = 0,
               consumed: list | None = None, mask: np.ndarray | None = None) -> list:
        """Generate up to `n` tokens after input token `first`, sampled on the GPU (argmax when
        temperature is 0) among logits [0, vocab) (0: all), one command buffer per token with two in
        flight; stops after a stop id. The state advances by the inputs consumed: `first` and every
        generated token but the last -- appended to `consumed` (a session's token list) inside the call.
        All-or-nothing: an error, or a Ctrl-C (checked between steps), restores the state of the start.

        `mask` (structured output; then `n` must be 1): a token bitmask, a uint32 or int32 array of
        ceil(vocab_size / 32) words in which bit i % 32 of word i / 32 allows token i (llguidance's
        ``fill_next_token_bitmask`` layout), applied to the step's logits on the GPU before argmax or
        sampling; it must allow some token of [0, vocab). A wrong mask raises ValueError, state untouched."""
        if mask is not None:
            mask = np.ascontiguousarray(mask)
        return self.engine.decode(state, int(first), int(n), greedy=temperature == 0, temperature=float(temperature),
                                  top_k=int(top_k), top_p=float(top_p), min_p=float(min_p), seed=int(seed),
                                  stop_ids=[int(t) for t in stop_ids], pipelined=pipelined, vocab=int(vocab),
                                  consumed=consumed, mask=mask)

    # ---- speculative decoding (qwenmetal.speculative) ---------------------------------------------
    @property
    def native_verify(self) -> bool:
        """The graph verifies drafted tokens itself with resident experts; a streaming backend is verified
        row by row by qwenmetal.speculative."""
        return not self.plan.stream

    def verify(self, state, ids: np.ndarray, consumed: list | None = None, return_hidden: bool = False,
               features=None):
        """Run `ids` (at most 16, and 16 in a chain) with the logits of each ([n, vocab]), every row bit for
        bit a decode step's, keeping the GDN state after each row for `rewind` (consecutive calls chain).
        `return_hidden`: (logits, the final-normed hidden rows [n, hidden]). `features` (decoder-layer indices,
        not with `return_hidden`): (logits, those layers' outputs [n, len(features) * hidden]), row r bit for
        bit what a one-token `forward_features` gives it."""
        if features is not None and return_hidden:
            raise ValueError("verify returns hidden states or layer features, not both")
        return self.engine.verify(state, np.ascontiguousarray(ids, dtype=np.int64), consumed,
                                  return_hidden=bool(return_hidden),
                                  features=None if features is None else _layer_list(features))

    @property
    def max_verify_rows(self) -> int | None:
        """The most rows of one `verify` call, and of one open chain of them (16), None in streaming mode (row by
        row, no limit)."""
        return None if self.plan.stream else 16

    @property
    def max_batch_rows(self) -> int | None:
        """The most rows of one `decode_batch` with resident experts (16); None in streaming mode, where the
        rows run one by one (`qwenmetal.session.decode_batch`)."""
        return None if self.plan.stream else 16

    def decode_batch(self, states, ids, consumed=None) -> np.ndarray:
        """One decode step of B (1..16) independent states in one command buffer: row r is token ids[r] on
        states[r] at that state's own position; returns the logits [B, vocab] (float32), row r bit for bit a
        one-token forward on states[r] alone. Every weight is read once for all rows (the union-read MoE).
        All-or-nothing: on success each state advanced one token and ids[r] was appended to consumed[r]
        (consumed: None, or one token list or None per state)."""
        return self.engine.decode_batch(list(states), np.ascontiguousarray(ids, dtype=np.int64),
                                        None if consumed is None else list(consumed))

    def dflash_draft(self, draft) -> "GpuDFlash | None":
        """The forward of the DFlash draft `draft` (a `qwenmetal.dflash.DFlashDraft`) on this backend's graph and
        device: over this model's embedding and lm_head, the draft's weights bound in place (bf16 or MLX-quantized),
        one command buffer per draft call (docs/metal.md, "The DFlash draft graph"). None for a draft the graph does
        not run (DFlash2, ``attention_bias``, an ``input_embedding_scale`` other than 1: the numpy reference runs
        those); ValueError for one that does not fit this model."""
        c = draft.config
        if c.variant != "dflash" or not GpuDFlash.runs(c):
            return None
        return GpuDFlash(self, draft)

    def mtp_head(self, params: dict) -> "GpuMtpHead | None":
        """The MTP head `params` (`Weights.mtp` names) natively in the Metal graph (`GpuMtpHead`), with resident
        experts; None in streaming mode (the drafter then computes with the numpy reference)."""
        if self.plan.stream:
            return None
        return GpuMtpHead(self, params)

    def vision_encoder(self, weights: Weights | None = None) -> "GpuVisionEncoder":
        """The checkpoint's vision tower on this backend's graph and device (docs/vision.md, "The vision tower in
        the Metal graph"): ``encode(pixel_values, grid_thw) -> [n_merged, out_hidden_size]`` float32, in this
        backend's activation type. Built once, on first use. InputError for a checkpoint without a tower.
        `weights`: as `ModelBase.vision_encoder` passes them; they must be this backend's own."""
        if weights is not None and weights is not self.weights:
            raise ValueError("vision_encoder: the weights are not this backend's")
        enc = getattr(self, "_vision", None)
        if enc is None:
            enc = self._vision = GpuVisionEncoder(self)
        return enc

    def kv_saved(self, a: np.ndarray, position: int) -> np.ndarray:
        """The graph keeps the saved [nkv, P, hd] layout (exported as bytes)."""
        c = self.weights.config
        kv_t = np.float32 if self.kv_dtype == "float32" else ml_dtypes.bfloat16
        return a.view(kv_t).reshape(c.num_key_value_heads, position, c.head_dim).copy()

    def kv_rows(self, a: np.ndarray, position: int) -> np.ndarray:
        """The graph keeps the saved [nkv, P, hd] layout."""
        return np.ascontiguousarray(a)

    def info(self) -> dict:
        return {"device": dict(self.device.info), "dtype": self.dtype, "kv_dtype": self.kv_dtype,
                "prefill_chunk": self.prefill_chunk, "gemm_route": self.gemm_route, "gdn_route": self.gdn_route,
                "weight_bytes": self.engine.weight_bytes, "copied_bytes": self.engine.copied_bytes,
                "slot_bytes": self.engine.slot_bytes, "experts": expert_stats(self.expert_counters()),
                "memory_plan": self.memory.describe(), "status": "simulator-verified, hardware-unverified"}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype!r}, kv_dtype={self.kv_dtype!r}, device={self.device.info['name']!r})"


class GpuDFlash:
    """A DFlash draft's forward on the Metal graph (`_GpuBackend.dflash_draft`; src/gpu/dflash.h): the computation
    of `qwenmetal.dflash.DFlashReference.forward` + ``logits`` for the block rows 1.., in the backend's activation
    type (float32: to the reference's tolerance; bfloat16: rounded where the graph rounds), over the target's
    embedding and lm_head, one call at a time with the target's own (the engine's lock). Its context cache
    (`new_cache`, a ``_core.gpu.GpuDFlashCache`` with ``position``) belongs to the caller. Simulator-verified,
    hardware-unverified."""

    @staticmethod
    def runs(config) -> bool:
        """Whether the graph runs a DFlash draft of `config` (no attention bias, no input embedding scale)."""
        return config.variant == "dflash" and not config.attention_bias and config.input_embedding_scale == 1.0

    def __init__(self, backend: _GpuBackend, draft):
        c = draft.config
        if not self.runs(c):
            raise ValueError(f"{draft.path}: the Metal graph runs DFlash drafts without attention_bias and with an "
                             f"input_embedding_scale of 1, not this {c.variant} draft (the numpy reference, "
                             f"qwenmetal.dflash.DFlashReference, runs it)")
        t = backend.weights.config
        if (c.hidden_size, c.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(f"{draft.path}: hidden_size {c.hidden_size} / vocab_size {c.vocab_size} do not match "
                             f"the target's {t.hidden_size} / {t.vocab_size}")
        self.config = c
        mappings, tensors, keep = weight_table(None, draft.tensors)
        self.impl = core().gpu.GpuDFlashDraft(backend.engine, dflash_dims(c), mappings, tensors, (keep, draft.source))

    def new_cache(self):
        """An empty context cache (``position`` 0)."""
        return self.impl.new_cache()

    def forward(self, cache, features, block, commit: bool = True) -> np.ndarray:
        """One draft call: the context features [n, len(target_layer_ids) * hidden] (n may be 0) of the tokens
        the target accepted since the last committed call, and the block's token ids [L] (L >= 1). Returns the
        logits of block rows 1..L-1 [L - 1, vocab] float32. With `commit` the context rows join `cache`; without
        it, and on any error, `cache` is left as it was."""
        return self.impl.forward(cache, *dflash_arguments(self.config, features, block), bool(commit))

    def cost(self, cache, n: int, block: int) -> dict:
        """What one draft call of `n` new context rows and a block of `block` tokens at the cache's position costs
        as encoded (dispatches, levels, command buffers, bytes and flops per level; the cache does not advance)."""
        return self.impl.cost(cache, int(n), int(block))

    @property
    def weight_nbytes(self) -> int:
        return self.impl.weight_nbytes


class GpuMtpHead:
    """The MTP head in the Metal graph (qwenmetal.mtp; semantics: `ReferenceMtp`; graph: docs/metal.md, "The MTP
    head"): a GpuEngine of its own over the head's tensors (n full-attention MoE layers, fc and its two norms)
    and the main model's embedding and lm_head, bound in place on the main model's device. `draft` runs one
    round -- the verified pairs through layer 0, then k greedy drafts chained on the GPU -- as one command buffer;
    the state holds layer 0's cache of the context's pairs."""

    #: the most pairs / drafts of one `mtp_draft` call (kMaxMtpPairs, kMaxMtpDrafts in src/gpu/model.h)
    MAX_PAIRS, MAX_DRAFTS = 256, 16

    def __init__(self, backend: _GpuBackend, params: dict):
        c = backend.weights.config
        self.n_layers = mtp_head_layers(params)
        t = dict(params)
        t["embed_tokens"] = backend.weights.tensors["embed_tokens"]
        if not c.tie_word_embeddings:
            t["lm_head"] = backend.weights.tensors["lm_head"]
        mappings, tensors, keep = weight_table(backend.weights, t)
        # the main model's wrapped files are reused (share): each checkpoint file stays one device buffer
        self.engine = core().gpu.GpuEngine(backend.device, config_dict(mtp_layer_config(c, self.n_layers)), mappings,
                                           tensors, "f32" if backend.dtype == "float32" else "bf16",
                                           backend.kv_dtype == "float32", backend.attention, keep,
                                           share=backend.engine)
        self.last_command_buffers = 0     # of the last round (1 unless the encoder's time budget cut it)

    def new_state(self):
        return self.engine.new_state()

    def draft(self, state, hidden: np.ndarray, ids: np.ndarray, k: int, vocab: int, return_logits: bool = False):
        """One round (`GpuEngine.mtp_draft`): the pairs (hidden[r], ids[r]) through layer 0 (kept in `state`), then
        k (<= 16) greedy drafts among [0, vocab). Returns the drafts, or (drafts, every step's logits [k, vocab])."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        k = min(int(k), self.MAX_DRAFTS)
        n = self.MAX_PAIRS
        while ids.size > n:               # a prompt's pairs: fed ahead, no drafts
            self.engine.mtp_draft(state, hidden[:n], ids[:n], 0, vocab)
            hidden, ids = hidden[n:], ids[n:]
        drafts, logits, self.last_command_buffers = self.engine.mtp_draft(state, hidden, ids, int(k), int(vocab),
                                                                          return_logits)
        return (drafts, logits) if return_logits else drafts


def vision_dims(vc) -> dict:
    """A `VisionConfig`'s dimensions as the native tower (``_core.gpu.GpuVisionTower``) takes them."""
    return {"depth": vc.depth, "hidden_size": vc.hidden_size, "num_heads": vc.num_heads,
            "intermediate_size": vc.intermediate_size, "patch_dim": vc.patch_dim,
            "spatial_merge_size": vc.spatial_merge_size, "out_hidden_size": vc.out_hidden_size,
            "grid_side": vc.grid_side, "rope_theta": float(vc.rope_theta), "hidden_act": vc.hidden_act}


class GpuVisionEncoder:
    """The vision tower on the Metal graph (`_GpuBackend.vision_encoder`; src/gpu/vision.h): the computation of
    `qwenmetal.backends.reference_vision.VisionTower` in the backend's activation type (float32: to the reference's
    tolerance; bfloat16: rounded where the graph rounds), weights bound in place, one encoder per call whose command
    buffers the backend's ``command_buffer_seconds`` cuts. A call holds the engine's lock, so it never runs beside
    the text model's own calls. Simulator-verified, hardware-unverified."""

    def __init__(self, backend: _GpuBackend):
        w = backend.weights
        vc = w.config.vision
        if vc is None or not w.vision:
            raise InputError("the checkpoint has no vision tower (no model.visual.* / vision_tower.* tensors)",
                             param="params")
        self.config = vc
        mappings, tensors, keep = weight_table(None, w.vision)
        self.impl = core().gpu.GpuVisionTower(backend.engine, vision_dims(vc), mappings, tensors, keep)

    def encode(self, pixel_values, grid_thw) -> np.ndarray:
        """[n_merged, out_hidden_size] float32: the merged rows of every image, images in order (the rows that
        stand in for each image's ``<|image_pad|>`` tokens). `pixel_values` [n_patches, patch_dim] and `grid_thw`
        [n_images, 3] as the image processor gives them (`qwenmetal.images.preprocess`); checked as the reference
        checks them (InputError naming the argument)."""
        pixels, grid = check_vision_inputs(self.config, pixel_values, grid_thw)
        return self.impl.encode(pixels, np.ascontiguousarray(grid, dtype=np.int64))

    __call__ = encode

    def cost(self, grid_thw) -> dict:
        """What one call for `grid_thw` costs as encoded (dispatches, levels, command buffers, bytes and flops per
        level; no pixels are read)."""
        return self.impl.cost(np.ascontiguousarray(grid_thw, dtype=np.int64))

    @property
    def last_command_buffers(self) -> int:
        """Command buffers the last call committed."""
        return int(self.impl.last_command_buffers)

    @property
    def weight_nbytes(self) -> int:
        return self.impl.weight_nbytes


class MetalSimBackend(_GpuBackend):
    """The Metal graph and kernels executed by the Metal-on-CPU simulator (every platform)."""

    name = "metal-sim"

    def __init__(self, weights: Weights, dtype: str = "float32", kv_dtype: str | None = None,
                 attention: dict | None = None, schedule: str = "forward", seed: int = 0,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, gemm_route: str = "auto", gdn_route: str = "auto",
                 memory_budget="auto", expert_slots=None, expert_policy=None, expert_direct_io=False,
                 max_context: int = DEFAULT_CONTEXT, command_buffer_seconds: float | None = None,
                 device_options: dict | None = None):
        opts = dict(device_options or {})
        unknown = set(opts) - SIM_DEVICE_OPTIONS
        if unknown:
            raise ValueError(f"device_options: unknown {sorted(unknown)}; known: {sorted(SIM_DEVICE_OPTIONS)}")
        dev = core().gpu.SimDevice(schedule=schedule, seed=int(seed), **opts)
        self.schedule = schedule
        super().__init__(weights, dev, dtype, kv_dtype, attention, prefill_chunk, gemm_route, gdn_route,
                         memory_budget, expert_slots, expert_policy, expert_direct_io, max_context,
                         command_buffer_seconds)

    def info(self) -> dict:
        # the simulator's per-pipeline counts (dispatches, threadgroups, threadgroup memory, bank conflicts when
        # the device counts them): what `bench --kernels` reads
        return dict(super().info(), kernel_stats=dict(self.device.kernel_stats()))


class MetalBackend(_GpuBackend):
    """The Metal graph on this Mac's GPU (macOS builds only)."""

    name = "metal"

    def __init__(self, weights: Weights, dtype: str = "bfloat16", kv_dtype: str | None = None,
                 attention: dict | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 gemm_route: str = "auto", gdn_route: str = "auto", memory_budget="auto", expert_slots=None,
                 expert_policy=None, expert_direct_io=False, max_context: int = DEFAULT_CONTEXT,
                 command_buffer_seconds: float | None = None):
        g = core().gpu
        dev = g.MetalDevice()
        # every family this GPU runs and every pipeline, now and in parallel: no dispatch waits for Apple's
        # compiler, and a kernel the compiler rejects fails the load, naming it, instead of a later call
        self.compile_report = dev.compile_all()
        bad = [r for r in self.compile_report if not r["ok"]]
        if bad:
            raise g.DeviceError("the Metal compiler rejected " + "; ".join(f"{r['origin']}:\n{r['log']}" for r in bad))
        super().__init__(weights, dev, dtype, kv_dtype, attention, prefill_chunk, gemm_route, gdn_route,
                         memory_budget, expert_slots, expert_policy, expert_direct_io, max_context,
                         command_buffer_seconds)


def sim_available() -> bool:
    try:
        return hasattr(core(), "gpu")
    except ImportError:
        return False


def metal_available() -> bool:
    """True on a macOS build with a Metal device."""
    try:
        g = core().gpu
    except (ImportError, AttributeError):
        return False
    if not hasattr(g, "MetalDevice"):
        return False
    try:
        return bool(g.metal_device_available())
    except Exception:
        return False
