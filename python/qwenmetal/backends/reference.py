"""Numpy reference forward pass of the Qwen3.5/3.6-MoE and Qwen3-Next hybrid models.

This module is the project's ground truth. It is written to be read next to docs/model.md
(§4-§6): one function per block, no kernels, no tricks beyond vectorisation.

Layout of a forward call (docs/model.md §4.1)::

    x = embed_tokens[ids]
    for each layer i:
        r = full_attention(rms_norm(x))   if config.is_full_attention(i)
            gated_deltanet(rms_norm(x))   otherwise
        h = x + r
        x = h + (sparse_moe | dense_mlp)(rms_norm(h))
    logits = rms_norm(x, norm) @ lm_head^T

Inputs are the loader's canonical dense float32 parameters (see `ReferenceModel`). All RMSNorm
weights except ``linear_attn.norm`` are already shifted (``y = x_normed * w``).

Precision modes
---------------
``dtype="float32"`` (default): every value is float32 and nothing is rounded. This is the mode that
is compared against HF/MLX float32 at 1e-4.

``dtype="bfloat16"``: values are still held in float32 arrays, but are rounded to bfloat16
(round-to-nearest-even via ``ml_dtypes``) at the points where MLX rounds when it runs a bf16 model.
Weights are used exactly as given. Products and reductions are computed in float32 (MLX kernels
accumulate in float32) and rounded only at these points:

* embedding: the gathered rows.
* every linear layer (``x @ W^T``): the output.
* RMSNorm (input/post-attention/final/q_norm/k_norm, MLX ``mx.fast.rms_norm``): ``x * inv`` is rounded,
  then the product with the weight is rounded again (statistics in float32).
* residual adds (``x + r`` and ``h + mlp``): the sum.
* full attention: q/k norms as above; the RoPE output of q and k (angles and rotation in float32);
  the KV cache therefore holds bf16 values; scores, softmax and ``P @ V`` in float32
  (``mx.fast.scaled_dot_product_attention``) with the output rounded; ``sigmoid(gate)``; the gated
  product ``o * sigmoid(gate)``; ``o_proj``.
* Gated DeltaNet: projections; the conv output; SiLU as MLX computes it (``sigmoid(x)`` rounded, then
  ``x * sigmoid`` rounded); q/k normalisation as MLX ``normalize_qk`` (``rms_norm`` output rounded,
  then the product with the bf16-rounded scalar ``1/dk`` for q, ``dk^-0.5`` for k, rounded);
  ``beta = sigmoid(b)`` rounded. ``g_log`` is kept in float32 from the (rounded) ``a`` projection (HF
  precision, docs/model.md §4.4; MLX computes ``a + dt_bias`` and the softplus in bf16). The recurrence
  (recurrent or chunked) runs in float32 on the rounded q, k, v, beta with a float32 state; its output
  is rounded. Gated RMSNorm: ``x * inv`` rounded, ``weight * n`` rounded, ``n * silu_fp32(z)`` rounded
  (docs/model.md §4.2). The conv state caches the rounded projection rows.
* MoE: router logits rounded; softmax computed in float32 from them and the top-k *selection* made
  on the float32 probabilities, exact ties going to the lower expert index (docs/model.md §4.5; MLX selects
  with ``argpartition`` on bf16 probabilities, so near-ties and the exact ties that bf16 logits
  produce can pick a different expert); the selected probabilities rounded (MLX's bf16 softmax
  output); if renormalising, the sum and the quotient rounded; each expert's gate/up/down outputs
  rounded; SwiGLU as MLX
  (``silu`` rounded as above, then ``silu * up`` rounded); each ``score * expert_out`` rounded, the sum
  over the k experts done in float32 and rounded once; shared expert: its projections and SwiGLU as
  above, ``sigmoid(x @ w_sg)`` rounded, ``sigmoid * shared`` rounded; the final ``routed + shared``
  rounded. Dense-MLP layers: like the shared expert without the gate.
* final norm as above; the lm_head output (the returned logits are bf16 values in float32).

The GDN recurrent state is always float32, in both modes.

Not modelled: what happens *inside* MLX's elementwise kernels (its bf16 ``sigmoid`` is not always the
correctly rounded value; its compiled float32 ``silu`` differs by a few float32 ulps), float32
summation order, MLX's bf16 ``a + dt_bias``/softplus (see above), and MLX-CPU's fallback attention
(which, unlike the Metal kernel, rounds scores and probabilities to bf16). Checked against mlx-lm 0.32
on CPU (bf16 weights, layer by layer on identical inputs): projections, RMSNorms, the conv and the q/k
normalisation are bit-identical, the gated norm is within one bf16 ulp; what remains is ~1 bf16 ulp
noise plus the routing ties described above.

Performance: everything is vectorised except the per-token GDN recurrence, the per-chunk scan and the
per-expert MoE loop. numpy's multithreaded BLAS can be slow when the CPU is oversubscribed;
``OPENBLAS_NUM_THREADS=1`` helps there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import ml_dtypes
import numpy as np

from ..config import ModelConfig, mtp_layer_config
from ..interrupts import sigint_deferred
from ..memory import total_memory
from ..mrope import RowInputs
from .reference_vision import VisionTower

if TYPE_CHECKING:
    from ..weights import Weights

__all__ = [
    "BF16", "to_bf16", "sigmoid", "silu", "softplus", "softmax",
    "rms_norm", "gated_rms_norm", "l2norm", "rope", "rope_tables", "causal_conv1d",
    "gdn_recurrent", "gdn_chunked", "full_attention", "gated_deltanet", "swiglu",
    "sparse_moe", "dense_mlp", "decoder_layer",
    "ReferenceState", "ReferenceModel", "ReferenceBackend",
    "ReferenceMtp",
]

BF16 = ml_dtypes.bfloat16
F32 = np.float32
L2NORM_EPS = 1e-6          # HF/FLA l2norm and MLX normalize_qk use a literal 1e-6, not rms_norm_eps


# ---------------------------------------------------------------------------------------------
# elementwise helpers
# ---------------------------------------------------------------------------------------------
def to_bf16(x) -> np.ndarray:
    """Round to bfloat16 (nearest even) and return the values as float32."""
    return np.asarray(x, dtype=F32).astype(BF16).astype(F32)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def _rounder(bf16: bool) -> Callable[[np.ndarray], np.ndarray]:
    return to_bf16 if bf16 else _f32


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function in float32."""
    x = _f32(x)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(F32)


