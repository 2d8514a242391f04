"""Write a llama.cpp GGUF (arch ``qwen35moe``) straight from a qwenmetal-readable checkpoint, so that
llama.cpp and qwenmetal can be timed on the same weights.

    python -m qwenmetal.compare.gguf CHECKPOINT_DIR OUT.gguf [--type q4_0|f32]

(``qwenmetal compare`` and benchmarks/llama_cpp_compare.py convert with it: the one MLX -> GGUF writer.)

Every weight is read through qwenmetal's loader (canonical names, MLX 4-bit dequantized to float32 by the
compiled dequantizer) and written the way llama.cpp's own converter (``convert_hf_to_gguf.py``,
``Qwen3_5MoeTextModel``) writes a Qwen3.5/3.6-MoE checkpoint:

* tensor names ``token_embd``, ``output``, ``output_norm``, ``blk.N.{attn_norm, post_attention_norm,
  attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, attn_qkv, attn_gate, ssm_beta, ssm_alpha,
  ssm_conv1d, ssm_dt.bias, ssm_a, ssm_norm, ssm_out, ffn_gate_inp, ffn_{gate,up,down}_exps,
  ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp}``;
* RMSNorm weights as the multiplier (1 + w): the canonical weights already are;
* ``ssm_a = -exp(A_log)``; conv1d as [channels, K];
* the GDN value heads reordered from grouped-by-k-head to tiled order (llama.cpp broadcasts k-heads with
  ggml_repeat): rows of the v part of ``attn_qkv``, of ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, the v
  channels of ``ssm_conv1d``, ``ssm_dt.bias``, ``ssm_a`` and the columns of ``ssm_out``;
* the metadata keys the converter writes for this architecture (hparams, recurrent layer flags, MRoPE
  sections, tokenizer as ``gpt2`` BPE with pre-tokenizer ``qwen35``, padded to vocab_size).

``--type q4_0`` (default) quantizes every matrix that the MLX checkpoint holds at 4 bits -- including the
embedding and lm_head, which llama-quantize would otherwise keep at Q6_K -- to Q4_0 (block 32, one f16
scale: 4.5 bits/weight, the same bytes as MLX 4-bit g64 with bf16 scale and bias), and the two 8-bit
matrices (router, shared-expert gate) to Q8_0 (8.5 bits/weight, like MLX 8-bit g64). Norms, conv taps,
``ssm_a`` and ``ssm_dt.bias`` stay float32, as in llama.cpp's own files. ``--type f32`` writes everything
in float32 (the exact dequantized MLX values): the file used to validate the layout against qwenmetal's
reference forward pass (benchmarks/llama_cpp_compare.py --validate).

Needs the ``gguf`` package (the ``[bench]`` extra: ``pip install gguf``); memory stays near one expert
stack at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..fileio import atomic_file
from ..tokenizer import bytes_to_unicode
from ..weights import QuantizedTensor, load_weights, to_float32

ARCH = "qwen35moe"
# token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("writing a GGUF needs the gguf package: pip install gguf (the [bench] extra)") from e
    return gguf


# ---------------------------------------------------------------------------------------------
# quantizers (ggml reference semantics, vectorized; same as gguf.quants)
# ---------------------------------------------------------------------------------------------
def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 32 == 0) -> Q4_0 bytes [..., n/32*18]: per block of 32, f16 d = max/-8
    (max = the signed element of largest magnitude), q = clamp(trunc(x/d + 8.5), 0, 15), low nibbles are
    elements 0..15, high nibbles 16..31."""
    shape = x.shape
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    imax = np.abs(b).argmax(axis=-1)[:, None]
    mx = np.take_along_axis(b, imax, axis=-1)
    d = mx / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc(b * inv + np.float32(8.5)).astype(np.uint8)     # values 0..16 (16 only when x == max)
    np.minimum(q, 15, out=q)
    qs = q[:, :16] | (q[:, 16:] << np.uint8(4))
    out = np.concatenate([d.astype(np.float16).view(np.uint8), qs], axis=-1)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 18)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> Q8_0 bytes [..., n/32*34]: f16 d = amax/127, q = round-half-away(x/d)."""
    shape = x.shape
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    v = b * inv
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 34)


QTYPES = {"q4_0": (quantize_q4_0, 18), "q8_0": (quantize_q8_0, 34)}


# ---------------------------------------------------------------------------------------------
# tensor plan
# ---------------------------------------------------------------------------------------------
def v_head_order(nk: int, nv: int, head_dim: int) -> np.ndarray:
    """Index array: tiled position j takes grouped element idx[j]. Grouped = v heads of k-head 0, then of
    k-head 1, ...; tiled = v head 0 of every k-head, then v head 1 of every k-head, ..."""
    r = nv // nk
    return np.arange(nv * head_dim).reshape(nk, r, head_dim).transpose(1, 0, 2).reshape(-1)


class _Src:
    """A float32 producer for one GGUF tensor: reads (part of) a canonical tensor and transforms it."""

    def __init__(self, shape, fn, kind):
        self.shape, self.fn, self.kind = tuple(shape), fn, kind   # kind: "q4" | "q8" | "f32"

    def rows(self, r0, r1):
        return self.fn(r0, r1)


def _dense(t, transform=None):

    def fn(r0, r1):
        if isinstance(t, QuantizedTensor):
            part = QuantizedTensor(t.weight[r0:r1], t.scales[r0:r1], t.biases[r0:r1], t.bits, t.group_size)
            a = part.dequantize()
        else:
            a = to_float32(np.asarray(t)[r0:r1])
        return transform(a) if transform else a
    return fn


def tensor_plan(weights) -> list:
    """[(gguf_name, _Src)] for every tensor, in llama.cpp's converter order."""

    c = weights.config
    W = weights.tensors
    nk, nv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    plan = []

    def kind(t):
        if isinstance(t, QuantizedTensor):
            return "q8" if t.bits == 8 else "q4"
        return "f32"

    def add(name, t, transform=None, shape=None, force=None):
        shp = shape or tuple(t.shape)
        plan.append((name, _Src(shp, _dense(t, transform), force or kind(t))))

    add("output.weight", W["lm_head"])
    add("token_embd.weight", W["embed_tokens"])
    vo = v_head_order(nk, nv, dv)
    ho = v_head_order(nk, nv, 1)
    for i in range(c.num_hidden_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", W[p + "input_layernorm"], force="f32")
        if c.is_full_attention(i):
            a = p + "self_attn."
            add(b + "attn_q.weight", W[a + "q_proj"])
            add(b + "attn_k.weight", W[a + "k_proj"])
            add(b + "attn_v.weight", W[a + "v_proj"])
            add(b + "attn_output.weight", W[a + "o_proj"])
            add(b + "attn_q_norm.weight", W[a + "q_norm"], force="f32")
            add(b + "attn_k_norm.weight", W[a + "k_norm"], force="f32")
        else:
            g = p + "linear_attn."
            kd = c.key_dim
            qkv_rows = np.concatenate([np.arange(2 * kd), 2 * kd + vo])
            add(b + "attn_qkv.weight", _rows(W[g + "in_proj_qkv"], qkv_rows))
            add(b + "attn_gate.weight", _rows(W[g + "in_proj_z"], vo))
            add(b + "ssm_beta.weight", _rows(W[g + "in_proj_b"], ho))
            add(b + "ssm_alpha.weight", _rows(W[g + "in_proj_a"], ho))
            conv = np.asarray(W[g + "conv1d"], dtype=np.float32)
            add(b + "ssm_conv1d.weight", conv[qkv_rows], force="f32")
            add(b + "ssm_dt.bias", np.asarray(W[g + "dt_bias"], np.float32)[ho], force="f32")
            add(b + "ssm_a", -np.exp(np.asarray(W[g + "A_log"], np.float32)[ho]), force="f32")
            add(b + "ssm_norm.weight", W[g + "norm"], force="f32")
            add(b + "ssm_out.weight", W[g + "out_proj"], transform=lambda a, o=vo: a[..., o])
        m = p + "mlp."
        add(b + "ffn_gate_inp.weight", W[m + "gate"])
        add(b + "ffn_gate_exps.weight", W[m + "switch_mlp.gate_proj"])
        add(b + "ffn_up_exps.weight", W[m + "switch_mlp.up_proj"])
        add(b + "ffn_down_exps.weight", W[m + "switch_mlp.down_proj"])
        add(b + "ffn_gate_shexp.weight", W[m + "shared_expert.gate_proj"])
        add(b + "ffn_up_shexp.weight", W[m + "shared_expert.up_proj"])
        add(b + "ffn_down_shexp.weight", W[m + "shared_expert.down_proj"])
        add(b + "ffn_gate_inp_shexp.weight", W[m + "shared_expert_gate"])
        add(b + "post_attention_norm.weight", W[p + "post_attention_layernorm"], force="f32")
    add("output_norm.weight", W["norm"], force="f32")
    return plan


def _rows(t, rows):
    if isinstance(t, QuantizedTensor):
        return t.take_rows(rows)                       # exact: scales and biases are per row
    return np.take(np.asarray(t), rows, axis=-2)


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict:
    return bytes_to_unicode()


def tokenizer_fields(checkpoint: str, vocab_size: int) -> dict:
    """tokens / token_type / merges for a gpt2-style BPE vocabulary padded to vocab_size with
    ``[PAD{i}]`` (unused) entries, as the converter does; from tokenizer.json when present."""
    path = os.path.join(checkpoint, "tokenizer.json")
    tokens: dict[int, tuple[str, int]] = {}
    merges: list[str] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        model = tj.get("model", {})
        for tok, i in model.get("vocab", {}).items():
            tokens[int(i)] = (tok, TOKEN_NORMAL)
        for m in model.get("merges", []):
            merges.append(m if isinstance(m, str) else " ".join(m))
        for at in tj.get("added_tokens", []):
            tokens[int(at["id"])] = (at["content"], TOKEN_CONTROL if at.get("special") else TOKEN_USER_DEFINED)
    else:                                                  # byte-level symbols only
        for i, ch in enumerate(_bytes_to_unicode().values()):
            tokens[i] = (ch, TOKEN_NORMAL)
    names, types = [], []
    for i in range(vocab_size):
        tok, ty = tokens.get(i, (f"[PAD{i}]", TOKEN_UNUSED))
        names.append(tok)
        types.append(ty)
    return {"tokens": names, "token_type": types, "merges": merges}


# ---------------------------------------------------------------------------------------------
# writer
# ---------------------------------------------------------------------------------------------
def _nbytes(shape, kind, qtype):
    n = int(np.prod(shape))
    if kind == "f32" or qtype == "f32":
        return 4 * n
    return n // 32 * (18 if kind == "q4" else 34)


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, qtype: str = "q4_0", log=print) -> Path:
    """Write `out` (a GGUF file) from the checkpoint directory. qtype: "q4_0" or "f32"."""
    gguf = _gguf()

    if qtype not in ("q4_0", "f32"):
        raise ValueError("qtype must be 'q4_0' or 'f32'")
    checkpoint = os.fspath(checkpoint)
    c = ModelConfig.from_file(checkpoint)
    if c.model_type not in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise ValueError(f"only Qwen3.5/3.6-MoE checkpoints are supported, got {c.model_type}")
    if c.tie_word_embeddings or any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        raise ValueError("tied embeddings or dense-MLP layers are not supported")
    raw = c.raw or {}
    text = raw.get("text_config", raw) if raw.get("model_type") == "qwen3_5_moe" else raw
    rope = text.get("rope_parameters") or {}
    sections = list(rope.get("mrope_section") or [11, 11, 10])
    sections = (sections + [0, 0, 0, 0])[:4]
    weights = load_weights(checkpoint, c)
    plan = tensor_plan(weights)
    GT = gguf.GGMLQuantizationType

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:             # a failure leaves neither `out` nor a partial file
        w = gguf.GGUFWriter(str(tmp), ARCH)
        w.add_type("model")
        w.add_name(f"qwenmetal random {c.num_hidden_layers}-layer")
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_dimension_sections(sections)
        w.add_rope_freq_base(float(c.rope_theta))
        w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "q4_0" else gguf.LlamaFileType.ALL_F32))
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        # newer keys, written by name (older gguf packages lack the helpers)
        w.add_array(f"{ARCH}.attention.recurrent_layers",
                    [not c.is_full_attention(i) for i in range(c.num_hidden_layers)])
        w.add_uint32(f"{ARCH}.full_attention_interval", int(text.get("full_attention_interval", 4)))
        w.add_rope_dimension_count(c.rotary_dim)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tok = tokenizer_fields(checkpoint, c.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["token_type"])
        if tok["merges"]:
            w.add_token_merges(tok["merges"])
        if c.eos_token_ids:
            w.add_eos_token_id(int(c.eos_token_ids[0]))
        w.add_add_bos_token(False)

        gtype = {"q4": GT.Q4_0, "q8": GT.Q8_0, "f32": GT.F32}
        for name, src in plan:
            k = "f32" if qtype == "f32" else src.kind
            w.add_tensor_info(name, src.shape, np.dtype(np.float32), _nbytes(src.shape, k, qtype), raw_dtype=gtype[k])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        t0 = time.perf_counter()
        total = 0
        for j, (name, src) in enumerate(plan):
            k = "f32" if qtype == "f32" else src.kind
            lead = src.shape[0]
            per_row = int(np.prod(src.shape[1:])) if len(src.shape) > 1 else 1
            step = max(1, (1 << 24) // per_row) if len(src.shape) > 1 else lead    # ~16M elements at a time
            if k == "f32":
                data = np.concatenate([src.rows(r0, min(lead, r0 + step)) for r0 in range(0, lead, step)]) \
                    if len(src.shape) > 1 else src.rows(0, lead)
                data = np.ascontiguousarray(data, dtype=np.float32).reshape(src.shape)
            else:
                qfn, bs = QTYPES["q4_0" if k == "q4" else "q8_0"]
                data = np.empty(src.shape[:-1] + (src.shape[-1] // 32 * bs,), np.uint8)
                for r0 in range(0, lead, step):
                    r1 = min(lead, r0 + step)
                    data[r0:r1] = qfn(src.rows(r0, r1))
            w.write_tensor_data(data)
            total += data.nbytes
            if log and (data.nbytes > 64 << 20 or j == len(plan) - 1):
                log(f"  {name}: {data.nbytes / 2**20:.0f} MiB ({total / 2**30:.2f} GiB, {time.perf_counter() - t0:.0f} s)")
            del data
        w.close()
    return out


def q4_0_path(checkpoint: str | os.PathLike) -> Path:
    """Where `ensure_q4_0` keeps the Q4_0 GGUF of a checkpoint: beside it, ``<dir>.q4_0.gguf``."""
    ckpt = Path(checkpoint).resolve()
    return ckpt.parent / f"{ckpt.name}.q4_0.gguf"


def ensure_q4_0(checkpoint: str | os.PathLike, log=None) -> Path:
    """The Q4_0 GGUF of `checkpoint` (`q4_0_path`), written on first use (atomically: `convert`)."""
    out = q4_0_path(checkpoint)
    if not out.exists():
        if log:
            log(f"writing {out} (one-time) ...")
        t = time.perf_counter()
        convert(checkpoint, out, "q4_0", log=log)
        if log:
            log(f"  GGUF written in {time.perf_counter() - t:.0f} s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--type", default="q4_0", choices=("q4_0", "f32"))
    a = p.parse_args(argv)
    convert(a.checkpoint, a.out, a.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
