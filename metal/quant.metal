// Matrix-vector products with quantized or dense weights (the decode-time projections and the
// lm_head), and the embedding gather.
//
// Weight formats (metal/quant_dot.h): MLX affine 4- and 8-bit (uint32 words, lowest bits first; one
// scale and one bias per group of group_size inputs of a row, w = scale * q + bias, scales/biases
// bfloat or float: a template argument of their own, independent of the activation type), MLX affine
// at 2, 3, 5, 6 bits as one format of run-time width (WFMT_QN, `qn`: QmvParams.bits), or dense
// bfloat / half / float. Activations T: float (exact tests) or bfloat (production). Accumulation is
// float throughout; the output is rounded once on store.
//
//   qmv_<w>_<T>            y[b, :N] = W x[b, :K]                 for b < batch (the decode kernel: batch 1)
//   qmv_<w>_bf16_f32out    the same with float output (logits: the lm_head, the router)
//   qmv_b<MB>_<w>_<T>[_f32out]  the same for MB = 4, 8, 16 vectors per threadgroup (skinny prefill rows):
//                          each weight read once for all of them
//   embed_<w>_<T>          y[i, :K] = row ids[i] of W, dequantized to T
// <w> = q4_sbf16, q4_sf32, q8_sbf16, q8_sf32, qn_sbf16, qn_sf32, bf16, f16, f32 (gpu::Matrix::variant());
// qn has only the decode kernel and b16 (below).
//
// Buffers: params first, then the weight (w, scales, biases; a dense weight binds w in the scales
// and biases slots, unused), then inputs, then outputs.
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "quant.h"
#include "quant_dot.h"
#include "gdn_conv.h"