def silu(x: np.ndarray, bf16: bool = False) -> np.ndarray:
    """x * sigmoid(x). In bf16 mode as MLX's ``nn.silu`` on a bf16 array: sigmoid rounded, product rounded."""
    x = _f32(x)
    if bf16:
        return to_bf16(x * to_bf16(sigmoid(x)))
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)) in float32, stable for large |x|."""
    x = _f32(x)
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(F32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax in float32; rows that are entirely -inf are not expected."""
    x = _f32(x)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _linear(x: np.ndarray, w: np.ndarray, bf16: bool) -> np.ndarray:
    """y = x @ W^T with W [out, in]; float32 accumulation, output rounded in bf16 mode."""
    return _rounder(bf16)(x @ w.T)


# ---------------------------------------------------------------------------------------------
# norms and RoPE (docs/model.md §4.2, §4.3, §4.6)
# ---------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, bf16: bool = False) -> np.ndarray:
    """RMSNorm over the last axis with a shifted weight: ``x * rsqrt(mean(x^2) + eps) * w``.

    Statistics in float32. bf16 mode follows ``mx.fast.rms_norm``: ``w * bf16(x * inv)``, rounded.
    """
    x = _f32(x)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    if bf16:
        return to_bf16(weight * to_bf16(x * inv))
    return x * inv * weight


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float, *,
                   bf16: bool = False) -> np.ndarray:
    """GDN output norm, per head vector (last axis): normalise, times the plain weight, times silu(z).

    bf16 mode (docs/model.md §4.2): ``n = bf16(x*inv)``; ``n = bf16(w*n)``; ``y = bf16(n * silu_fp32(z))``.
    """
    x = _f32(x)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    if bf16:
        n = to_bf16(weight * to_bf16(x * inv))
        return to_bf16(n * silu(z))
    return x * inv * weight * silu(z)


