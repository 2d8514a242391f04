// Row dot products and row dequantization of a weight matrix, per storage format: the inner loops of
// every GEMV-like kernel (metal/quant.metal: qmv, embed; metal/moe.metal: the expert and MLP
// projections). One copy, included by both kernel files, so the MoE kernels run exactly qmv's loop.
//
// Formats (template argument FMT; S the scale/bias type for quantized weights, the element type for
// dense ones; T the activation type):
//   WFMT_Q4, WFMT_Q8  MLX affine: uint32 words of 8 (4-bit) or 4 (8-bit) values, lowest bits first;
//                     per group of `gs` consecutive inputs of a row one scale and one bias (S),
//                     w = scale * q + bias
//   WFMT_QN           MLX affine at a run-time width `bits` (2, 3, 5, 6 -- and 4, 8 when a kernel
//                     pairs matrices of two widths): one LSB-first bit stream per row (value k at bits
//                     [bits k, bits (k + 1)) of the row's words), so at 3, 5, 6 bits a value may straddle
//                     two words; 32 values are `bits` whole words (a unit), per group one scale and bias
//   WFMT_DENSE        S[rows, K] (bfloat, half or float)
//
// Why one run-time-width format and not one compile-time format per width: every format multiplies the
// kernel instantiations of qmv, embed, the MoE kernels and both GEMMs (x scale types x activation
// types x vector counts), and each instantiation costs simulator and ASan build time in CI; the low
// widths are rare in a checkpoint (the routed experts of a 2/3-bit conversion, or a whole small
// model), so they share one instantiation whose width is a params field (`bits`); inside it a uniform
// switch on the width runs a loop compiled for that width (constant word indices and shifts, 32-bit).
//
// Each format is a WDot<FMT, S, T> with
//   wvec               the unit a lane loads per step (uint2 at 4/8 bits, uint words at QN, vec<S, 4> dense)
//   VALS               inputs per lane per step (16 at 4 bits, 8 at 8 bits, 32 at QN, 8 dense)
//   units_per_row(K, bits)  wvec units per row;  scales_per_row(K, gs): scales per row (0 dense)
//   load_x(x4, g4, inv, norm, k, xs)  the lane's VALS inputs x[k, k + VALS) (times inv * g with a fused
//                      RMSNorm) into float registers (at 4 bits
//                      pre-scaled by 1, 1/16, 1/256, 1/4096 by position); returns their sum
//   Unit, load(row..., k, gs, bits)  one row's weights of a step: its wvec(s) and the group's scale and bias
//   dot(unit, xs, xsum)  this step's part of the row's dot product, in float (the unit loaded once and
//                      reused for every batch row)
//   dequant(row..., k, gs, bits, out)  the VALS weights w[k, k + VALS) of a row, in float
// (`bits` is the run-time width of WFMT_QN; the other formats know theirs and ignore it)
//
// Pointers are template parameters here (deduced: `const device uint2*`, ... on a GPU; the
// simulator's checked pointers in the simulator), because this header is included as it is while
// the kernel files themselves are rewritten for the simulator: the kernels do the casts to wvec /
// vec<T, 4>, this header only indexes. Simulator-verified, hardware-unverified.
#pragma once
#include "common.h"
#include "quant.h"

enum : int { WFMT_Q4 = 0, WFMT_Q8 = 1, WFMT_DENSE = 2, WFMT_QN = 3 };

template <int FMT, typename S, typename T>
struct WDot;

// Four inputs x[k .. k+3] (k a multiple of 4) as float into f[0..3]; with `norm`, as the RMSNorm fused
// into the GEMV gives them: g * T(x * inv) rounded to T, inv = rsqrt(mean(x^2) + eps), g the norm's gain
// (no vector constructors here: this header is not rewritten for the address-space check)
template <typename T, typename XP>
inline void load4(XP x4, XP g4, float inv, bool norm, uint k, thread float* f) {
    const vec<T, 4> v = x4[k / 4u];
    for (int j = 0; j < 4; ++j) {
        f[j] = float(v[j]);
    }
    if (norm) {
        const vec<T, 4> g = g4[k / 4u];
        for (int j = 0; j < 4; ++j) {
            f[j] = rnd<T>(rnd<T>(f[j] * inv) * float(g[j]));
        }
    }
}

