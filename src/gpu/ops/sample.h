// Host functions of metal/sample.metal: choosing the next token on the GPU from float logits, writing
// it into a device slot that the next decode step's embedding reads (the host reads 4 bytes).
#pragma once
#include "gpu/ops/common.h"

namespace qwenmetal::gpu::ops {

// Structured output: logits[i] = -inf for every i < vocab whose bit i % 32 of mask word i / 32 is 0 (uint32
// words, at least token_mask_words(vocab) of them: llguidance's token bitmask layout), in place, before argmax
// or sample. A fully masked row leaves nothing to choose (argmax would return 0, sample a uniform draw over
// the -inf logits): the caller checks token_mask_allows_any first.
void apply_token_mask(Encoder& e, const Buffer& logits, uint32_t vocab, const Buffer& mask);
// words of a token bitmask over `vocab` tokens: ceil(vocab / 32)
uint32_t token_mask_words(uint64_t vocab);
// whether `words` (host memory, n_words of them) allow some token in [0, vocab)
bool token_mask_allows_any(const uint32_t* words, uint64_t n_words, uint32_t vocab);

// token[0] = argmax(logits[:vocab]) (ties: lowest index).
void argmax(Encoder& e, const Buffer& logits, uint32_t vocab, const Buffer& token, const Buffer& scratch);

struct SampleParams {
    float temperature = 1.0f;     // > 0 (0 is argmax: the caller picks argmax)
    uint32_t top_k = 0;           // 0: off
    float top_p = 1.0f;           // 1: off
    float min_p = 0.0f;           // 0: off
    uint64_t seed = 0;
    uint64_t position = 0;        // the RNG is keyed by (seed, position): seeded runs reproduce
};
// bytes of f32/u32 scratch sample() needs for `vocab`
uint64_t sample_scratch_bytes(uint32_t vocab);
// token[0] = a draw from softmax(logits / T) restricted by top-k, then top-p, then min-p (the host
// Sampler's order), using a counter-based RNG of (seed, position).
void sample(Encoder& e, const Buffer& logits, uint32_t vocab, const SampleParams& p, const Buffer& token,
            const Buffer& scratch);

}  // namespace qwenmetal::gpu::ops
