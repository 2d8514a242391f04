"""What the two C++ engine backends (cpu, metal / metal-sim) share: the expert cache's counters and a state
built from `Session.save`'s layout. Each keeps its C++ engine as ``self.engine``, its weights as
``self.weights`` and its KV element type as ``self.kv_dtype``; `kv_rows` says how its KV cache lays out one
layer's keys or values."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..session_io import gdn_state_arrays, gdn_state_vectors


def row_arguments(rows) -> dict:
    """A `qwenmetal.mrope.RowInputs` as the C++ engines' forward takes it (keyword arguments)."""
    out = {"rope_delta": int(rows.rope_delta)}
    if rows.pair_pos is not None:
        out["pair_pos"] = np.ascontiguousarray(rows.pair_pos, dtype=np.int32)
    if len(rows.embed_rows):
        out["embed_rows"] = np.ascontiguousarray(rows.embed_rows, dtype=np.int64)
        out["embeds"] = np.ascontiguousarray(rows.embeds, dtype=np.float32)
    return out


def dflash_dims(c) -> dict:
    """A DFlash draft's config (`qwenmetal.dflash.DFlashConfig`) as the native drafts take it (the cpu engine's
    CpuDFlashDraft, the Metal graph's GpuDFlashDraft): its dimensions, per-layer attention windows (0: full),
    scalings and DFlash2's convolution and selector sizes."""
    windows = [int(c.sliding_window) if kind == "sliding_attention" else 0 for kind in c.layer_types]
    return dict(variant=c.variant, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                num_feature_layers=len(c.target_layer_ids), rms_norm_eps=float(c.rms_norm_eps),
                rope_theta=float(c.rope_theta), windows=windows, attention_bias=bool(c.attention_bias),
                input_embedding_scale=float(c.input_embedding_scale), output_multiplier=float(c.output_multiplier),
                final_logit_softcapping=float(c.final_logit_softcapping or 0.0),
                conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
                selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)


def dflash_arguments(config, features, block) -> tuple:
    """A native draft call's arguments (`CpuDFlash`, `GpuDFlash`): the context features as float32 [n, F] and the
    block's token ids as int64 [L]; ValueError for another rank (the engines check the sizes)."""
    f = np.ascontiguousarray(features, dtype=np.float32)
    if f.ndim != 2:
        raise ValueError(f"context features must be [n, {config.feature_size}], got {list(f.shape)}")
    ids = np.ascontiguousarray(block, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"the block must be a 1-D sequence of token ids, got shape {list(ids.shape)}")
    return f, ids


class EngineBackend:
    # ---- expert streaming statistics (expert_streaming.expert_stats summarises them) -------------------
    def expert_counters(self) -> dict:
        """Raw ExpertCache counters since the last `reset_expert_stats`: streaming, slots_per_layer,
        policy, lookups, hits, misses, bytes_read, io_seconds, tokens (run through the engine)."""
        return self.engine.expert_stats()

    def reset_expert_stats(self) -> None:
        self.engine.reset_expert_stats()

    # ---- speculative decoding: the end of a verify chain ------------------------------------------------
    def rewind(self, state, keep: int, consumed: list | None = None) -> None:
        """End the verify chain keeping its first `keep` tokens (the rest leave `consumed` too)."""
        self.engine.rewind(state, int(keep), consumed)

    # ---- Session.save / Session.load (backend-independent layout, see session_io.py) -------------------
    def kv_saved(self, a: np.ndarray, position: int) -> np.ndarray:
        """One layer's keys or values as the engine exports them -> the saved layout [nkv, P, hd]."""
        raise NotImplementedError

    def kv_rows(self, a: np.ndarray, position: int) -> np.ndarray:
        """One layer's keys or values [nkv, P, hd] (the saved layout) as the engine stores them."""
        raise NotImplementedError

    def state_to_arrays(self, state) -> dict:
        """The state in the backend-independent layout of Session.save."""
        c = self.weights.config
        position, kv, conv, ssm = state._export()
        out = {"position": np.array([position], dtype=np.int64)}
        for j, i in enumerate(c.full_attention_layers):
            out[f"layers.{i}.key"] = self.kv_saved(kv[2 * j], position)
            out[f"layers.{i}.value"] = self.kv_saved(kv[2 * j + 1], position)
        out.update(gdn_state_arrays(c, conv, ssm))
        return out

    def state_from_arrays(self, arrays: dict):
        """A state from `state_to_arrays`' layout (checked by qwenmetal.session_io before it gets here)."""
        c = self.weights.config
        position = int(np.asarray(arrays["position"]).reshape(-1)[0])
        kv_t = np.float32 if self.kv_dtype == "float32" else ml_dtypes.bfloat16
        kv = [self.kv_rows(np.asarray(arrays[f"layers.{i}.{n}"]).astype(kv_t), position).reshape(-1).view(np.uint8)
              for i in c.full_attention_layers for n in ("key", "value")]
        conv, ssm = gdn_state_vectors(c, arrays)
        st = self.new_state()
        st._import(position, kv, conv, ssm)
        return st