// qmv. Why one kernel per format and not dequantize + GEMV: decode is bound by weight bytes, so each
// weight is read once, straight from its packed form, and multiplied in registers.
//
// Thread mapping (MLX's qmv_fast): a threadgroup is QMV_SIMDGROUPS = 2 SIMD-groups of 32 lanes; each
// SIMD-group computes QMV_ROWS = 4 consecutive output rows, so a threadgroup covers 8 rows and the
// grid is (ceil(N / 8), ceil(batch / MB), 1) x (32, 2, 1). Per step a lane loads one 8-byte word pair
// of each of its 4 rows (16 weights at 4 bits, 8 at 8 bits; dense: two 4-vectors, 8 weights), so the
// 32 lanes read 256 contiguous bytes of a row per step (dense bf16: 512), and its slice of x once for
// all 4 rows. Per group the product is factored, sum(w x) = scale sum(q x) + bias sum(x), sum(x)
// shared by the rows; at 4 bits nibbles are masked, never shifted (x pre-scaled). One simd_sum per
// row at the end; lane 0 stores. Rows past N re-read row N - 1 and are not stored; a SIMD-group whose
// first row is past N returns as a whole (SIMD-group-uniform; no barriers in this kernel).
//
// MB > 1 (skinny: prefill chunks of <= 16 rows, as weight-bound as decode): threadgroup row y takes
// vectors y * MB .. y * MB + nb - 1 (nb = MB except in the last row) and every SIMD-group keeps
// 4 x MB accumulators: the loaded word pairs serve each vector in turn, so a weight is read once for
// up to MB vectors. Vectors past nb are skipped (a SIMD-group-uniform loop bound), so one variant
// serves every count up to MB; 16 is the largest (64 accumulators per lane; docs/metal.md, "Several
// vectors at once").
//
// Fusions (p.flags, uniform over the dispatch; per vector). QMV_NORM: the input is rmsnorm(x) * g --
// every SIMD-group computes the statistics of each of its vectors itself (K more reads from cache)
// and scales the inputs as it loads them, so the RMSNorm before a projection costs no dispatch and
// no dependency level (the next layer's input norm, the post-attention norm before the router, the
// final norm before the lm_head). QMV_NORM_OUT: SIMD-group 0 of threadgroup (0, y) also stores the
// normalised inputs of its vectors to xn (read by the MoE kernels of the next level). QMV_ADD:
// y = r + W x, the residual add of an output projection (r may be y: in place, each row read and
// written by the same lane). QMV_ROUND: a float output holds the product rounded to T (the bfloat
// build's router logits, as the bf16 graph has them). QMV_CONV (batch 1, the Gated DeltaNet's decode
// in-projection, whose first conv_c rows are the q|k|v channels): lane 0, which stores row c < conv_c, also
// runs the channel's causal conv over the conv state (K - 1 float rows of conv_c channels) and the stored
// value, its SiLU into act[c], and
// writes the shifted state to conv_out (may be conv_state: each channel is read and written by one lane).
// The conv is per channel, so it needs nothing but the row this lane has just reduced: the gdn_conv
// dispatch and its dependency level disappear from every GDN layer of the decode step.
template <int FMT, typename S, typename T, typename O, uint MB>
[[kernel, max_total_threads_per_threadgroup(QMV_LANES * QMV_SIMDGROUPS)]]
void qmv(constant QmvParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
         device const S* scales [[buffer(2)]], device const S* biases [[buffer(3)]],
         device const T* x [[buffer(4)]], device const T* g [[buffer(5)]], device const O* r [[buffer(6)]],
         device O* y [[buffer(7)]], device T* xn [[buffer(8)]], device const float* conv_w [[buffer(9)]],
         device const float* conv_state [[buffer(10)]], device float* conv_out [[buffer(11)]],
         device T* act [[buffer(12)]], uint3 tgid [[threadgroup_position_in_grid]],
         uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename WDot<FMT, S, T>::wvec WV;
    const uint row0 = (tgid.x * QMV_SIMDGROUPS + sg) * QMV_ROWS;
    // this threadgroup's input vectors: b0 .. b0 + nb - 1 (the last chunk may hold fewer than MB)
    const uint b0 = tgid.y * MB, nb = min(MB, p.batch - b0);
    const bool norm = (p.flags & QMV_NORM) != 0u;
    device const T* xb = x + ulong(b0) * p.x_stride;
    float inv[MB];
    device const T* xv = xb;   // vector b's row, stepped by a pointer add (no 64-bit multiply per vector)
    for (uint b = 0; b < MB; ++b) {
        inv[b] = norm && b < nb ? rms_inv<T>(xv, p.K, p.eps, lane) : 1.0f;
        xv += p.x_stride;
    }
    // (loops over b run to the constant MB with the live count a branch inside: fully unrollable, so
    // inv[] and out[] keep constant indices, in registers)
    if ((p.flags & QMV_NORM_OUT) != 0u && tgid.x == 0u && sg == 0u) {
        device const T* xr = xb;
        device T* xnr = xn + ulong(b0) * p.x_stride;
        for (uint b = 0; b < MB; ++b) {
            if (b < nb) {
                for (uint k = lane; k < p.K; k += SIMD_WIDTH) {
                    xnr[k] = T(rnd<T>(float(xr[k]) * inv[b]) * float(g[k]));
                }
            }
            xr += p.x_stride;
            xnr += p.x_stride;
        }
    }
    if (row0 >= p.N) {
        return;
    }
    device const WV* wv = (device const WV*)w;
    device const vec<T, 4>* x4 = (device const vec<T, 4>*)xb;
    device const vec<T, 4>* g4 = (device const vec<T, 4>*)g;
    float out[MB * QMV_ROWS];
    rows_dot_norm<FMT, S, T, MB>(wv, scales, biases, x4, p.x_stride / 4u, g4, inv, norm, p.K, p.group_size, p.bits,
                                 row0, p.N, nb, lane, out);
    const bool add = (p.flags & QMV_ADD) != 0u, round = (p.flags & QMV_ROUND) != 0u;
    if (lane == 0) {
        device O* yb = y + ulong(b0) * p.y_stride;
        device const O* rb = r + ulong(b0) * p.y_stride;
        for (uint b = 0; b < MB; ++b) {
            if (b < nb) {
                for (uint i = 0; i < QMV_ROWS && row0 + i < p.N; ++i) {
                    // the product is rounded to T before a residual add (the bf16 graph adds two bf16 values)
                    const float v = add || round ? rnd<T>(out[b * QMV_ROWS + i]) : out[b * QMV_ROWS + i];
                    yb[row0 + i] = O(add ? v + float(rb[row0 + i]) : v);
                }
            }
            yb += p.y_stride;
            rb += p.y_stride;
        }
        if (MB == 1u && (p.flags & QMV_CONV) != 0u) {
            const uint srows = p.conv_k - 1u;   // the state's rows
            for (uint i = 0; i < QMV_ROWS && row0 + i < p.conv_c; ++i) {
                const uint c = row0 + i;
                // the window as gdn_conv reads it: state rows 0 .. K-2 (oldest first), then this token's
                // value as stored (T), taps in order
                const float xc = float(T(out[i]));
                device const float* wc = conv_w + c * p.conv_k;
                float acc = 0.0f;
                for (uint j = 0; j < srows; ++j) {
                    acc += conv_state[j * p.conv_c + c] * wc[j];
                }
                acc += xc * wc[srows];
                act[c] = gdn_conv_silu<T>(acc);
                for (uint j = 0; j + 1u < srows; ++j) {
                    conv_out[j * p.conv_c + c] = conv_state[(j + 1u) * p.conv_c + c];
                }
                conv_out[(srows - 1u) * p.conv_c + c] = xc;
            }
        }
    }
}