def l2norm(x: np.ndarray, eps: float = L2NORM_EPS) -> np.ndarray:
    """L2-normalise the last axis: ``x * rsqrt(sum(x^2) + eps)`` (HF/FLA eps placement), float32."""
    x = _f32(x)
    return x * (1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(eps)))


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [L, rotary_dim/2] for absolute ``positions``: [L] (every frequency pair at the row's
    position), or [L, rotary_dim/2] (a position per pair: interleaved M-RoPE, `qwenmetal.mrope.pair_positions`).

    ``inv_freq[d] = theta^(-2d/rotary_dim)`` (correctly rounded to float32), angle = ``fp32(pos) *
    inv_freq`` in float32, and cos/sin of that float32 angle evaluated accurately (float64, then rounded).
    """
    half = rotary_dim // 2
    inv_freq = (float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / rotary_dim)).astype(F32)
    pos = np.asarray(positions).astype(F32)
    ang = (pos[:, None] if pos.ndim == 1 else pos) * inv_freq[None, :]                # float32 product
    ang64 = ang.astype(np.float64)
    return np.cos(ang64).astype(F32), np.sin(ang64).astype(F32)


def rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """Partial rotate-half RoPE. ``x`` [L, heads, head_dim]; only the first ``rotary_dim`` dims rotate.

    Pairs are (d, d + rotary_dim/2): ``x[d] = x1 cos - x2 sin``, ``x[d+half] = x2 cos + x1 sin``.
    """
    x = _f32(x)
    half = rotary_dim // 2
    cos, sin = rope_tables(positions, rotary_dim, theta)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], axis=-1)


# ---------------------------------------------------------------------------------------------
# full (gated) attention (docs/model.md §4.3)
# ---------------------------------------------------------------------------------------------
def full_attention(x: np.ndarray, p: dict, config: ModelConfig, k_cache: np.ndarray, v_cache: np.ndarray,
                   position: int, *, bf16: bool = False, rope_pos: np.ndarray | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gated GQA attention over ``x`` [L, H] at absolute positions ``position..position+L-1``.

    ``rope_pos``: the rows' RoPE positions ([L] or [L, rotary_dim/2] per frequency pair, see `rope_tables`)
    when they are not the indices (M-RoPE: image rows, text after an image); the cache and the causal mask
    always go by index.

    ``p`` holds this layer's ``self_attn.*`` tensors by short name (``q_proj``, ``k_proj``, ...).
    ``k_cache``/``v_cache`` [nkv, position, hd] hold the previous post-RoPE keys and the values.
    Returns ``(out [L, H], new_k_cache, new_v_cache)``; the inputs are not modified.
    """
    r = _rounder(bf16)
    L = x.shape[0]
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    assert k_cache.shape[1] == position and v_cache.shape[1] == position

    qg = _linear(x, p["q_proj"], bf16)
    if config.attn_output_gate:
        qg = qg.reshape(L, nh, 2 * hd)                 # per head: [query (hd) | gate (hd)]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
    else:
        q, gate = qg.reshape(L, nh, hd), None
    k = _linear(x, p["k_proj"], bf16).reshape(L, nkv, hd)
    v = _linear(x, p["v_proj"], bf16).reshape(L, nkv, hd)

    q = rms_norm(q, p["q_norm"], eps, bf16=bf16)       # q/k norm before RoPE
    k = rms_norm(k, p["k_norm"], eps, bf16=bf16)
    pos = position + np.arange(L)
    rpos = pos if rope_pos is None else rope_pos
    q = r(rope(q, rpos, config.rotary_dim, config.rope_theta))
    k = r(rope(k, rpos, config.rotary_dim, config.rope_theta))

    K = np.concatenate([k_cache, k.transpose(1, 0, 2)], axis=1)   # [nkv, T, hd], T = position + L
    V = np.concatenate([v_cache, v.transpose(1, 0, 2)], axis=1)
    T = K.shape[1]

    group = nh // nkv                                  # query head h uses kv head h // group
    qh = q.transpose(1, 0, 2).reshape(nkv, group, L, hd)
    scores = np.matmul(qh, np.swapaxes(K, -1, -2)[:, None]) * F32(hd ** -0.5)     # [nkv, group, L, T]
    causal = np.arange(T)[None, :] <= pos[:, None]     # [L, T]: key t visible from query at pos
    scores = np.where(causal, scores, -np.inf)
    probs = softmax(scores, axis=-1)
    o = np.matmul(probs, V[:, None]).reshape(nh, L, hd).transpose(1, 0, 2).reshape(L, nh * hd)
    o = r(o)
    if gate is not None:
        o = r(o * r(sigmoid(gate)))
    return _linear(o, p["o_proj"], bf16), K, V


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet (docs/model.md §4.4, §6)
# ---------------------------------------------------------------------------------------------
def causal_conv1d(x: np.ndarray, conv_state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv (cross-correlation, no bias) over ``x`` [L, C] with kernel ``weight`` [C, K].

    ``conv_state`` [K-1, C] holds the previous K-1 *pre-conv* rows, oldest first; tap K-1 multiplies the
    current row. Returns ``(out [L, C], new_conv_state [K-1, C])``.
    """
    L = x.shape[0]
    K = weight.shape[1]
    xin = np.concatenate([conv_state, x], axis=0)      # [L + K - 1, C]
    out = np.zeros_like(x, dtype=F32)
    for j in range(K):
        out += xin[j:j + L] * weight[:, j]
    return out, xin[L:].copy()


def _expand_heads(x: np.ndarray, n_to: int) -> np.ndarray:
    """[L, nk, d] -> [L, nv, d] so that v-head h reads k-head h // (nv/nk)."""
    return np.repeat(x, n_to // x.shape[1], axis=1)


def gdn_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g_log: np.ndarray,
                  state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule, one token at a time (docs/model.md §4.4). All float32.

    q, k [L, nk, dk] (q already l2-normalised and scaled by dk^-0.5, k l2-normalised); v [L, nv, dv];
    beta, g_log [L, nv]; state [nv, dv, dk] (MLX layout). Returns ``(o [L, nv, dv], new_state)``;
    ``state`` is not modified.
    """
    L, nv, dv = v.shape
    q, k = _expand_heads(_f32(q), nv), _expand_heads(_f32(k), nv)
    v, beta, decay = _f32(v), _f32(beta), np.exp(_f32(g_log))
    S = np.array(state, dtype=F32, copy=True)
    o = np.empty((L, nv, dv), dtype=F32)
    for t in range(L):
        S *= decay[t][:, None, None]
        kv = np.matmul(S, k[t][:, :, None])[..., 0]              # [nv, dv] = S k
        d = (v[t] - kv) * beta[t][:, None]
        S += d[:, :, None] * k[t][:, None, :]                     # rank-1 update
        o[t] = np.matmul(S, q[t][:, :, None])[..., 0]             # S q
    return o, S


def gdn_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g_log: np.ndarray,
                state: np.ndarray, chunk_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule in the chunked WY/UT form (docs/model.md §6). Same contract as `gdn_recurrent`.

    The sequence is padded to a multiple of ``chunk_size`` with q = k = v = 0, beta = 0, g = 0 (exact
    no-ops); a sequence shorter than ``chunk_size`` is processed as a single chunk of length L.
    Per v-head and chunk (HF notation, state S0 as [dk, dv]):
      G = cumsum(g); D_ij = exp(G_i - G_j) for j <= i else 0 (masked before exp);
      Lmat = strict_lower(beta_i k_i.k_j D_ij); T = I + Lmat, T^-1 by forward substitution;
      U = T^-1 (beta v); W = T^-1 (beta Gamma k); M = lower_incl(q_i.k_j D_ij);
      V_new = U - W S0; O = (Gamma q) S0 + M V_new; S = Gamma_C S0 + (k exp(G_C - G))^T V_new.
    The state is kept in MLX layout [nv, dv, dk] (= S^T per head).
    """
    L, nv, dv = v.shape
    assert chunk_size >= 1 and L >= 1
    # A sequence shorter than one chunk is one chunk of its own length: identical to padding it with no-op
    # rows (T is lower-triangular, so the padded rows never reach the real ones), only cheaper.
    C = min(chunk_size, L)
    pad = (-L) % C
    n_chunks = (L + pad) // C

    def chunked(a):       # [L, nv, ...] -> [nv, n_chunks, C, ...], zero-padded
        a = np.moveaxis(_f32(a), 0, 1)
        a = np.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape((nv, n_chunks, C) + a.shape[2:])

    q = chunked(_expand_heads(_f32(q), nv))
    k = chunked(_expand_heads(_f32(k), nv))
    v = chunked(v)
    beta = chunked(beta)
    g = chunked(g_log)

    G = np.cumsum(g, axis=-1, dtype=F32)                              # [nv, n, C]
    gamma = np.exp(G)
    incl = np.tril(np.ones((C, C), dtype=bool))                       # j <= i
    strict = np.tril(np.ones((C, C), dtype=bool), -1)                 # j < i
    D = np.exp(np.where(incl, G[..., :, None] - G[..., None, :], -np.inf)).astype(F32)

    kk = np.matmul(k, np.swapaxes(k, -1, -2))                         # [nv, n, C, C]
    Lmat = np.where(strict, beta[..., :, None] * kk * D, F32(0))
    # T^-1 by forward substitution: row i = e_i - sum_{j<i} Lmat_ij row_j
    Tinv = np.zeros_like(Lmat)
    for i in range(C):
        Tinv[..., i, i] = 1.0
        if i:
            Tinv[..., i, :i] -= np.matmul(Lmat[..., i:i + 1, :i], Tinv[..., :i, :i])[..., 0, :]
    U = np.matmul(Tinv, beta[..., None] * v)                          # [nv, n, C, dv]
    W = np.matmul(Tinv, (beta * gamma)[..., None] * k)                # [nv, n, C, dk]
    M = np.where(incl, np.matmul(q, np.swapaxes(k, -1, -2)) * D, F32(0))
    q_decayed = gamma[..., None] * q                                  # Gamma_i q_i
    k_to_end = np.exp(G[..., -1:] - G)[..., None] * k                 # exp(G_C - G_i) k_i

    S = np.array(state, dtype=F32, copy=True)                         # [nv, dv, dk]
    o = np.empty((nv, n_chunks, C, dv), dtype=F32)
    for c in range(n_chunks):
        St = np.swapaxes(S, -1, -2)                                   # [nv, dk, dv] (HF layout)
        v_new = U[:, c] - np.matmul(W[:, c], St)                      # [nv, C, dv]
        o[:, c] = np.matmul(q_decayed[:, c], St) + np.matmul(M[:, c], v_new)
        S = gamma[:, c, -1][:, None, None] * S + np.matmul(np.swapaxes(v_new, -1, -2), k_to_end[:, c])
    o = o.reshape(nv, n_chunks * C, dv)[:, :L]
    return np.ascontiguousarray(np.moveaxis(o, 0, 1)), S


def _normalize_qk(q: np.ndarray, k: np.ndarray, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """q -> l2norm(q) * dk^-0.5, k -> l2norm(k).

    bf16 mode as MLX ``normalize_qk``: ``n = bf16(x * rsqrt(mean(x^2) + eps/dk))`` (= sqrt(dk) l2norm(x)),
    then q = bf16(n * bf16(1/dk)), k = bf16(n * bf16(dk^-0.5)): MLX multiplies a bf16 array by a Python
    float, which is first cast to bf16 (dk^-0.5 is not a power of two, e.g. 128^-0.5 -> 0.08837890625).
    """
    dk = q.shape[-1]
    if not bf16:
        return l2norm(q) * F32(dk ** -0.5), l2norm(k)

    def n(x):
        return to_bf16(x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(L2NORM_EPS / dk))))
    return to_bf16(n(q) * to_bf16(1.0 / dk)), to_bf16(n(k) * to_bf16(dk ** -0.5))


def gated_deltanet(x: np.ndarray, p: dict, config: ModelConfig, conv_state: np.ndarray, ssm_state: np.ndarray,
                   *, gdn_mode: str = "chunked", chunk_size: int = 64,
                   bf16: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gated DeltaNet layer over ``x`` [L, H]. ``p`` holds the ``linear_attn.*`` tensors by short name.

    Returns ``(out [L, H], new_conv_state [K-1, conv_dim], new_ssm_state [nv, dv, dk])``; the inputs are
    not modified. L == 1 always uses the recurrence; otherwise ``gdn_mode`` picks "chunked" or "recurrent".
    """
    r = _rounder(bf16)
    L = x.shape[0]
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    key_dim = config.key_dim

    qkv = _linear(x, p["in_proj_qkv"], bf16)                           # [L, conv_dim]: q | k | v
    z = _linear(x, p["in_proj_z"], bf16).reshape(L, nv, dv)
    b = _linear(x, p["in_proj_b"], bf16)                               # [L, nv]
    a = _linear(x, p["in_proj_a"], bf16)                               # [L, nv]

    conv_out, new_conv_state = causal_conv1d(qkv, conv_state, p["conv1d"])
    act = silu(r(conv_out), bf16)
    q = act[:, :key_dim].reshape(L, nk, dk)
    k = act[:, key_dim:2 * key_dim].reshape(L, nk, dk)
    v = act[:, 2 * key_dim:].reshape(L, nv, dv)
    q, k = _normalize_qk(q, k, bf16)

    beta = r(sigmoid(b))
    g_log = -np.exp(_f32(p["A_log"])) * softplus(a + p["dt_bias"])  # [L, nv], float32, <= 0

    if L == 1 or gdn_mode == "recurrent":
        o, new_ssm = gdn_recurrent(q, k, v, beta, g_log, ssm_state)
    else:
        assert gdn_mode == "chunked", gdn_mode
        o, new_ssm = gdn_chunked(q, k, v, beta, g_log, ssm_state, chunk_size)
    o = r(o)

    y = gated_rms_norm(o, z, p["norm"], config.rms_norm_eps, bf16=bf16)   # per head
    return _linear(y.reshape(L, nv * dv), p["out_proj"], bf16), new_conv_state, new_ssm


# ---------------------------------------------------------------------------------------------
# MLPs (docs/model.md §4.5)
# ---------------------------------------------------------------------------------------------
def swiglu(gate: np.ndarray, up: np.ndarray, *, bf16: bool = False) -> np.ndarray:
    """silu(gate) * up (bf16 mode: silu as MLX, product rounded)."""
    return _rounder(bf16)(silu(gate, bf16) * up)


def dense_mlp(x: np.ndarray, p: dict, *, bf16: bool = False) -> np.ndarray:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; ``p`` has gate_proj, up_proj, down_proj."""
    h = swiglu(_linear(x, p["gate_proj"], bf16), _linear(x, p["up_proj"], bf16), bf16=bf16)
    return _linear(h, p["down_proj"], bf16)


def sparse_moe(x: np.ndarray, p: dict, config: ModelConfig, *, bf16: bool = False) -> np.ndarray:
    """Routed experts + optional gated shared expert over ``x`` [L, H].

    ``p`` keys: ``gate`` [E, H]; ``switch_mlp.{gate,up,down}_proj`` [E, ...]; optionally
    ``shared_expert.{gate,up,down}_proj`` and ``shared_expert_gate`` [1, H].
    Router: softmax (float32) over all experts, top-k selection on the float32 probabilities (ties go to
    the lower expert index), renormalised iff ``config.norm_topk_prob``.
    """
    r = _rounder(bf16)
    L = x.shape[0]
    topk = config.num_experts_per_tok

    logits = _linear(x, p["gate"], bf16)                               # [L, E]
    probs = softmax(logits)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :topk]         # [L, k]
    scores = r(np.take_along_axis(probs, idx, axis=-1))
    if config.norm_topk_prob:
        scores = r(scores / r(np.sum(scores, axis=-1, keepdims=True)))

    # run each expert once on the tokens routed to it
    wg, wu, wd = p["switch_mlp.gate_proj"], p["switch_mlp.up_proj"], p["switch_mlp.down_proj"]
    weighted = np.zeros((L, topk, x.shape[1]), dtype=F32)              # score * expert output
    flat = idx.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], flat.size)
    for e, s0, s1 in zip(experts, starts, ends):
        pairs = order[s0:s1]
        tok, slot = pairs // topk, pairs % topk
        xe = x[tok]
        h = swiglu(_linear(xe, wg[e], bf16), _linear(xe, wu[e], bf16), bf16=bf16)
        ye = _linear(h, wd[e], bf16)
        weighted[tok, slot] = r(ye * scores[tok, slot][:, None])
    y = r(np.sum(weighted, axis=1))

    if config.shared_expert_intermediate_size > 0:
        sh = dense_mlp(x, {n: p["shared_expert." + n] for n in ("gate_proj", "up_proj", "down_proj")}, bf16=bf16)
        sg = r(sigmoid(_linear(x, p["shared_expert_gate"], bf16)))     # [L, 1]
        y = r(y + r(sg * sh))
    return y