// the lane's `n` (a multiple of 4) inputs starting at x[k] (k a multiple of 4); x4 = x as vec<T, 4>
template <typename T, typename XP>
inline float load_x_plain(XP x4, XP g4, float inv, bool norm, uint k, uint n, thread float* xs) {
    float sum = 0.0f;
    for (uint i = 0; i < n / 4u; ++i) {
        load4<T>(x4, g4, inv, norm, k + 4u * i, xs + 4u * i);
        for (uint j = 0; j < 4u; ++j) {
            sum += xs[4u * i + j];
        }
    }
    return sum;
}

// A quantized row's weights of one step: word pair `unit` of the row and the scale and bias of group g
struct QUnit {
    uint2 q;
    float s, b;
};
template <typename WP, typename SP>
inline QUnit load_qunit(WP wrow, SP srow, SP brow, uint unit, uint g) {
    QUnit u;
    u.q = wrow[unit];
    u.s = float(srow[g]);
    u.b = float(brow[g]);
    return u;
}

template <typename S, typename T>
struct WDot<WFMT_Q4, S, T> {
    typedef uint2 wvec;
    enum : uint { VALS = QMV_VALS_Q4 };
    static uint units_per_row(uint K, uint) { return K / 16u; }
    static uint scales_per_row(uint K, uint gs) { return K / gs; }

    // x pre-scaled by 1, 1/16, 1/256, 1/4096 by position inside each 16-bit half of a word, so the
    // masked (never shifted) nibble times it is q * x exactly: (q << 4i) * (x / 16^i) is exact in float
    template <typename XP>
    static float load_x(XP x4, XP g4, float inv, bool norm, uint k, thread float* xs) {
        float sum = 0.0f;
        for (uint i = 0; i < 4u; ++i) {
            float v[4];
            load4<T>(x4, g4, inv, norm, k + 4u * i, v);
            const float a = v[0], b = v[1], c = v[2], d = v[3];
            sum += a + b + c + d;
            xs[4u * i] = a;
            xs[4u * i + 1u] = b * 0.0625f;
            xs[4u * i + 2u] = c * 0.00390625f;
            xs[4u * i + 3u] = d * 0.000244140625f;
        }
        return sum;
    }

    typedef QUnit Unit;
    template <typename WP, typename SP>
    static Unit load(WP wrow, SP srow, SP brow, uint k, uint gs, uint) {
        return load_qunit(wrow, srow, brow, k / 16u, k / gs);
    }

    // sum over the group: scale * sum(q * x) + bias * sum(x)
    static float dot(Unit u, thread const float* xs, float xsum) {
        float acc = 0.0f;
        for (int wd = 0; wd < 2; ++wd) {
            const uint word = u.q[wd];
            for (int h = 0; h < 2; ++h) {
                const uint v = (word >> (16 * h)) & 0xFFFFu;
                thread const float* x4 = xs + 8 * wd + 4 * h;
                acc += x4[0] * float(v & 0x000Fu) + x4[1] * float(v & 0x00F0u) + x4[2] * float(v & 0x0F00u) +
                       x4[3] * float(v & 0xF000u);
            }
        }
        return u.s * acc + u.b * xsum;
    }

    template <typename WP, typename SP>
    static void dequant(WP wrow, SP srow, SP brow, uint k, uint gs, uint, thread float* out) {
        const uint2 q = wrow[k / 16u];
        const uint g = k / gs;
        const float s = float(srow[g]), b = float(brow[g]);
        for (uint i = 0; i < 16u; ++i) {
            out[i] = s * float((q[i / 8u] >> (4u * (i % 8u))) & 0xFu) + b;
        }
    }
};