// embed: the token embedding gather (the decode token id stays on the device). One threadgroup per
// id (grid (n, 1, 1)); each thread dequantizes VALS consecutive values of the row per step (one word
// pair at 4/8 bits, two 4-vectors dense) and walks the row in steps of threads * VALS. An id past the
// table's rows yields a zero row (no out-of-bounds read; the host cannot check device-side ids).
template <int FMT, typename S, typename T>
kernel void embed(constant EmbedParams& p [[buffer(0)]], device const uint32_t* w [[buffer(1)]],
                  device const S* scales [[buffer(2)]], device const S* biases [[buffer(3)]],
                  device const uint* ids [[buffer(4)]], device T* y [[buffer(5)]],
                  uint i [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                  uint nthreads [[threads_per_threadgroup]]) {
    typedef WDot<FMT, S, T> D;
    typedef typename D::wvec WV;
    const uint id = ids[i];
    device T* yr = y + ulong(i) * p.K;
    if (id >= p.rows) {
        for (uint k = tid; k < p.K; k += nthreads) {
            yr[k] = T(0.0f);
        }
        return;
    }
    device const WV* wr = (device const WV*)w + ulong(id) * D::units_per_row(p.K, p.bits);
    const ulong so = ulong(id) * D::scales_per_row(p.K, p.group_size);
    for (uint k = tid * D::VALS; k < p.K; k += nthreads * D::VALS) {
        float v[D::VALS];
        D::dequant(wr, scales + so, biases + so, k, p.group_size, p.bits, v);
        for (uint j = 0; j < D::VALS; ++j) {
            yr[k + j] = T(v[j]);
        }
    }
}

// ---- instantiations: only what the decode graph uses (written out: the embedded-source table
// reads the host names literally) ----------------------------------------------------------------
// quantized weights x {bf16, f32} scales x {f32, bf16 activations, bf16 activations with float output}
INSTANTIATE_KERNEL("qmv_q4_sbf16_f32", qmv, WFMT_Q4, bfloat, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sbf16_f32", qmv, WFMT_Q4, bfloat, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sbf16_f32", qmv, WFMT_Q4, bfloat, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sbf16_f32", qmv, WFMT_Q4, bfloat, float, float, 16u)
INSTANTIATE_KERNEL("qmv_q4_sbf16_bf16", qmv, WFMT_Q4, bfloat, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sbf16_bf16", qmv, WFMT_Q4, bfloat, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sbf16_bf16", qmv, WFMT_Q4, bfloat, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sbf16_bf16", qmv, WFMT_Q4, bfloat, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_q4_sbf16_bf16_f32out", qmv, WFMT_Q4, bfloat, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sbf16_bf16_f32out", qmv, WFMT_Q4, bfloat, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sbf16_bf16_f32out", qmv, WFMT_Q4, bfloat, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sbf16_bf16_f32out", qmv, WFMT_Q4, bfloat, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_q4_sbf16_f32", embed, WFMT_Q4, bfloat, float)
INSTANTIATE_KERNEL("embed_q4_sbf16_bf16", embed, WFMT_Q4, bfloat, bfloat)
INSTANTIATE_KERNEL("qmv_q4_sf32_f32", qmv, WFMT_Q4, float, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sf32_f32", qmv, WFMT_Q4, float, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sf32_f32", qmv, WFMT_Q4, float, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sf32_f32", qmv, WFMT_Q4, float, float, float, 16u)
INSTANTIATE_KERNEL("qmv_q4_sf32_bf16", qmv, WFMT_Q4, float, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sf32_bf16", qmv, WFMT_Q4, float, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sf32_bf16", qmv, WFMT_Q4, float, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sf32_bf16", qmv, WFMT_Q4, float, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_q4_sf32_bf16_f32out", qmv, WFMT_Q4, float, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q4_sf32_bf16_f32out", qmv, WFMT_Q4, float, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q4_sf32_bf16_f32out", qmv, WFMT_Q4, float, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q4_sf32_bf16_f32out", qmv, WFMT_Q4, float, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_q4_sf32_f32", embed, WFMT_Q4, float, float)
INSTANTIATE_KERNEL("embed_q4_sf32_bf16", embed, WFMT_Q4, float, bfloat)
INSTANTIATE_KERNEL("qmv_q8_sbf16_f32", qmv, WFMT_Q8, bfloat, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sbf16_f32", qmv, WFMT_Q8, bfloat, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sbf16_f32", qmv, WFMT_Q8, bfloat, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sbf16_f32", qmv, WFMT_Q8, bfloat, float, float, 16u)
INSTANTIATE_KERNEL("qmv_q8_sbf16_bf16", qmv, WFMT_Q8, bfloat, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sbf16_bf16", qmv, WFMT_Q8, bfloat, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sbf16_bf16", qmv, WFMT_Q8, bfloat, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sbf16_bf16", qmv, WFMT_Q8, bfloat, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_q8_sbf16_bf16_f32out", qmv, WFMT_Q8, bfloat, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sbf16_bf16_f32out", qmv, WFMT_Q8, bfloat, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sbf16_bf16_f32out", qmv, WFMT_Q8, bfloat, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sbf16_bf16_f32out", qmv, WFMT_Q8, bfloat, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_q8_sbf16_f32", embed, WFMT_Q8, bfloat, float)
INSTANTIATE_KERNEL("embed_q8_sbf16_bf16", embed, WFMT_Q8, bfloat, bfloat)
INSTANTIATE_KERNEL("qmv_q8_sf32_f32", qmv, WFMT_Q8, float, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sf32_f32", qmv, WFMT_Q8, float, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sf32_f32", qmv, WFMT_Q8, float, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sf32_f32", qmv, WFMT_Q8, float, float, float, 16u)
INSTANTIATE_KERNEL("qmv_q8_sf32_bf16", qmv, WFMT_Q8, float, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sf32_bf16", qmv, WFMT_Q8, float, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sf32_bf16", qmv, WFMT_Q8, float, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sf32_bf16", qmv, WFMT_Q8, float, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_q8_sf32_bf16_f32out", qmv, WFMT_Q8, float, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_q8_sf32_bf16_f32out", qmv, WFMT_Q8, float, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_q8_sf32_bf16_f32out", qmv, WFMT_Q8, float, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_q8_sf32_bf16_f32out", qmv, WFMT_Q8, float, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_q8_sf32_f32", embed, WFMT_Q8, float, float)
INSTANTIATE_KERNEL("embed_q8_sf32_bf16", embed, WFMT_Q8, float, bfloat)
// the run-time width (2, 3, 5, 6 bits): the decode kernel and b16 only -- a skinny batch of 2..16 takes
// b16 (the vectors past the batch are skipped, at b16's registers), which saves 12 instantiations of a
// format that is rare in a checkpoint; embed for the tables of a whole-model low-bit conversion
INSTANTIATE_KERNEL("qmv_qn_sbf16_f32", qmv, WFMT_QN, bfloat, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sbf16_f32", qmv, WFMT_QN, bfloat, float, float, 16u)
INSTANTIATE_KERNEL("qmv_qn_sbf16_bf16", qmv, WFMT_QN, bfloat, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sbf16_bf16", qmv, WFMT_QN, bfloat, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_qn_sbf16_bf16_f32out", qmv, WFMT_QN, bfloat, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sbf16_bf16_f32out", qmv, WFMT_QN, bfloat, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_qn_sbf16_f32", embed, WFMT_QN, bfloat, float)
INSTANTIATE_KERNEL("embed_qn_sbf16_bf16", embed, WFMT_QN, bfloat, bfloat)
INSTANTIATE_KERNEL("qmv_qn_sf32_f32", qmv, WFMT_QN, float, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sf32_f32", qmv, WFMT_QN, float, float, float, 16u)
INSTANTIATE_KERNEL("qmv_qn_sf32_bf16", qmv, WFMT_QN, float, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sf32_bf16", qmv, WFMT_QN, float, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_qn_sf32_bf16_f32out", qmv, WFMT_QN, float, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b16_qn_sf32_bf16_f32out", qmv, WFMT_QN, float, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_qn_sf32_f32", embed, WFMT_QN, float, float)
INSTANTIATE_KERNEL("embed_qn_sf32_bf16", embed, WFMT_QN, float, bfloat)
// dense weights of type W
INSTANTIATE_KERNEL("qmv_bf16_f32", qmv, WFMT_DENSE, bfloat, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_bf16_f32", qmv, WFMT_DENSE, bfloat, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_bf16_f32", qmv, WFMT_DENSE, bfloat, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_bf16_f32", qmv, WFMT_DENSE, bfloat, float, float, 16u)
INSTANTIATE_KERNEL("qmv_bf16_bf16", qmv, WFMT_DENSE, bfloat, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_bf16_bf16", qmv, WFMT_DENSE, bfloat, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_bf16_bf16", qmv, WFMT_DENSE, bfloat, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_bf16_bf16", qmv, WFMT_DENSE, bfloat, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_bf16_bf16_f32out", qmv, WFMT_DENSE, bfloat, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_bf16_bf16_f32out", qmv, WFMT_DENSE, bfloat, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_bf16_bf16_f32out", qmv, WFMT_DENSE, bfloat, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_bf16_bf16_f32out", qmv, WFMT_DENSE, bfloat, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_bf16_f32", embed, WFMT_DENSE, bfloat, float)
INSTANTIATE_KERNEL("embed_bf16_bf16", embed, WFMT_DENSE, bfloat, bfloat)
INSTANTIATE_KERNEL("qmv_f16_f32", qmv, WFMT_DENSE, half, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_f16_f32", qmv, WFMT_DENSE, half, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_f16_f32", qmv, WFMT_DENSE, half, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_f16_f32", qmv, WFMT_DENSE, half, float, float, 16u)
INSTANTIATE_KERNEL("qmv_f16_bf16", qmv, WFMT_DENSE, half, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_f16_bf16", qmv, WFMT_DENSE, half, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_f16_bf16", qmv, WFMT_DENSE, half, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_f16_bf16", qmv, WFMT_DENSE, half, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_f16_bf16_f32out", qmv, WFMT_DENSE, half, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_f16_bf16_f32out", qmv, WFMT_DENSE, half, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_f16_bf16_f32out", qmv, WFMT_DENSE, half, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_f16_bf16_f32out", qmv, WFMT_DENSE, half, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_f16_f32", embed, WFMT_DENSE, half, float)
INSTANTIATE_KERNEL("embed_f16_bf16", embed, WFMT_DENSE, half, bfloat)
INSTANTIATE_KERNEL("qmv_f32_f32", qmv, WFMT_DENSE, float, float, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_f32_f32", qmv, WFMT_DENSE, float, float, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_f32_f32", qmv, WFMT_DENSE, float, float, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_f32_f32", qmv, WFMT_DENSE, float, float, float, 16u)
INSTANTIATE_KERNEL("qmv_f32_bf16", qmv, WFMT_DENSE, float, bfloat, bfloat, 1u)
INSTANTIATE_KERNEL("qmv_b4_f32_bf16", qmv, WFMT_DENSE, float, bfloat, bfloat, 4u)
INSTANTIATE_KERNEL("qmv_b8_f32_bf16", qmv, WFMT_DENSE, float, bfloat, bfloat, 8u)
INSTANTIATE_KERNEL("qmv_b16_f32_bf16", qmv, WFMT_DENSE, float, bfloat, bfloat, 16u)
INSTANTIATE_KERNEL("qmv_f32_bf16_f32out", qmv, WFMT_DENSE, float, bfloat, float, 1u)
INSTANTIATE_KERNEL("qmv_b4_f32_bf16_f32out", qmv, WFMT_DENSE, float, bfloat, float, 4u)
INSTANTIATE_KERNEL("qmv_b8_f32_bf16_f32out", qmv, WFMT_DENSE, float, bfloat, float, 8u)
INSTANTIATE_KERNEL("qmv_b16_f32_bf16_f32out", qmv, WFMT_DENSE, float, bfloat, float, 16u)
INSTANTIATE_KERNEL("embed_f32_f32", embed, WFMT_DENSE, float, float)
INSTANTIATE_KERNEL("embed_f32_bf16", embed, WFMT_DENSE, float, bfloat)