# ---------------------------------------------------------------------------------------------
# state, decoder layer, model
# ---------------------------------------------------------------------------------------------
class ReferenceState:
    """Decode state of one sequence.

    ``position``: tokens consumed so far (the index of the next token).
    ``rope_delta``: the next token's RoPE position minus its index (M-RoPE: nonzero after an image).
    ``keys[i]``/``values[i]``: full-attention layer i's caches, float32 [nkv, position, hd] (post-RoPE keys).
    ``conv[i]``: GDN layer i's last K-1 pre-conv QKV rows [K-1, conv_dim], oldest first, float32.
    ``ssm[i]``: GDN layer i's recurrent state [nv, dv, dk], float32.
    """

    def __init__(self, position: int = 0, keys: dict | None = None, values: dict | None = None,
                 conv: dict | None = None, ssm: dict | None = None, rope_delta: int = 0):
        self.position = int(position)
        self.rope_delta = int(rope_delta)
        self.keys = dict(keys or {})
        self.values = dict(values or {})
        self.conv = dict(conv or {})
        self.ssm = dict(ssm or {})

    def copy(self) -> "ReferenceState":
        """A deep, independent copy."""
        cp = lambda d: {i: a.copy() for i, a in d.items()}  # noqa: E731
        return ReferenceState(self.position, cp(self.keys), cp(self.values), cp(self.conv), cp(self.ssm),
                              self.rope_delta)

    def arrays(self):
        for d in (self.keys, self.values, self.conv, self.ssm):
            yield from d.values()

    def to_arrays(self) -> dict:
        """The backend-independent layout of ``Session.save`` (docs/architecture.md): ``layers.{i}.key`` /
        ``.value`` [nkv, T, hd], ``layers.{i}.conv`` [K-1, conv_dim], ``layers.{i}.ssm`` [nv, dv, dk]
        float32, ``position`` int64 [1]. Arrays are copies."""
        out = {"position": np.array([self.position], dtype=np.int64)}
        for name, d in (("key", self.keys), ("value", self.values), ("conv", self.conv), ("ssm", self.ssm)):
            for i, a in d.items():
                out[f"layers.{i}.{name}"] = np.array(a, dtype=F32, copy=True)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict) -> "ReferenceState":
        """Inverse of :meth:`to_arrays` (float32 or bfloat16 input; kept as float32)."""
        st = cls(int(np.asarray(arrays["position"]).reshape(-1)[0]))
        slots = {"key": st.keys, "value": st.values, "conv": st.conv, "ssm": st.ssm}
        for k, a in arrays.items():
            if k == "position":
                continue
            _, i, name = k.split(".")
            slots[name][int(i)] = np.ascontiguousarray(np.asarray(a).astype(F32))
        return st

    @property
    def nbytes(self) -> int:
        """Bytes of all state arrays as stored."""
        return int(sum(a.nbytes for a in self.arrays()))

    def __repr__(self) -> str:
        return (f"ReferenceState(position={self.position}, {len(self.keys)} KV layers, "
                f"{len(self.ssm)} GDN layers, {self.nbytes} bytes)")