template <typename S, typename T>
struct WDot<WFMT_Q8, S, T> {
    typedef uint2 wvec;
    enum : uint { VALS = QMV_VALS_Q8 };
    static uint units_per_row(uint K, uint) { return K / 8u; }
    static uint scales_per_row(uint K, uint gs) { return K / gs; }

    template <typename XP>
    static float load_x(XP x4, XP g4, float inv, bool norm, uint k, thread float* xs) {
        return load_x_plain<T>(x4, g4, inv, norm, k, VALS, xs);
    }

    typedef QUnit Unit;
    template <typename WP, typename SP>
    static Unit load(WP wrow, SP srow, SP brow, uint k, uint gs, uint) {
        return load_qunit(wrow, srow, brow, k / 8u, k / gs);
    }

    static float dot(Unit u, thread const float* xs, float xsum) {
        float acc = 0.0f;
        for (int wd = 0; wd < 2; ++wd) {
            const uint word = u.q[wd];
            for (int b = 0; b < 4; ++b) {
                acc += xs[4 * wd + b] * float((word >> (8 * b)) & 0xFFu);
            }
        }
        return u.s * acc + u.b * xsum;
    }

    template <typename WP, typename SP>
    static void dequant(WP wrow, SP srow, SP brow, uint k, uint gs, uint, thread float* out) {
        const uint2 q = wrow[k / 8u];
        const uint g = k / gs;
        const float s = float(srow[g]), b = float(brow[g]);
        for (uint i = 0; i < 8u; ++i) {
            out[i] = s * float((q[i / 4u] >> (8u * (i % 4u))) & 0xFFu) + b;
        }
    }
};

template <typename S, typename T>
struct WDot<WFMT_DENSE, S, T> {
    typedef vec<S, 4> wvec;
    enum : uint { VALS = QMV_VALS_DENSE };
    static uint units_per_row(uint K, uint) { return K / 4u; }
    static uint scales_per_row(uint, uint) { return 0u; }

    template <typename XP>
    static float load_x(XP x4, XP g4, float inv, bool norm, uint k, thread float* xs) {
        return load_x_plain<T>(x4, g4, inv, norm, k, VALS, xs);
    }

    struct Unit {
        vec<S, 4> w[2];
    };
    template <typename WP, typename SP>
    static Unit load(WP wrow, SP, SP, uint k, uint, uint) {
        Unit u;
        for (uint i = 0; i < 2u; ++i) {
            u.w[i] = wrow[k / 4u + i];
        }
        return u;
    }

    static float dot(Unit u, thread const float* xs, float) {
        float acc = 0.0f;
        for (uint i = 0; i < 2u; ++i) {
            for (int j = 0; j < 4; ++j) {
                acc += xs[4u * i + uint(j)] * float(u.w[i][j]);
            }
        }
        return acc;
    }

    template <typename WP, typename SP>
    static void dequant(WP wrow, SP, SP, uint k, uint, uint, thread float* out) {
        for (uint i = 0; i < 2u; ++i) {
            const vec<S, 4> w = wrow[k / 4u + i];
            for (int j = 0; j < 4; ++j) {
                out[4u * i + uint(j)] = float(w[j]);
            }
        }
    }
};

// Code i (0 <= i < 32) of a QN unit at the compile-time width B: q[0, B) the unit's words, value i at
// bits [B i, B (i + 1)) of their little-endian concatenation. 32-bit only (Apple GPUs run 64-bit integer
// shifts several times slower): the word holding its first bit shifted down, and when the value
// straddles into the next word (sh + B > 32, so sh >= 25 and the left shift 32 - sh is in [1, 7]) that
// word's low bits funnelled in above, then masked. Called from loops over i with a constant trip count:
// unrolled, the word index and the shifts are constants, so q[] is indexed with constants (registers).
template <uint B>
inline uint qn_code(thread const uint* q, uint i) {
    const uint at = i * B, wi = at / 32u, sh = at % 32u;
    uint v = q[wi] >> sh;
    if (sh + B > 32u) {
        v |= q[wi + 1u] << (32u - sh);
    }
    return v & ((1u << B) - 1u);
}

