// Choosing the next token on the GPU from float logits [vocab].
//
//   sample_token_mask logits = -inf outside a token bitmask (structured output: a grammar's allowed
//                     tokens), before any of the kernels below
//   sample_partials   (max order key, lowest index) per threadgroup of SAMPLE_PARTIAL_PER_TG logits
//   argmax_final      token = the best of those pairs (greedy decoding)
//   sample_sorted     a draw when the candidates after top-k number at most SAMPLE_SORT_MAX: they are
//                     gathered, sorted in threadgroup memory and filtered like the host sampler
//   sample_radix      a draw over a larger candidate set (top-k off or above SAMPLE_SORT_MAX): every
//                     threshold (top-k, top-p, the draw itself) is a radix selection over the whole
//                     vocabulary in rank order, with fixed-order float reductions
//
// Semantics (python/qwenmetal/sampling.py, Sampler._draw): rank order is logit descending, ties by the
// lower index. x = logits / T; keep the top_k first in rank order (0: off), then the shortest prefix
// whose probability reaches top_p (the token that crosses the threshold is kept), then the tokens with
// p >= min_p * p_max (at least one); draw j = the first kept position whose cumulative probability in
// rank order exceeds u, u uniform in [0, 1) from Philox-4x32-10 (key = seed, counter = (position, 0)).
// Everything is float32 (the host computes in float64): a threshold within float rounding of a
// cumulative sum may be placed one token differently. NaN logits rank below -inf and have weight 0.
//
// Order key: the float bits mapped to a uint that orders like the floats (-0 and +0 equal, NaN lowest),
// so rank order is (key descending, index ascending) and every candidate set is "rank >= a threshold".
//
// Simulator-verified, hardware-unverified.
#include "common.h"
#include "sample.h"

inline uint order_key(float v) {
    uint b = as_type<uint>(v);
    if (b == 0x80000000u) {
        b = 0u;  // -0 ties with +0
    }
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0u;  // NaN: below -inf (whose key is 0x007fffff)
    }
    return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}

// (k, i) ranks before (bk, bi)
inline bool ranks_before(uint k, uint i, uint bk, uint bi) { return k > bk || (k == bk && i < bi); }

inline void best_of(thread uint& bk, thread uint& bi, uint k, uint i) {
    if (ranks_before(k, i, bk, bi)) {
        bk = k;
        bi = i;
    }
}