def decoder_layer(x: np.ndarray, lp: dict, config: ModelConfig, i: int, state: ReferenceState, *,
                  gdn_mode: str = "chunked", chunk_size: int = 64, bf16: bool = False,
                  rope_pos: np.ndarray | None = None) -> tuple[np.ndarray, tuple]:
    """One decoder layer (docs/model.md §4.1). ``lp`` is the layer's parameter dict (names without ``layers.{i}.``).

    Returns ``(out [L, H], new_layer_state)`` where the state is ``(K, V)`` for attention layers and
    ``(conv, ssm)`` for GDN layers; ``state`` is only read.
    """
    r = _rounder(bf16)
    eps = config.rms_norm_eps
    h_in = rms_norm(x, lp["input_layernorm"], eps, bf16=bf16)
    if config.is_full_attention(i):
        mix, *new = full_attention(h_in, _sub(lp, "self_attn."), config, state.keys[i], state.values[i],
                                   state.position, bf16=bf16, rope_pos=rope_pos)
    else:
        mix, *new = gated_deltanet(h_in, _sub(lp, "linear_attn."), config, state.conv[i], state.ssm[i],
                                   gdn_mode=gdn_mode, chunk_size=chunk_size, bf16=bf16)
    h = r(x + mix)
    m_in = rms_norm(h, lp["post_attention_layernorm"], eps, bf16=bf16)
    if config.is_moe_layer(i):
        m = sparse_moe(m_in, _sub(lp, "mlp."), config, bf16=bf16)
    else:
        m = dense_mlp(m_in, _sub(lp, "mlp."), bf16=bf16)
    return r(h + m), tuple(new)