// sum over a unit's 32 values of x * q at width B (one term per value, in value order)
template <uint B>
inline float qn_dot(thread const uint* q, thread const float* xs) {
    float acc = 0.0f;
    for (uint i = 0; i < QMV_VALS_QN; ++i) {
        acc += xs[i] * float(qn_code<B>(q, i));
    }
    return acc;
}

// a unit's 32 weights s * q + b at width B
template <uint B>
inline void qn_dequant(thread const uint* q, float s, float b, thread float* out) {
    for (uint i = 0; i < QMV_VALS_QN; ++i) {
        out[i] = s * float(qn_code<B>(q, i)) + b;
    }
}

template <typename S, typename T>
struct WDot<WFMT_QN, S, T> {
    typedef uint wvec;
    enum : uint { VALS = QMV_VALS_QN };
    // a row of K values is K bits / 32 words (K a multiple of 32: the group size divides it)
    static uint units_per_row(uint K, uint bits) { return K / 32u * bits; }
    static uint scales_per_row(uint K, uint gs) { return K / gs; }

    template <typename XP>
    static float load_x(XP x4, XP g4, float inv, bool norm, uint k, thread float* xs) {
        return load_x_plain<T>(x4, g4, inv, norm, k, VALS, xs);
    }

    // the unit's `bits` words (a constant-bound loop: the words past `bits` are zero, never read), the
    // width, and the group's scale and bias (32 values never span two groups: gs is 32, 64 or 128)
    struct Unit {
        uint q[QN_MAX_BITS];
        uint bits;
        float s, b;
    };
    template <typename WP, typename SP>
    static Unit load(WP wrow, SP srow, SP brow, uint k, uint gs, uint bits) {
        Unit u;
        const uint base = k / 32u * bits;   // < K bits / 32: a 32-bit word index within the row
        for (uint j = 0; j < QN_MAX_BITS; ++j) {
            u.q[j] = j < bits ? wrow[base + j] : 0u;
        }
        u.bits = bits;
        u.s = float(srow[k / gs]);
        u.b = float(brow[k / gs]);
        return u;
    }

    // The run-time width selects a loop compiled for that width (a uniform switch: every lane of a
    // dispatch has the same width), so the word index and shifts of every value are constants. The
    // widths are the ones gpu::Matrix allows (quantized_format: 2, 3, 4, 5, 6, 8 -- 4 and 8 when a MoE
    // dispatch pairs two widths); 8 is the default arm.
    static float dot(Unit u, thread const float* xs, float xsum) {
        float acc;
        switch (u.bits) {
            case 2u: acc = qn_dot<2u>(u.q, xs); break;
            case 3u: acc = qn_dot<3u>(u.q, xs); break;
            case 4u: acc = qn_dot<4u>(u.q, xs); break;
            case 5u: acc = qn_dot<5u>(u.q, xs); break;
            case 6u: acc = qn_dot<6u>(u.q, xs); break;
            default: acc = qn_dot<8u>(u.q, xs); break;
        }
        return u.s * acc + u.b * xsum;
    }

    template <typename WP, typename SP>
    static void dequant(WP wrow, SP srow, SP brow, uint k, uint gs, uint bits, thread float* out) {
        const Unit u = load(wrow, srow, brow, k, gs, bits);
        switch (bits) {
            case 2u: qn_dequant<2u>(u.q, u.s, u.b, out); break;
            case 3u: qn_dequant<3u>(u.q, u.s, u.b, out); break;
            case 4u: qn_dequant<4u>(u.q, u.s, u.b, out); break;
            case 5u: qn_dequant<5u>(u.q, u.s, u.b, out); break;
            case 6u: qn_dequant<6u>(u.q, u.s, u.b, out); break;
            default: qn_dequant<8u>(u.q, u.s, u.b, out); break;
        }
    }
};

