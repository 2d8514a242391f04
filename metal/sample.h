// sample family: parameters and thread geometry shared by metal/sample.metal and its host functions
// (src/gpu/ops/sample.cpp).
// Host includers include <cstdint> first (src/gpu/ops/sample.cpp); MSL has the fixed-width types.
#pragma once

// One struct for every selection kernel of the family (argmax reads vocab and n_partials only; sample_token_mask
// has its own, SampleMaskParams below).
struct SampleKernelParams {
    uint32_t vocab;            // logits [vocab]
    uint32_t n_partials;       // threadgroups of sample_partials: ceil(vocab / (its threads * PER_THREAD))
    uint32_t top_k;            // effective top-k: 0 (off) or 1 <= top_k < vocab
    uint32_t idx_bits;         // bits of vocab - 1 (at least 1): the index digits of the rank radix
    float inv_temperature;     // 1 / temperature
    float top_p;               // < 1: on
    float min_p;               // > 0: on
    uint32_t seed_lo, seed_hi; // Philox-4x32-10 key
    uint32_t pos_lo, pos_hi;   // Philox-4x32-10 counter words 0 and 1 (words 2, 3 are 0)
};
static_assert(sizeof(SampleKernelParams) == 44, "SampleKernelParams: 11 x 4 bytes, as the host packs it");

// sample_token_mask: logits[i] = -inf where bit i % 32 of mask word i / 32 is 0, for i < vocab (a token bitmask of
// ceil(vocab / 32) or more uint32 words, bit j of a word standing for token 32 * word + j: llguidance's
// fill_next_token_bitmask layout). One logit per thread, threadgroups of at most SAMPLE_MASK_THREADS threads
// (whole SIMD-groups: a SIMD-group's 32 lanes read one mask word).
struct SampleMaskParams {
    uint32_t vocab;            // logits [vocab] masked (the words cover at least this many tokens)
    uint32_t pad;
};
static_assert(sizeof(SampleMaskParams) == 8, "SampleMaskParams: 2 x 4 bytes, as the host packs it");
#define SAMPLE_MASK_THREADS 256u

// sample_partials: one (max key, lowest index) pair per threadgroup of t threads (t: about
// vocab / SAMPLE_PARTIAL_PER_THREAD rounded up to 32, at most SAMPLE_PARTIAL_THREADS), each reading
// SAMPLE_PARTIAL_PER_THREAD logits strided by t (coalesced).
#define SAMPLE_PARTIAL_THREADS 256u
#define SAMPLE_PARTIAL_PER_THREAD 16u
// the single-threadgroup kernels (argmax_final, sample_sorted, sample_radix): about
// vocab / SAMPLE_PICK_PER_THREAD threads rounded up to 32, at most SAMPLE_PICK_THREADS (1024 for the
// real vocabulary). The host derives every thread count from vocab alone, so the float reduction order
// (and hence the token) is a function of the logits, the parameters, seed and position only.
#define SAMPLE_PICK_THREADS 1024u
#define SAMPLE_PICK_PER_THREAD 64u
// sample_sorted keeps at most this many candidates (sorted in threadgroup memory); larger candidate
// sets go through sample_radix
#define SAMPLE_SORT_MAX 1024u
// radix digits of the rank selection: 4 bits, 16 buckets
#define SAMPLE_RADIX_BUCKETS 16u
// scratch: SAMPLE_HEADER_WORDS uint32 words of results (below), then n_partials (key, index) pairs
#define SAMPLE_HEADER_WORDS 16u

// header words written by sample_sorted / sample_radix (for tests and debugging)
#define SAMPLE_H_TOKEN 0u      // the drawn token
#define SAMPLE_H_U 1u          // the uniform u in [0, 1) (float bits)
#define SAMPLE_H_MAX 2u        // the largest logit (float bits)
#define SAMPLE_H_ARGMAX 3u     // its lowest index
#define SAMPLE_H_NTOPK 4u      // candidates after top-k
#define SAMPLE_H_NKEPT 5u      // candidates after top-k, top-p and min-p: what the draw is over
#define SAMPLE_H_MASS 6u       // the kept mass S = sum of exp((l - max) / T) over the kept set (float bits)
#define SAMPLE_H_PATH 7u       // 1: sample_sorted, 2: sample_radix