def _sub(params: dict, prefix: str) -> dict:
    """The entries of ``params`` under ``prefix``, with the prefix removed."""
    n = len(prefix)
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix)}


class ReferenceModel:
    """Reference forward pass over dense float32 parameters (canonical names, see the module docstring).

    ``dtype``: "float32" (no rounding) or "bfloat16" (MLX-like bf16 rounding points).
    """

    def __init__(self, config: ModelConfig, params: dict, dtype: str = "float32"):
        assert dtype in ("float32", "bfloat16"), dtype
        self.config = config
        self.dtype = dtype
        self.bf16 = dtype == "bfloat16"
        self.params = {k: np.ascontiguousarray(v, dtype=F32) for k, v in params.items()}
        self.embed_tokens = self.params["embed_tokens"]
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else self.params["lm_head"]
        self.norm = self.params["norm"]
        self.layers = [_sub(self.params, f"layers.{i}.") for i in range(config.num_hidden_layers)]

    def new_state(self) -> ReferenceState:
        c = self.config
        st = ReferenceState()
        for i in c.full_attention_layers:
            st.keys[i] = np.zeros((c.num_key_value_heads, 0, c.head_dim), dtype=F32)
            st.values[i] = np.zeros((c.num_key_value_heads, 0, c.head_dim), dtype=F32)
        for i in c.linear_attention_layers:
            st.conv[i] = np.zeros((c.linear_conv_kernel_dim - 1, c.conv_dim), dtype=F32)
            st.ssm[i] = np.zeros((c.linear_num_value_heads, c.linear_value_head_dim, c.linear_key_head_dim),
                                 dtype=F32)
        return st

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        return _rounder(self.bf16)(self.embed_tokens[np.asarray(token_ids)])

    def forward(self, state: ReferenceState, token_ids: np.ndarray, logits: str = "last",
                gdn_mode: str = "chunked", chunk_size: int = 64, hidden: list | None = None,
                final_hidden: list | None = None, feature_layers: Sequence[int] = (),
                features: list | None = None, rope_pos: np.ndarray | None = None,
                embed_rows: np.ndarray | None = None, embeds: np.ndarray | None = None,
                rope_delta: int | None = None):
        """Run ``token_ids`` (1-D ints) at positions ``state.position..``; update ``state`` in place.

        RoPE positions: ``rope_pos`` [L, rotary_dim/2] per frequency pair (`qwenmetal.mrope.pair_positions`),
        else row i at ``state.position + i + state.rope_delta``; ``rope_delta`` (if given) is the state's
        delta after the call. ``embeds`` [m, H] replace the embedding lookup of the rows ``embed_rows`` [m]
        (image features at the image pads; rounded to bf16 in bf16 mode, as every embedding row).

        Returns float32 logits [vocab] (``logits="last"``), [L, vocab] (``"all"``) or None (``"none"``).
        If ``hidden`` is a list, the embedding output and each decoder layer's output [L, H] are appended
        (``hidden[-1]``: the last layer's output before the final norm). If ``final_hidden`` is a list, the
        final norm's output [L, H] of every token -- what the lm_head multiplies, and the hidden state the
        MTP head takes (`ReferenceMtp`) -- is appended. If ``features`` is a list, the outputs of the decoder
        layers ``feature_layers`` (0-based, in that order) are concatenated along the hidden axis and appended
        ([L, len(feature_layers) * H]): a DFlash draft's context features (`qwenmetal.dflash`), taken in the
        same pass.
        """
        ids = np.asarray(token_ids)
        assert ids.ndim == 1 and ids.size >= 1, ids.shape
        assert logits in ("last", "all", "none"), logits
        assert gdn_mode in ("chunked", "recurrent"), gdn_mode
        c, bf16 = self.config, self.bf16

        want = {int(i): None for i in feature_layers} if features is not None else {}
        bad = [i for i in want if not 0 <= i < c.num_hidden_layers]
        if bad:
            raise ValueError(f"feature_layers {list(feature_layers)}: the model has layers 0..{c.num_hidden_layers - 1}")
        x = self.embed(ids)
        if embed_rows is not None and len(embed_rows):
            x = x.copy()
            x[np.asarray(embed_rows)] = _rounder(bf16)(embeds)
        if rope_pos is None and state.rope_delta:
            rope_pos = state.position + state.rope_delta + np.arange(ids.size)
        if hidden is not None:
            hidden.append(x)
        new_states = {}
        for i, lp in enumerate(self.layers):
            x, new_states[i] = decoder_layer(x, lp, c, i, state, gdn_mode=gdn_mode, chunk_size=chunk_size,
                                             bf16=bf16, rope_pos=rope_pos)
            if hidden is not None:
                hidden.append(x)
            if i in want:
                want[i] = x
        if features is not None:
            features.append(np.concatenate([want[int(i)] for i in feature_layers], axis=-1)
                            if want else np.zeros((ids.size, 0), dtype=F32))

        out = None
        if final_hidden is not None:
            xn_all = rms_norm(x, self.norm, c.rms_norm_eps, bf16=bf16)      # row-wise: the same rows as below
            final_hidden.append(xn_all)
        if logits != "none":
            if final_hidden is not None:
                xn = xn_all[-1:] if logits == "last" else xn_all
            else:
                xs = x[-1:] if logits == "last" else x
                xn = rms_norm(xs, self.norm, c.rms_norm_eps, bf16=bf16)
            out = _linear(xn, self.lm_head, bf16)
            out = out[0] if logits == "last" else out

        # commit the new state
        for i, st in new_states.items():
            if c.is_full_attention(i):
                state.keys[i], state.values[i] = st
            else:
                state.conv[i], state.ssm[i] = st
        state.position += ids.size
        if rope_delta is not None:
            state.rope_delta = int(rope_delta)
        return out