// The qmv_fast inner loop: rows row0 .. row0 + QMV_ROWS - 1 (clamped to nrows - 1: rows past the end
// re-read the last row; the caller does not store them) of one matrix (w as wvec, scales and biases
// at its row 0) times MB input vectors x[b, 0, K) (x4 = x[0] as vec<T, 4>, xs4 = the vectors' stride
// in 4-vectors), for one SIMD-group; only the first nb <= MB of them are live (nb SIMD-group-uniform:
// a branch in the loop over b skips the rest, so a variant serves every count up to MB). Per step each lane loads
// one wvec (and the group's scale and bias) of each of its rows once for all the vectors, then per
// vector its VALS inputs once for all rows; after the loop one simd_sum per (vector, row), so every
// lane of the SIMD-group receives out[b * QMV_ROWS + r] for b < nb. K is a multiple of VALS; lanes
// past K idle. Call from SIMD-group-uniform control flow.
// Registers per lane: MB * QMV_ROWS float accumulators (64 at MB = 16), the QMV_ROWS loaded units
// and one vector's VALS inputs at a time (the inputs of vector b are dead once its 4 dots are done).
// The loops over b have the constant trip count MB (the live count is a branch inside, not the loop
// bound) so that the compiler can unroll them fully and keep acc[] in registers with constant
// indices (a runtime-bounded loop would index acc[] dynamically: memory, not registers).
// With `norm`, vector b is rmsnorm(x[b]) * g: every input is multiplied by inv[b] * g[k] as it is
// loaded (rows_dot below: one plain vector, the decode projections).
// Where vector b of rows_dot_x starts in the input buffer (vec4 units): evenly strided (the decode and
// verification GEMVs' rows), or listed one by one (the union-read MoE's rows that chose an expert).
struct StridedX {
    uint stride;
    uint at(uint b) const { return b * stride; }
};
struct ListedX {
    thread const uint* offsets;
    uint at(uint b) const { return offsets[b]; }
};

template <int FMT, typename S, typename T, uint MB, typename XO, typename WP, typename SP, typename XP>
inline void rows_dot_x(WP w, SP scales, SP biases, XP x4, XO xo, XP g4, thread const float* inv, bool norm, uint K,
                       uint gs, uint bits, uint row0, uint nrows, uint nb, uint lane, thread float* out) {
    typedef WDot<FMT, S, T> D;
    typedef typename D::Unit U;
    const uint upr = D::units_per_row(K, bits), spr = D::scales_per_row(K, gs);
    // the 64-bit offsets of the first row once; the (clamped) rows after it at 32-bit offsets from there
    const uint rb = min(row0, nrows - 1u);
    const ulong wo0 = ulong(rb) * upr, so0 = ulong(rb) * spr;
    uint wo[QMV_ROWS], so[QMV_ROWS];
    for (uint r = 0; r < QMV_ROWS; ++r) {
        const uint dr = min(row0 + r, nrows - 1u) - rb;   // 0 .. QMV_ROWS - 1
        wo[r] = dr * upr;
        so[r] = dr * spr;
    }
    const WP w0 = w + wo0;
    const SP s0 = scales + so0, b0 = biases + so0;
    float acc[MB * QMV_ROWS];
    for (uint i = 0; i < MB * QMV_ROWS; ++i) {
        acc[i] = 0.0f;
    }
    for (uint k = lane * D::VALS; k < K; k += SIMD_WIDTH * D::VALS) {
        U u[QMV_ROWS];
        for (uint r = 0; r < QMV_ROWS; ++r) {
            u[r] = D::load(w0 + wo[r], s0 + so[r], b0 + so[r], k, gs, bits);
        }
        for (uint b = 0; b < MB; ++b) {
            if (b < nb) {
                float xs[D::VALS];
                const float xsum = D::load_x(x4 + xo.at(b), g4, inv[b], norm, k, xs);
                for (uint r = 0; r < QMV_ROWS; ++r) {
                    acc[b * QMV_ROWS + r] += D::dot(u[r], xs, xsum);
                }
            }
        }
    }
    for (uint b = 0; b < MB; ++b) {
        if (b < nb) {
            for (uint r = 0; r < QMV_ROWS; ++r) {
                out[b * QMV_ROWS + r] = simd_sum(acc[b * QMV_ROWS + r]);
            }
        }
    }
}

