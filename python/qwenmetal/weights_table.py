"""The weights table (src/core/weights.h) from Python: every canonical tensor as a span of one of the
checkpoint's file mappings -- {mapping, offset, dtype, shape, bits, group} -- for the C++ engines.

``weight_table(weights)`` describes the loaded tensors in place: one mapping per safetensors file (the
tensors viewing it are bound by offset), one per array the loader had to build (shifted norms, split
projections, stacked experts). ``virtual_weight_table(config, bits, expert_bits=...)`` describes a
checkpoint in the MLX layout (any width, routed experts at their own) from the config alone, over a
virtual mapping, for costing or sizing the real model without its weights.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .config import mtp_layer_config
from .errors import CheckpointError, InputError
from .quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from .weights import QuantizedTensor, Weights, is_routed_expert

NP_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
             np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def root_buffer(a: np.ndarray):
    """The object whose memory `a` views (an mmap for tensors read from a safetensors file), or None."""
    b = a
    while isinstance(b, np.ndarray) and b.base is not None:
        b = b.base
    if isinstance(b, memoryview):
        return b.obj
    return None


class _Table:
    """Builds the (mappings, tensors) pair the C++ weights table is made from (src/core/weights.h)."""

    def __init__(self):
        self.mappings: list[tuple[str, int, int]] = []
        self.tensors: dict[str, dict] = {}
        self.keep: list = []
        self._by_id: dict[int, int] = {}

    def span(self, a: np.ndarray, name: str):
        """((mapping, offset, nbytes), stride) of `a`: stride is the bytes between the matrices of a stack
        whose matrices are each C-contiguous but not adjacent (HF's fused experts viewed as gate / up: used
        in place), else 0 (contiguous; anything else is copied into a mapping of its own)."""
        it = a.itemsize
        stride = 0
        if not a.flags.c_contiguous:
            if a.ndim == 3 and a.shape[0] > 1 and a.strides[-1] == it and a.strides[-2] == a.shape[-1] * it \
                    and a.strides[0] >= a.shape[-2] * a.shape[-1] * it:
                stride = int(a.strides[0])
            else:
                a = np.ascontiguousarray(a)
        extent = (a.shape[0] - 1) * stride + a[0].nbytes if stride else a.nbytes
        root = root_buffer(a)
        if root is not None and not isinstance(root, (bytes, bytearray)):
            key = id(root)
            if key not in self._by_id:
                base = np.frombuffer(root, np.uint8)
                self._by_id[key] = len(self.mappings)
                self.mappings.append((getattr(root, "name", "") or f"mapping {len(self.mappings)}", ptr(base),
                                      int(base.nbytes)))
                self.keep.append(base)
            m = self._by_id[key]
            _, base_ptr, size = self.mappings[m]
            off = ptr(a) - base_ptr
            if 0 <= off and off + extent <= size:
                self.keep.append(a)
                return (m, off, int(extent)), stride
        # a tensor the loader built (converted, stacked, shifted): a mapping of its own
        a = np.ascontiguousarray(a)
        self.keep.append(a)
        self.mappings.append((name, ptr(a), int(a.nbytes)))
        return (len(self.mappings) - 1, 0, int(a.nbytes)), 0

    def add(self, name: str, t) -> None:
        if isinstance(t, QuantizedTensor):
            s = t.scales
            (w, ws), (sc, ss), (bi, bs) = (self.span(t.weight, name + ".weight"), self.span(s, name + ".scales"),
                                           self.span(t.biases, name + ".biases"))
            if ss != bs:   # scales and biases share one stride in the table
                (sc, ss), (bi, bs) = self.span(np.ascontiguousarray(s), name + ".scales"), \
                    self.span(np.ascontiguousarray(t.biases), name + ".biases")
            self.tensors[name] = dict(bits=t.bits, group_size=t.group_size, dtype="float32", sdtype=NP_DTYPE_NAMES[s.dtype],
                                      shape=list(t.shape), data=w, scales=sc, biases=bi, stride=ws, sstride=ss)
            return
        a = np.asarray(t)
        if a.dtype not in NP_DTYPE_NAMES:
            a = a.astype(np.float32)
        data, stride = self.span(a, name)
        self.tensors[name] = dict(bits=0, group_size=0, dtype=NP_DTYPE_NAMES[a.dtype], sdtype="bfloat16", shape=list(a.shape),
                                  data=data, scales=None, biases=None, stride=stride, sstride=0)


def weight_table(weights: Weights, tensors: dict | None = None):
    """(mappings, tensors, keep): every canonical tensor (or those of `tensors`, name -> tensor) as
    {mapping, offset, dtype, shape, bits, group} (plus the stride between the matrices of a strided stack). One mapping per safetensors file (the tensors viewing it
    are bound by offset), one per array the loader had to build; ``keep`` holds the arrays the mappings
    point into."""
    t = _Table()
    for name, v in (weights.tensors if tensors is None else tensors).items():
        t.add(name, v)
    return t.mappings, t.tensors, t.keep


def virtual_weight_table(config, bits: int = 4, group_size: int = 64, router_bits: int = 8,
                         expert_bits: int | None = None):
    """The weights table of a checkpoint in the MLX layout of ``config`` (mlx-community's conversion:
    every linear at ``bits``/``group_size`` with bf16 scales, the routed experts at ``expert_bits``
    (default ``bits``), the router and shared_expert_gate at ``router_bits``; norms and GDN vectors
    dense), over virtual mappings: for costing or sizing a model without its weights. Returns
    (mappings, tensors, sizes) with sizes = canonical name -> bytes."""
    for name, b in (("bits", bits), ("router_bits", router_bits), ("expert_bits", expert_bits)):
        if b is not None and b not in SUPPORTED_BITS:
            raise InputError(f"{name} must be one of {SUPPORTED_BITS}, got {b!r}", param=name)
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InputError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}", param="group_size")
    expert_bits = bits if expert_bits is None else expert_bits
    c = config
    tensors: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    mappings = [("virtual checkpoint", 0, 0)]
    cursor = [0]

    def span(nbytes: int):
        off = cursor[0]
        cursor[0] += (nbytes + 63) // 64 * 64
        return (0, off, int(nbytes))

    def lin(name, rows, cols, lead=(), b=bits):
        n = int(np.prod(lead, dtype=np.int64)) if lead else 1
        wb = n * rows * cols * b // 8
        sb = n * rows * (cols // group_size) * 2
        tensors[name] = dict(bits=b, group_size=group_size, dtype="float32", sdtype="bfloat16",
                             shape=[*lead, rows, cols], data=span(wb), scales=span(sb), biases=span(sb))
        sizes[name] = wb + 2 * sb

    def vec(name, *shape, dtype="bfloat16"):
        n = int(np.prod(shape, dtype=np.int64)) * (4 if dtype == "float32" else 2)
        tensors[name] = dict(bits=0, group_size=0, dtype=dtype, sdtype="bfloat16", shape=list(shape), data=span(n),
                             scales=None, biases=None)
        sizes[name] = n

    H, V = c.hidden_size, c.vocab_size
    lin("embed_tokens", V, H)
    if not c.tie_word_embeddings:
        lin("lm_head", V, H)
    vec("norm", H)
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        vec(p + "input_layernorm", H)
        vec(p + "post_attention_layernorm", H)
        if c.is_full_attention(i):
            a = p + "self_attn."
            q_rows = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
            lin(a + "q_proj", q_rows, H)
            lin(a + "k_proj", c.num_key_value_heads * c.head_dim, H)
            lin(a + "v_proj", c.num_key_value_heads * c.head_dim, H)
            lin(a + "o_proj", H, c.num_attention_heads * c.head_dim)
            vec(a + "q_norm", c.head_dim)
            vec(a + "k_norm", c.head_dim)
        else:
            g = p + "linear_attn."
            lin(g + "in_proj_qkv", c.conv_dim, H)
            lin(g + "in_proj_z", c.value_dim, H)
            lin(g + "in_proj_b", c.linear_num_value_heads, H)
            lin(g + "in_proj_a", c.linear_num_value_heads, H)
            lin(g + "out_proj", H, c.value_dim)
            vec(g + "conv1d", c.conv_dim, c.linear_conv_kernel_dim)
            vec(g + "A_log", c.linear_num_value_heads, dtype="float32")
            vec(g + "dt_bias", c.linear_num_value_heads)
            vec(g + "norm", c.linear_value_head_dim)
        m = p + "mlp."
        if c.is_moe_layer(i):
            E, inter = c.num_experts, c.moe_intermediate_size
            lin(m + "gate", E, H, b=router_bits)
            lin(m + "switch_mlp.gate_proj", inter, H, (E,), b=expert_bits)
            lin(m + "switch_mlp.up_proj", inter, H, (E,), b=expert_bits)
            lin(m + "switch_mlp.down_proj", H, inter, (E,), b=expert_bits)
            if c.shared_expert_intermediate_size:
                s = c.shared_expert_intermediate_size
                lin(m + "shared_expert.gate_proj", s, H)
                lin(m + "shared_expert.up_proj", s, H)
                lin(m + "shared_expert.down_proj", H, s)
                lin(m + "shared_expert_gate", 1, H, b=router_bits)
        else:
            lin(m + "gate_proj", c.intermediate_size, H)
            lin(m + "up_proj", c.intermediate_size, H)
            lin(m + "down_proj", H, c.intermediate_size)
    mappings[0] = ("virtual checkpoint", 0, cursor[0])
    return mappings, tensors, sizes


def virtual_mtp_weight_table(config, n_layers: int = 1, bits: int = 4, group_size: int = 64, router_bits: int = 8,
                             expert_bits: int | None = None):
    """The weights table of an MTP head of ``n_layers`` layers (``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``norm``, ``layers.*`` full-attention MoE layers) with the model's embedding and
    lm_head, in the MLX layout of `virtual_weight_table` (``fc`` at ``bits``), over a virtual mapping: for
    costing the head (`GpuEngine.mtp_cost`) without its weights. Returns (mappings, tensors, sizes)."""
    mappings, tensors, sizes = virtual_weight_table(mtp_layer_config(config, n_layers), bits=bits,
                                                    group_size=group_size, router_bits=router_bits,
                                                    expert_bits=expert_bits)
    name, _, end = mappings[0]
    H = config.hidden_size

    def span(nbytes: int):
        nonlocal end
        off = end
        end += (nbytes + 63) // 64 * 64
        return (0, off, int(nbytes))

    wb, sb = H * 2 * H * bits // 8, H * (2 * H // group_size) * 2
    tensors["fc"] = dict(bits=bits, group_size=group_size, dtype="float32", sdtype="bfloat16", shape=[H, 2 * H],
                         data=span(wb), scales=span(sb), biases=span(sb))
    sizes["fc"] = wb + 2 * sb
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        tensors[n] = dict(bits=0, group_size=0, dtype="bfloat16", sdtype="bfloat16", shape=[H], data=span(2 * H),
                          scales=None, biases=None)
        sizes[n] = 2 * H
    mappings[0] = (name, 0, end)
    return mappings, tensors, sizes


def config_widths(config) -> dict:
    """The ``virtual_weight_table`` widths a config.json's MLX quantization block describes (``bits`` /
    ``group_size`` its default, ``router_bits`` the router's override, ``expert_bits`` the routed
    experts' override), or {} for a dense config. CheckpointError when the routed experts' overrides
    differ between layers (a per-layer recipe only the weights themselves can size)."""

    q = config.quantization
    if q is None:
        return {}
    routed = {(s.bits, s.group_size) for p, s in q.overrides.items() if is_routed_expert(p)}
    routers = {s.bits for p, s in q.overrides.items() if p.endswith("mlp.gate")}
    if len(routed) > 1 or len(routers) > 1 or any(g != q.default.group_size for _, g in routed):
        raise CheckpointError("config.json's quantization block gives the routed experts (or routers) different "
                              "widths per layer: sizing it needs the weights")
    out = dict(bits=q.default.bits, group_size=q.default.group_size)
    if routed:
        out["expert_bits"] = next(iter(routed))[0]
    if routers:
        out["router_bits"] = next(iter(routers))
    return out


def tensor_format(t) -> dict:
    """The format and shape of a linear tensor, without its data (a streamed stack's descriptor)."""
    if isinstance(t, QuantizedTensor):
        sd = t.scales.dtype
        return dict(bits=t.bits, group_size=t.group_size, dtype="float32",
                    sdtype=NP_DTYPE_NAMES.get(sd, str(sd)), shape=list(t.shape))
    a = np.asarray(t)
    return dict(bits=0, group_size=0, dtype=NP_DTYPE_NAMES.get(a.dtype, str(a.dtype)), sdtype="bfloat16",
                shape=list(a.shape))


def config_dict(c) -> dict:
    """The model config as the C++ engines take it (src/core/config.h)."""
    return dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        layer_is_attention=[c.is_full_attention(i) for i in range(c.num_hidden_layers)],
        layer_is_moe=[c.is_moe_layer(i) for i in range(c.num_hidden_layers)],
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rotary_dim=c.rotary_dim, attn_output_gate=c.attn_output_gate,
        rope_theta=float(c.rope_theta),
        linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim,
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        intermediate_size=c.intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
        rms_norm_eps=float(c.rms_norm_eps), tie_word_embeddings=bool(c.tie_word_embeddings))