# ---------------------------------------------------------------------------------------------
# the multi-token-prediction head (docs/model.md §9)
# ---------------------------------------------------------------------------------------------
class ReferenceMtp:
    """The MTP head's forward pass (docs/model.md §9; vLLM ``Qwen3NextMultiTokenPredictor.forward``, mlx-vlm
    ``Qwen3_5MTPDraftModel._forward_hidden``) over dense float32 parameters named as ``Weights.mtp``
    (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` (all shifted), ``layers.0.*``),
    sharing the main model's embedding and lm_head. For each (hidden h_p, token t_{p+1}) pair::

        x = fc(concat(rms_norm(embed(t_{p+1}), pre_fc_norm_embedding), rms_norm(h_p, pre_fc_norm_hidden)))
        x = decoder_layer_0(x)                      # full attention + MoE, its own KV cache, RoPE position p
        out_hidden = rms_norm(x, norm)              # what the next MTP step takes as its hidden state
        logits = out_hidden @ lm_head^T             # predicts t_{p+2}

    Position convention: the pair (h_p, t_{p+1}) is run at RoPE position p, the position of the hidden
    state, not p + 1. vLLM's ``EagleProposer.propose`` (vllm/v1/spec_decode/eagle.py, commit 008603a3)
    shifts the input ids left by one ("Shift the input ids by one token") but passes the target model's
    own ``target_positions`` with the target hidden states, then ``positions += 1`` per further draft;
    mlx-vlm's ``prefill_from_target_hidden`` (qwen3_5_mtp.py) likewise runs ``input_ids[1:] + bonus``
    against ``hidden[:, :n]`` from ``_next_position = 0``. The MTP KV cache therefore holds entry p at
    RoPE position p. ``h_p`` is the main model's *final-normed* hidden state (vLLM's
    ``Qwen3NextModel.forward`` returns ``norm(hidden_states, residual)`` and the proposer feeds that;
    mlx-vlm's ``return_hidden`` appends the inner model's normed output), see
    ``ReferenceModel.forward(final_hidden=...)``. The chained hidden state is the head's normed output.
    """

    def __init__(self, config: ModelConfig, params: dict, embed_tokens: np.ndarray, lm_head: np.ndarray,
                 dtype: str = "float32"):
        assert dtype in ("float32", "bfloat16"), dtype
        self.config = config
        self.layer_config = mtp_layer_config(config)
        self.bf16 = dtype == "bfloat16"
        self.params = {k: np.ascontiguousarray(v, dtype=F32) for k, v in params.items()}
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        layers = sorted({k.split(".")[1] for k in self.params if k.startswith("layers.")})
        if layers != ["0"]:
            raise ValueError(f"the MTP head must have exactly one decoder layer (layers.0.*), got {layers}")
        self.layer = _sub(self.params, "layers.0.")

    @classmethod
    def from_model(cls, model: "ReferenceModel", params: dict) -> "ReferenceMtp":
        """The head of `params` on `model`'s embedding and lm_head, in `model`'s precision mode."""
        return cls(model.config, params, model.embed_tokens, model.lm_head, model.dtype)

    def new_state(self) -> ReferenceState:
        """An empty MTP cache: ``keys[0]``/``values[0]`` [nkv, 0, hd], position 0."""
        c = self.config
        st = ReferenceState()
        st.keys[0] = np.zeros((c.num_key_value_heads, 0, c.head_dim), dtype=F32)
        st.values[0] = np.zeros((c.num_key_value_heads, 0, c.head_dim), dtype=F32)
        return st

    def forward(self, state: ReferenceState, hidden: np.ndarray, token_ids: np.ndarray, logits: str = "all",
                out_hidden: list | None = None):
        """Run the pairs (``hidden[j]``, ``token_ids[j]``) -- ``hidden`` [L, H] the main model's final-normed
        hidden state at positions ``state.position + j``, ``token_ids`` the tokens that follow each -- at
        RoPE positions ``state.position..``; update ``state`` (its KV cache) in place. Returns float32
        logits [L, vocab] (``"all"``), [vocab] (``"last"``) or None; each returned row predicts the token
        two after its hidden state's position. If ``out_hidden`` is a list, the head's normed output [L, H]
        (the hidden state of the next chained step) is appended."""
        ids = np.asarray(token_ids)
        h = _f32(hidden)
        assert ids.ndim == 1 and ids.size >= 1 and h.shape == (ids.size, self.config.hidden_size), (ids.shape, h.shape)
        assert logits in ("last", "all", "none"), logits
        c, bf16 = self.config, self.bf16
        eps, p = c.rms_norm_eps, self.params
        e = _rounder(bf16)(self.embed_tokens[ids])
        x = np.concatenate([rms_norm(e, p["pre_fc_norm_embedding"], eps, bf16=bf16),
                            rms_norm(h, p["pre_fc_norm_hidden"], eps, bf16=bf16)], axis=-1)   # embedding first
        x = _linear(x, p["fc"], bf16)
        x, (K, V) = decoder_layer(x, self.layer, self.layer_config, 0, state, bf16=bf16)
        xn = rms_norm(x, p["norm"], eps, bf16=bf16)
        if out_hidden is not None:
            out_hidden.append(xn)
        state.keys[0], state.values[0] = K, V
        state.position += ids.size
        if logits == "none":
            return None
        out = _linear(xn[-1:] if logits == "last" else xn, self.lm_head, bf16)
        return out[0] if logits == "last" else out