template <int FMT, typename S, typename T, uint MB, typename WP, typename SP, typename XP>
inline void rows_dot_norm(WP w, SP scales, SP biases, XP x4, uint xs4, XP g4, thread const float* inv, bool norm,
                          uint K, uint gs, uint bits, uint row0, uint nrows, uint nb, uint lane, thread float* out) {
    rows_dot_x<FMT, S, T, MB>(w, scales, biases, x4, StridedX{xs4}, g4, inv, norm, K, gs, bits, row0, nrows, nb, lane,
                              out);
}

template <int FMT, typename S, typename T, typename WP, typename SP, typename XP>
inline void rows_dot(WP w, SP scales, SP biases, XP x4, uint K, uint gs, uint bits, uint row0, uint nrows, uint lane,
                     thread float* out) {
    const float one[1] = {1.0f};
    rows_dot_norm<FMT, S, T, 1u>(w, scales, biases, x4, 0u, x4, one, false, K, gs, bits, row0, nrows, 1u, lane, out);
}

// rows_dot over nb (<= MB) vectors anywhere in one buffer: vector b starts at x4 + xoff[b] (vec4 units).
// Why: the union-read MoE kernels (metal/moe.metal, moe_*_rows) run one expert's rows over the rows of a
// batch that chose it, which are not evenly strided. Each weight unit is loaded once for the nb vectors;
// vector b's accumulation is rows_dot's for that vector alone, step for step (the same load_x, dot and
// simd_sum in the same order), so its result is bit for bit rows_dot's.
template <int FMT, typename S, typename T, uint MB, typename WP, typename SP, typename XP>
inline void rows_dot_sel(WP w, SP scales, SP biases, XP x4, thread const uint* xoff, uint K, uint gs, uint bits,
                         uint row0, uint nrows, uint nb, uint lane, thread float* out) {
    float ones[MB];
    for (uint b = 0; b < MB; ++b) {
        ones[b] = 1.0f;
    }
    rows_dot_x<FMT, S, T, MB>(w, scales, biases, x4, ListedX{xoff}, x4, ones, false, K, gs, bits, row0, nrows, nb,
                              lane, out);
}

// inv = rsqrt(mean(x[0, K)^2) + eps) for one SIMD-group (every lane receives it): the statistics of an
// RMSNorm fused into a GEMV; x is read once more per SIMD-group (K values, from cache).
template <typename T, typename XP>
inline float rms_inv(XP x, uint K, float eps, uint lane) {
    float ss = 0.0f;
    for (uint k = lane; k < K; k += SIMD_WIDTH) {
        const float v = float(x[k]);
        ss += v * v;
    }
    return rsqrt(simd_sum(ss) / float(K) + eps);
}

// wvec units / scales of one matrix [rows, K] of a stack (the stride between experts)
template <int FMT, typename S, typename T>
inline ulong matrix_units(uint rows, uint K, uint bits) {
    return ulong(rows) * WDot<FMT, S, T>::units_per_row(K, bits);
}
template <int FMT, typename S, typename T>
inline ulong matrix_scales(uint rows, uint K, uint gs) {
    return ulong(rows) * WDot<FMT, S, T>::scales_per_row(K, gs);
}