// The best (key, index) of the threadgroup's pairs, to every thread: simd_max of the keys, simd_min of
// the indices holding it, once per SIMD-group and once over the SIMD-groups (every SIMD-group reduces
// the partials itself). Threadgroup-uniform; the caller barriers before reusing pk / pi.
inline uint2 threadgroup_best(uint k, uint i, threadgroup uint* pk, threadgroup uint* pi, uint lane, uint sg,
                              uint nsg) {
    uint km = simd_max(k);
    uint im = simd_min(k == km ? i : 0xffffffffu);
    if (lane == 0) {
        pk[sg] = km;
        pi[sg] = im;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint k2 = lane < nsg ? pk[lane] : 0u;
    const uint i2 = lane < nsg ? pi[lane] : 0xffffffffu;
    km = simd_max(k2);
    im = simd_min(k2 == km ? i2 : 0xffffffffu);
    return uint2(km, im);
}

// Philox-4x32-10 (Salmon et al., SC'11; Random123): counter (pos_lo, pos_hi, 0, 0), key (seed_lo,
// seed_hi); u = (first output word >> 8) * 2^-24, in [0, 1) with 24 bits.
inline float philox_uniform(constant SampleKernelParams& p) {
    uint4 c = uint4(p.pos_lo, p.pos_hi, 0u, 0u);
    uint2 k = uint2(p.seed_lo, p.seed_hi);
    for (uint r = 0; r < 10u; ++r) {
        if (r > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        const uint hi0 = mulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint hi1 = mulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return float(c.x >> 8) * 5.9604644775390625e-8f;
}

struct SampleCtx {
    float m;        // the largest logit
    uint mkey;      // its order key
    uint midx;      // its lowest index
    float inv_t;    // 1 / temperature
    uint vocab;
    uint im;        // 2^idx_bits - 1: index digits are those of im - i (larger: lower index, earlier)
    uint nidx;      // index digit levels, ceil(idx_bits / 4)
};

// exp((l - max) / T): the unnormalised probability; 1 for every logit equal to the largest (also when
// that is +-inf), 0 for NaN
inline float elem_e(float l, uint key, SampleCtx c) {
    if (key == c.mkey) {
        return 1.0f;
    }
    if (key == 0u) {
        return 0.0f;
    }
    return precise::exp((l - c.m) * c.inv_t);
}

// A candidate set: rank >= (key, idx), and (unless count) e >= min_e. Its members weigh 1 (count) or e.
struct RankFilter {
    uint key, idx;
    float min_e;
    uint count;
};

inline bool in_rank(uint key, uint i, uint tkey, uint tidx) { return key > tkey || (key == tkey && i <= tidx); }

// weight of element i (0 outside the set), and whether it is a member
inline float member_weight(float l, uint key, uint i, RankFilter f, SampleCtx c, thread bool& member) {
    member = false;
    if (!in_rank(key, i, f.key, f.idx)) {
        return 0.0f;
    }
    if (f.count != 0u) {
        member = true;
        return 1.0f;
    }
    const float e = elem_e(l, key, c);
    member = e >= f.min_e;
    return member ? e : 0.0f;
}

inline SampleCtx make_ctx(constant SampleKernelParams& p, device const float* x, device const uint* partials,
                          threadgroup uint* pk, threadgroup uint* pi, uint tid, uint nt, uint lane, uint sg,
                          uint nsg) {
    uint bk = 0u, bi = 0xffffffffu;
    for (uint g = tid; g < p.n_partials; g += nt) {
        best_of(bk, bi, partials[2 * g], partials[2 * g + 1]);
    }
    const uint2 b = threadgroup_best(bk, bi, pk, pi, lane, sg, nsg);
    SampleCtx c;
    c.mkey = b.x;
    c.midx = b.y;
    c.m = x[b.y];
    c.inv_t = p.inv_temperature;
    c.vocab = p.vocab;
    c.im = p.idx_bits >= 32u ? 0xffffffffu : (1u << p.idx_bits) - 1u;
    c.nidx = (p.idx_bits + 3u) / 4u;
    return c;
}

// Sum of the weights of a set's members and their number, in a fixed order: each thread its strided
// elements in index order, simd_sum, the SIMD-group partials by simd_sum. Threadgroup-uniform.
inline float2 set_sum(device const float* x, SampleCtx c, RankFilter f, threadgroup float* part, uint tid, uint nt,
                      uint lane, uint sg, uint nsg) {
    float s = 0.0f, n = 0.0f;
    for (uint i = tid; i < c.vocab; i += nt) {
        const float l = x[i];
        bool member;
        const float w = member_weight(l, order_key(l), i, f, c, member);
        s += w;
        n += member ? 1.0f : 0.0f;
    }
    s = simd_sum(s);
    n = simd_sum(n);
    if (lane == 0) {
        part[sg] = s;
        part[SIMD_WIDTH + sg] = n;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    s = simd_sum(lane < nsg ? part[lane] : 0.0f);
    n = simd_sum(lane < nsg ? part[SIMD_WIDTH + lane] : 0.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // part is reused next
    return float2(s, n);
}

// The element of the set f at which the cumulative weight in rank order first exceeds `target`
// (inclusive: reaches it), by radix selection on the 64-bit rank (order key, im - index), 4 bits per
// level: 8 key levels, then c.nidx index levels. Per level every thread accumulates a private 16-bucket
// histogram of its strided elements that match the digits chosen so far; the buckets are reduced in a
// fixed order (simd_sum per bucket, SIMD-group partials summed in order by 16 threads); every thread
// then walks the buckets from the highest digit with the weight above the current prefix and picks the
// same digit. A bucket is picked only if its weight is positive; if rounding leaves the target
// unreached, the lowest positive bucket is taken (the last element, as the host's clamp to n - 1).
// In count mode (weights 1, exact) the index levels are skipped when the selected element is the last
// of its key group (returned idx 0xffffffff: the whole group). Returns (key, index): the set
// "rank >= it" ends at the selected element. Threadgroup-uniform.
inline uint2 radix_select(device const float* x, SampleCtx c, RankFilter f, float target, bool inclusive,
                          threadgroup float* part, threadgroup float* bucket, uint tid, uint nt, uint lane, uint sg,
                          uint nsg) {
    uint pk = 0u, kmask = 0u, pi = 0u, imask = 0u;
    float above = 0.0f;
    bool whole_group = false;
    const uint levels = 8u + c.nidx;
    for (uint L = 0; L < levels; ++L) {
        const bool on_idx = L >= 8u;
        if (on_idx && whole_group) {
            break;
        }
        const uint shift = on_idx ? 4u * (c.nidx - 1u - (L - 8u)) : 28u - 4u * L;
        float h[SAMPLE_RADIX_BUCKETS];
        for (uint b = 0; b < SAMPLE_RADIX_BUCKETS; ++b) {
            h[b] = 0.0f;
        }
        for (uint i = tid; i < c.vocab; i += nt) {
            const float l = x[i];
            const uint key = order_key(l);
            uint d;
            if (!on_idx) {
                if ((key & kmask) != pk) {
                    continue;
                }
                d = (key >> shift) & 15u;
            } else {
                const uint inv = c.im - i;
                if (key != pk || (inv & imask) != pi) {
                    continue;
                }
                d = (inv >> shift) & 15u;
            }
            bool member;
            // perf-ok(PERF-STACK-ARRAY): a histogram indexed by the data's digit has no constant index (16 floats of stack per thread)
            h[d] += member_weight(l, key, i, f, c, member);
        }
        for (uint b = 0; b < SAMPLE_RADIX_BUCKETS; ++b) {
            const float s = simd_sum(h[b]);
            if (lane == 0) {
                part[sg * SAMPLE_RADIX_BUCKETS + b] = s;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < SAMPLE_RADIX_BUCKETS) {
            float a = 0.0f;
            for (uint g = 0; g < nsg; ++g) {
                a += part[g * SAMPLE_RADIX_BUCKETS + tid];
            }
            bucket[tid] = a;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        int chosen = -1, last = -1;
        float a = above, last_above = above;
        for (int b = int(SAMPLE_RADIX_BUCKETS) - 1; b >= 0; --b) {
            const float wb = bucket[b];
            if (wb > 0.0f) {
                if (inclusive ? a + wb >= target : a + wb > target) {
                    chosen = b;
                    break;
                }
                last = b;
                last_above = a;
            }
            a += wb;
        }
        if (chosen < 0) {
            chosen = last < 0 ? 0 : last;
            a = last_above;
        }
        above = a;
        if (!on_idx) {
            pk |= uint(chosen) << shift;
            kmask |= 15u << shift;
            if (L == 7u && f.count != 0u && above + bucket[chosen] <= target + 1.0f) {
                whole_group = true;  // the selected element is the last of its key group
            }
        } else {
            pi |= uint(chosen) << shift;
            imask |= 15u << shift;
        }
    }
    return uint2(pk, whole_group ? 0xffffffffu : c.im - pi);
}

// ------------------------------------------------------------------------------------------------
// sample_token_mask: x[i] = -inf where bit (i & 31) of mask[i >> 5] is 0, for i < vocab; x[i] untouched where it
// is 1 (the host checks that some bit below vocab is set: argmax and the samplers then never pick a masked token,
// whose weight exp(-inf) is 0). Grid (ceil(vocab / t), 1, 1) x (t, 1, 1), t a multiple of 32: thread i owns
// logit i, so a SIMD-group's lanes share one mask word (one broadcast read) and write 32 consecutive logits.
// 32-bit indices throughout (vocab <= 2^24, the family's limit).
// Fused: nothing; an in-place pass over the logits between the lm_head and the first pass of argmax / sample.
[[kernel, max_total_threads_per_threadgroup(SAMPLE_MASK_THREADS)]]
void sample_token_mask(constant SampleMaskParams& p [[buffer(0)]], device float* x [[buffer(1)]],
                       device const uint* mask [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i >= p.vocab) {
        return;
    }
    if (((mask[i >> 5] >> (i & 31u)) & 1u) == 0u) {
        x[i] = as_type<float>(0xff800000u);  // -inf
    }
}

// ------------------------------------------------------------------------------------------------
// sample_partials: the first pass of argmax and of both samplers. Grid (n_partials, 1, 1) x (t, 1, 1);
// threadgroup g reads the logits [g * t * PER_THREAD, (g + 1) * t * PER_THREAD), thread i the ones at
// i + j * t (coalesced), keeps its best (key, index) and the threadgroup reduces them
// (threadgroup_best). Writes partials[2g] = key, partials[2g + 1] = index.
// Fused: nothing; the cost is one read of the logits spread over many threadgroups.
[[kernel, max_total_threads_per_threadgroup(SAMPLE_PARTIAL_THREADS)]]
void sample_partials(constant SampleKernelParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                     device uint* partials [[buffer(2)]], uint g [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]], uint nt [[threads_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup uint pk[SIMD_WIDTH];
    threadgroup uint pi[SIMD_WIDTH];
    uint bk = 0u, bi = 0xffffffffu;
    const uint base = g * nt * SAMPLE_PARTIAL_PER_THREAD;
    for (uint j = 0; j < SAMPLE_PARTIAL_PER_THREAD; ++j) {
        const uint i = base + j * nt + tid;
        if (i < p.vocab) {
            best_of(bk, bi, order_key(x[i]), i);
        }
    }
    const uint2 b = threadgroup_best(bk, bi, pk, pi, lane, sg, nsg);
    if (tid == 0) {
        partials[2 * g] = b.x;
        partials[2 * g + 1] = b.y;
    }
}

// argmax_final: token[0] = the lowest index of the largest logit. One threadgroup; thread t reduces the
// partials t, t + threads, ..., then threadgroup_best.
[[kernel, max_total_threads_per_threadgroup(SAMPLE_PICK_THREADS)]]
void argmax_final(constant SampleKernelParams& p [[buffer(0)]], device const uint* partials [[buffer(1)]],
                  device uint* token [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                  uint nt [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                  uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup uint pk[SIMD_WIDTH];
    threadgroup uint pi[SIMD_WIDTH];
    uint bk = 0u, bi = 0xffffffffu;
    for (uint g = tid; g < p.n_partials; g += nt) {
        best_of(bk, bi, partials[2 * g], partials[2 * g + 1]);
    }
    const uint2 b = threadgroup_best(bk, bi, pk, pi, lane, sg, nsg);
    if (tid == 0) {
        token[0] = b.y;
    }
}

inline void write_header(device uint* header, device uint* token, uint tok, float u, SampleCtx c, uint ntopk,
                         uint nkept, float mass, uint path) {
    token[0] = tok;
    header[SAMPLE_H_TOKEN] = tok;
    header[SAMPLE_H_U] = as_type<uint>(u);
    header[SAMPLE_H_MAX] = as_type<uint>(c.m);
    header[SAMPLE_H_ARGMAX] = c.midx;
    header[SAMPLE_H_NTOPK] = ntopk;
    header[SAMPLE_H_NKEPT] = nkept;
    header[SAMPLE_H_MASS] = as_type<uint>(mass);
    header[SAMPLE_H_PATH] = path;
    for (uint w = SAMPLE_H_PATH + 1u; w < SAMPLE_HEADER_WORDS; ++w) {
        header[w] = 0u;
    }
}

// the threadgroup's total of v (counted in float, exact up to 2^24); threadgroup-uniform
// (common.h's threadgroup_sum, with the array passed through a helper)
inline uint tg_count(uint v, threadgroup float* part, uint lane, uint sg, uint nsg) {
    const float s = simd_sum(float(v));
    if (lane == 0) {
        part[sg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float t = simd_sum(lane < nsg ? part[lane] : 0.0f);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // part is reused next
    return uint(t);
}

// sample_sorted: one threadgroup (threads: see SAMPLE_PICK_THREADS; any multiple of 32 works).
//   1. the max from the partials (every thread);
//   2. top-k (only when vocab > SAMPLE_SORT_MAX): the k-th in rank order by radix_select in count mode;
//   3. gather the candidates (rank >= that, or the whole vocabulary) into threadgroup memory through an
//      atomic counter (the order does not matter: the sort makes it unique), bitonic sort by rank;
//   4. e_j = exp((l_j - max) / T); the inclusive cumulative sum C_j in a fixed, thread-count independent
//      order: 32-entry blocks summed sequentially by one thread each, block offsets sequentially, so C
//      is monotone; then with Z = C[nc - 1]:
//      top-p  n_p = min(nc, 1 + #{j < nc : C_j < top_p * Z})
//      min-p  n = min(n_p, max(1, #{j < n_p : e_j >= min_p}))
//      draw   j = min(n - 1, #{j < n : C_j <= u * C[n - 1]})   (the host's searchsorted, right side)
// Fused: max, top-k, sort, softmax, top-p, min-p, the draw: one dispatch after the partials.
// Threadgroup memory: 4 x SAMPLE_SORT_MAX words + 2.2 KB.
[[kernel, max_total_threads_per_threadgroup(SAMPLE_PICK_THREADS)]]
void sample_sorted(constant SampleKernelParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                   device const uint* partials [[buffer(2)]], device uint* token [[buffer(3)]],
                   device uint* header [[buffer(4)]], uint tid [[thread_index_in_threadgroup]],
                   uint nt [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup uint ckey[SAMPLE_SORT_MAX];
    threadgroup uint cidx[SAMPLE_SORT_MAX];
    threadgroup float ce[SAMPLE_SORT_MAX];
    threadgroup float cc[SAMPLE_SORT_MAX];
    threadgroup float blk[SAMPLE_SORT_MAX / SIMD_WIDTH];
    threadgroup float part[SIMD_WIDTH * SAMPLE_RADIX_BUCKETS];
    threadgroup float bucket[SAMPLE_RADIX_BUCKETS];
    threadgroup uint pk[SIMD_WIDTH];
    threadgroup uint pi[SIMD_WIDTH];
    threadgroup atomic_uint ncount[1];

    const SampleCtx c = make_ctx(p, x, partials, pk, pi, tid, nt, lane, sg, nsg);
    uint tkey = 0u, tidx = 0xffffffffu;
    if (p.top_k != 0u && p.vocab > SAMPLE_SORT_MAX) {
        const RankFilter all = {0u, 0xffffffffu, 0.0f, 1u};
        const uint2 t = radix_select(x, c, all, float(p.top_k - 1u), false, part, bucket, tid, nt, lane, sg, nsg);
        tkey = t.x;
        tidx = t.y;
    }
    if (tid == 0) {
        atomic_store_explicit(&ncount[0], 0u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < p.vocab; i += nt) {
        const uint key = order_key(x[i]);
        if (in_rank(key, i, tkey, tidx)) {
            const uint slot = atomic_fetch_add_explicit(&ncount[0], 1u, memory_order_relaxed);
            if (slot < SAMPLE_SORT_MAX) {
                ckey[slot] = key;
                cidx[slot] = i;
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint n_all = min(atomic_load_explicit(&ncount[0], memory_order_relaxed), SAMPLE_SORT_MAX);
    uint n2 = 1u;
    while (n2 < n_all) {
        n2 <<= 1;
    }
    for (uint i = n_all + tid; i < n2; i += nt) {
        ckey[i] = 0u;  // ranks after every element (NaN keys are 0 too, with smaller indices)
        cidx[i] = 0xffffffffu;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // bitonic sort, first in rank order first
    for (uint k = 2u; k <= n2; k <<= 1) {
        for (uint j = k >> 1; j > 0u; j >>= 1) {
            for (uint i = tid; i < n2; i += nt) {
                const uint l = i ^ j;
                if (l > i) {
                    const uint ka = ckey[i], ia = cidx[i], kb = ckey[l], ib = cidx[l];
                    const bool l_first = ranks_before(kb, ib, ka, ia);
                    if ((i & k) == 0u ? l_first : !l_first) {
                        ckey[i] = kb;
                        cidx[i] = ib;
                        ckey[l] = ka;
                        cidx[l] = ia;
                    }
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
    }
    const uint nc = p.top_k != 0u ? min(p.top_k, n_all) : n_all;
    const uint nblk = (nc + SIMD_WIDTH - 1u) / SIMD_WIDTH;
    for (uint j = tid; j < nblk * SIMD_WIDTH; j += nt) {
        ce[j] = j < nc ? elem_e(x[cidx[j]], ckey[j], c) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < nblk) {
        float a = 0.0f;
        // one serial scan per 32-entry block: the fixed summation order docs/metal.md gives (monotone, independent
        // of the thread count). Its 32-word rows conflict, but it runs once per sample on at most 32 threads,
        // beside ~9 passes over the logits; a SIMD prefix sum would be conflict-free but sum in another order.
        for (uint q = 0; q < SIMD_WIDTH; ++q) {
            a += ce[tid * SIMD_WIDTH + q];  // perf-ok(PERF-TG-COLUMN): the fixed-order block scan above
            cc[tid * SIMD_WIDTH + q] = a;   // perf-ok(PERF-TG-COLUMN): the fixed-order block scan above
        }
        blk[tid] = a;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float off = 0.0f;
        for (uint b = 0; b < nblk; ++b) {
            const float t = blk[b];
            blk[b] = off;
            off += t;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = tid; j < nblk * SIMD_WIDTH; j += nt) {
        cc[j] = blk[j / SIMD_WIDTH] + cc[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    uint n = nc;
    if (p.top_p < 1.0f) {
        const float target = p.top_p * cc[nc - 1u];
        uint below = 0u;
        for (uint j = tid; j < nc; j += nt) {
            below += cc[j] < target ? 1u : 0u;
        }
        n = min(nc, tg_count(below, part, lane, sg, nsg) + 1u);
    }
    if (p.min_p > 0.0f) {
        uint keep = 0u;
        for (uint j = tid; j < n; j += nt) {
            keep += ce[j] >= p.min_p ? 1u : 0u;
        }
        n = min(n, max(1u, tg_count(keep, part, lane, sg, nsg)));
    }
    const float u = philox_uniform(p);
    const float mass = cc[n - 1u];
    const float t = u * mass;
    uint le = 0u;
    for (uint j = tid; j < n; j += nt) {
        le += cc[j] <= t ? 1u : 0u;
    }
    const uint jd = min(tg_count(le, part, lane, sg, nsg), n - 1u);
    if (tid == 0) {
        write_header(header, token, cidx[jd], u, c, nc, n, mass, 1u);
    }
}

// sample_radix: one threadgroup (threads: see SAMPLE_PICK_THREADS; the reduction order depends on the
// thread count, which the host derives from vocab alone). Every threshold is a radix_select over the
// whole vocabulary:
//   1. the max from the partials;
//   2. top-k (if on): the k-th in rank order (count mode) -> the top-k set "rank >= tk";
//   3. Z, n_topk = set_sum(top-k set); top-p (if on): the element where the cumulative e reaches
//      top_p * Z (inclusive) -> "rank >= tp";
//   4. kept = rank >= tp and e >= min_p (min-p relative to the max, whose e is 1); S, n = set_sum(kept);
//   5. the draw: the element where the cumulative e of the kept set first exceeds u * S.
// Passes over the logits: (8 + index levels) per radix_select (count mode usually 8), 2 set_sums.
// Fused: everything after the partials, one dispatch. Threadgroup memory 2.3 KB.
[[kernel, max_total_threads_per_threadgroup(SAMPLE_PICK_THREADS)]]
void sample_radix(constant SampleKernelParams& p [[buffer(0)]], device const float* x [[buffer(1)]],
                  device const uint* partials [[buffer(2)]], device uint* token [[buffer(3)]],
                  device uint* header [[buffer(4)]], uint tid [[thread_index_in_threadgroup]],
                  uint nt [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                  uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float part[SIMD_WIDTH * SAMPLE_RADIX_BUCKETS];
    threadgroup float bucket[SAMPLE_RADIX_BUCKETS];
    threadgroup uint pk[SIMD_WIDTH];
    threadgroup uint pi[SIMD_WIDTH];

    const SampleCtx c = make_ctx(p, x, partials, pk, pi, tid, nt, lane, sg, nsg);
    uint tkey = 0u, tidx = 0xffffffffu;
    if (p.top_k != 0u) {
        const RankFilter all = {0u, 0xffffffffu, 0.0f, 1u};
        const uint2 t = radix_select(x, c, all, float(p.top_k - 1u), false, part, bucket, tid, nt, lane, sg, nsg);
        tkey = t.x;
        tidx = t.y;
    }
    const RankFilter topk = {tkey, tidx, 0.0f, 0u};
    const float2 z = set_sum(x, c, topk, part, tid, nt, lane, sg, nsg);
    if (p.top_p < 1.0f) {
        const uint2 t = radix_select(x, c, topk, p.top_p * z.x, true, part, bucket, tid, nt, lane, sg, nsg);
        tkey = t.x;
        tidx = t.y;
    }
    const RankFilter kept = {tkey, tidx, p.min_p, 0u};
    const float2 s = set_sum(x, c, kept, part, tid, nt, lane, sg, nsg);
    const float u = philox_uniform(p);
    const uint2 d = radix_select(x, c, kept, u * s.x, false, part, bucket, tid, nt, lane, sg, nsg);
    if (tid == 0) {
        write_header(header, token, d.y, u, c, uint(z.y), uint(s.y), s.x, 2u);
    }
}