# ---------------------------------------------------------------------------------------------------
# backend="reference": the numpy forward pass behind the backend contract (docs/architecture.md)
# ---------------------------------------------------------------------------------------------------
class ReferenceBackend:
    """numpy reference (`qwenmetal.backends.reference`): float32 on dequantized weights."""

    name = "reference"
    row_inputs = True            # prefill takes explicit M-RoPE positions and embedding rows (RowInputs)

    def __init__(self, weights: Weights, dtype: str = "float32", gdn_mode: str = "chunked", chunk_size: int = 64):
        need = weights.dense_float32_nbytes()
        total = total_memory()
        if total and need > 0.75 * total:
            raise MemoryError(
                f"the reference backend dequantizes every weight to float32: {need / 2**30:.1f} GiB, more than "
                f"this machine can hold ({total / 2**30:.1f} GiB). It is meant for small checkpoints.")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        if gdn_mode not in ("chunked", "recurrent"):
            raise ValueError(f"gdn_mode must be 'chunked' or 'recurrent', got {gdn_mode!r}")
        self.impl = ReferenceModel(weights.config, weights.dense_float32(), dtype=dtype)
        self.dtype, self.gdn_mode, self.chunk_size = dtype, gdn_mode, int(chunk_size)

    @classmethod
    def over(cls, impl: ReferenceModel, gdn_mode: str = "chunked", chunk_size: int = 64) -> "ReferenceBackend":
        """The backend over an existing `ReferenceModel` (its parameters shared, not copied)."""
        be = object.__new__(cls)
        be.impl, be.dtype, be.gdn_mode, be.chunk_size = impl, impl.dtype, gdn_mode, int(chunk_size)
        return be

    def new_state(self) -> ReferenceState:
        """A zeroed state (position 0)."""
        return self.impl.new_state()

    def forward(self, state: ReferenceState, ids: np.ndarray, logits: str, consumed: list | None = None,
                rows: RowInputs | None = None) -> tuple:
        """Run `ids` after `state` and return (state, logits): computed on a copy, then committed to
        `state` together with `consumed` (a session's token list, extended by `ids`) in one step that a
        Ctrl-C cannot split, so an error or interrupt leaves both unchanged. `rows`: explicit RoPE positions
        and embedding rows (`qwenmetal.mrope.RowInputs`, checked by the session layer)."""
        new = state.copy()
        extra = {} if rows is None else dict(rope_pos=rows.pair_pos, embed_rows=rows.embed_rows,
                                            embeds=rows.embeds, rope_delta=rows.rope_delta)
        out = self.impl.forward(new, ids, logits=logits, gdn_mode=self.gdn_mode, chunk_size=self.chunk_size,
                                **extra)
        add = [int(i) for i in ids]
        with sigint_deferred():
            vars(state).update(vars(new))
            if consumed is not None:
                consumed.extend(add)
        return state, out

    def forward_features(self, state: ReferenceState, ids: np.ndarray, logits: str, consumed: list | None,
                         layers) -> tuple:
        """`forward` that also returns the outputs of the decoder layers `layers` for every row, concatenated
        ([n, len(layers) * hidden], float32): a DFlash draft's context features. Returns (logits, features)."""
        new = state.copy()
        feats: list = []
        out = self.impl.forward(new, ids, logits=logits, gdn_mode=self.gdn_mode, chunk_size=self.chunk_size,
                                feature_layers=tuple(layers), features=feats)
        add = [int(i) for i in ids]
        with sigint_deferred():
            vars(state).update(vars(new))
            if consumed is not None:
                consumed.extend(add)
        return out, np.asarray(feats[0], dtype=F32)

    def vision_encoder(self, weights: "Weights") -> VisionTower:
        """The numpy vision tower over `weights.vision` (`ModelBase.vision_encoder`): ``encode(pixel_values,
        grid_thw) -> [n_merged, out_hidden_size]`` float32. InputError when the checkpoint has no tower."""
        return VisionTower(weights.vision, weights.config.vision)

    def state_to_arrays(self, state: ReferenceState) -> dict:
        """The backend-independent state layout of Session.save (see docs/architecture.md)."""
        return state.to_arrays()

    def state_from_arrays(self, arrays: dict) -> ReferenceState:
        """The inverse of `state_to_arrays`."""
        return ReferenceState.from_arrays(arrays)
