#include "gpu/ops/sample.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "metal/sample.h"

namespace qwenmetal::gpu::ops {

namespace {

constexpr uint64_t kMaxVocab = uint64_t(1) << 24;  // counts are kept in float (exact up to 2^24)

uint32_t round32(uint64_t n) { return uint32_t((n + 31) / 32 * 32); }
uint32_t clamp_threads(uint64_t n, uint32_t hi) { return std::min<uint32_t>(hi, std::max<uint32_t>(32, round32(n))); }
// every thread count is a function of vocab alone (the float reduction order depends on it)
uint32_t partial_threads(uint32_t vocab) {
    return clamp_threads(ceil_div(vocab, SAMPLE_PARTIAL_PER_THREAD), SAMPLE_PARTIAL_THREADS);
}
uint32_t pick_threads(uint32_t vocab) { return clamp_threads(ceil_div(vocab, SAMPLE_PICK_PER_THREAD), SAMPLE_PICK_THREADS); }
uint32_t n_partials(uint32_t vocab) {
    return ceil_div(vocab, uint64_t(partial_threads(vocab)) * SAMPLE_PARTIAL_PER_THREAD);
}

uint32_t bits_of(uint32_t v) {
    uint32_t b = 0;
    while (b < 32 && (v >> b) != 0) ++b;
    return b;
}

SampleKernelParams base_params(uint32_t vocab) {
    SampleKernelParams k{};
    k.vocab = vocab;
    k.n_partials = n_partials(vocab);
    k.idx_bits = std::max<uint32_t>(1, bits_of(vocab - 1));
    k.inv_temperature = 1.0f;
    k.top_p = 1.0f;
    return k;
}

void check_common(const char* op, const Buffer& logits, uint32_t vocab, const Buffer& token, const Buffer& scratch) {
    check(vocab > 0, op, "vocab must be positive");
    check(vocab <= kMaxVocab, op, "vocab must be at most 2^24, got " + std::to_string(vocab));
    need(logits, uint64_t(vocab) * 4, op, "logits");
    need(token, 4, op, "token");
    need(scratch, sample_scratch_bytes(vocab), op, "scratch");
}

uint64_t partials_offset() { return uint64_t(SAMPLE_HEADER_WORDS) * 4; }

// the first pass of argmax and sample: per-threadgroup (key, index) pairs into the scratch
Buffer encode_partials(Encoder& e, const SampleKernelParams& k, const Buffer& logits, const Buffer& scratch) {
    const uint64_t lb = uint64_t(k.vocab) * 4, pb = uint64_t(k.n_partials) * 8;
    const Buffer partials = scratch.view(partials_offset(), pb);
    e.dispatch("sample_partials", Dims{k.n_partials, 1, 1}, Dims{partial_threads(k.vocab), 1, 1},
               {Arg::params(k), Arg::in(logits.view(0, lb)), Arg::out(partials)});
    return partials;
}

}  // namespace

uint64_t sample_scratch_bytes(uint32_t vocab) {
    return partials_offset() + uint64_t(n_partials(vocab)) * 8;
}

uint32_t token_mask_words(uint64_t vocab) { return ceil_div(vocab, 32); }

bool token_mask_allows_any(const uint32_t* words, uint64_t n_words, uint32_t vocab) {
    const uint64_t full = std::min<uint64_t>(vocab / 32, n_words);
    for (uint64_t w = 0; w < full; ++w)
        if (words[w]) return true;
    const uint32_t rest = vocab % 32;   // the last word's bits below vocab
    return rest && full < n_words && (words[full] & ((uint32_t(1) << rest) - 1)) != 0;
}

void apply_token_mask(Encoder& e, const Buffer& logits, uint32_t vocab, const Buffer& mask) {
    const char* op = "apply_token_mask";
    check(vocab > 0, op, "vocab must be positive");
    check(vocab <= kMaxVocab, op, "vocab must be at most 2^24, got " + std::to_string(vocab));
    const uint64_t lb = uint64_t(vocab) * 4, mb = uint64_t(token_mask_words(vocab)) * 4;
    need(logits, lb, op, "logits");
    need(mask, mb, op, "mask");
    const SampleMaskParams k{vocab, 0};
    const char* kernel = "sample_token_mask";
    const uint32_t threads = fit_threads(e, kernel, std::min<uint32_t>(round32(vocab), SAMPLE_MASK_THREADS));
    e.dispatch(kernel, Dims{ceil_div(vocab, threads), 1, 1}, Dims{threads, 1, 1},
               {Arg::params(k), Arg::inout(logits.view(0, lb)), Arg::in(mask.view(0, mb))});
}

void argmax(Encoder& e, const Buffer& logits, uint32_t vocab, const Buffer& token, const Buffer& scratch) {
    const char* op = "argmax";
    check_common(op, logits, vocab, token, scratch);
    const SampleKernelParams k = base_params(vocab);
    const Buffer partials = encode_partials(e, k, logits, scratch);
    e.dispatch("argmax_final", Dims{1, 1, 1}, Dims{clamp_threads(k.n_partials, SAMPLE_PICK_THREADS), 1, 1},
               {Arg::params(k), Arg::in(partials), Arg::out(token.view(0, 4))});
}

void sample(Encoder& e, const Buffer& logits, uint32_t vocab, const SampleParams& p, const Buffer& token,
            const Buffer& scratch) {
    const char* op = "sample";
    check(std::isfinite(p.temperature) && p.temperature >= 0.0f, op,
          "temperature must be finite and >= 0, got " + std::to_string(p.temperature));
    check(p.top_p > 0.0f && p.top_p <= 1.0f, op, "top_p must be in (0, 1], got " + std::to_string(p.top_p));
    check(p.min_p >= 0.0f && p.min_p <= 1.0f, op, "min_p must be in [0, 1], got " + std::to_string(p.min_p));
    if (p.temperature == 0.0f) {  // greedy, as the host Sampler
        argmax(e, logits, vocab, token, scratch);
        return;
    }
    check_common(op, logits, vocab, token, scratch);
    SampleKernelParams k = base_params(vocab);
    k.top_k = p.top_k < vocab ? p.top_k : 0;  // the host's `top_k and top_k < size`
    const double inv_t = 1.0 / double(p.temperature);
    k.inv_temperature = inv_t > 3.4e38 ? 3.4e38f : float(inv_t);
    k.top_p = p.top_p;
    k.min_p = p.min_p;
    k.seed_lo = uint32_t(p.seed);
    k.seed_hi = uint32_t(p.seed >> 32);
    k.pos_lo = uint32_t(p.position);
    k.pos_hi = uint32_t(p.position >> 32);

    const Buffer partials = encode_partials(e, k, logits, scratch);
    const Buffer header = scratch.view(0, partials_offset());
    const uint64_t lb = uint64_t(vocab) * 4;
    const uint64_t levels = 8 + (k.idx_bits + 3) / 4;  // passes over the logits of one radix_select
    // sorted: the candidates after top-k fit in threadgroup memory
    const uint32_t n_cand = k.top_k ? k.top_k : vocab;
    if (n_cand <= SAMPLE_SORT_MAX) {
        const uint64_t passes = 1 + (k.top_k && vocab > SAMPLE_SORT_MAX ? levels : 0);
        e.dispatch("sample_sorted", Dims{1, 1, 1}, Dims{pick_threads(vocab), 1, 1},
                   {Arg::params(k), Arg::in(logits.view(0, lb), passes * lb), Arg::in(partials),
                    Arg::out(token.view(0, 4)), Arg::out(header)});
    } else {
        const uint64_t passes = 2 + levels * ((k.top_k ? 1 : 0) + (k.top_p < 1.0f ? 1 : 0) + 1);
        e.dispatch("sample_radix", Dims{1, 1, 1}, Dims{pick_threads(vocab), 1, 1},
                   {Arg::params(k), Arg::in(logits.view(0, lb), passes * lb), Arg::in(partials),
                    Arg::out(token.view(0, 4)), Arg::out(header)});
    }
}

}  // namespace qwenmetal::gpu::ops
