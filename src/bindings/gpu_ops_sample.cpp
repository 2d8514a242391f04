// gpu.ops: sample family (metal/sample.metal, src/gpu/ops/sample.cpp).
#include "bindings/gpu.h"
#include "gpu/ops/sample.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qwenmetal::bindings {

void register_gpu_ops_sample(nb::module_& ops) {
    ops.def("argmax", &gpu::ops::argmax, "encoder"_a, "logits"_a, "vocab"_a, "token"_a, "scratch"_a,
            "token[0] (uint32) = the lowest index of the largest of logits[:vocab] (float32); scratch: "
            "sample_scratch_bytes(vocab) bytes.");
    ops.def("apply_token_mask", &gpu::ops::apply_token_mask, "encoder"_a, "logits"_a, "vocab"_a, "mask"_a,
            "logits[i] (float32, in place) = -inf for every i < vocab whose bit i % 32 of mask word i / 32 (uint32, "
            "token_mask_words(vocab) of them) is 0: a grammar's token bitmask before argmax() or sample().");
    ops.def("token_mask_words", &gpu::ops::token_mask_words, "vocab"_a,
            "uint32 words of a token bitmask over `vocab` tokens: ceil(vocab / 32).");
    ops.def("sample_scratch_bytes", &gpu::ops::sample_scratch_bytes, "vocab"_a,
            "Bytes of scratch argmax() and sample() need for `vocab` logits.");
    ops.def("sample", [](gpu::Encoder& e, const gpu::Buffer& logits, uint32_t vocab, const gpu::Buffer& token,
                         const gpu::Buffer& scratch, float temperature, uint32_t top_k, float top_p, float min_p,
                         uint64_t seed, uint64_t position) {
        gpu::ops::SampleParams p;
        p.temperature = temperature;
        p.top_k = top_k;
        p.top_p = top_p;
        p.min_p = min_p;
        p.seed = seed;
        p.position = position;
        gpu::ops::sample(e, logits, vocab, p, token, scratch);
    }, "encoder"_a, "logits"_a, "vocab"_a, "token"_a, "scratch"_a, nb::kw_only(), "temperature"_a = 1.0f,
       "top_k"_a = 0u, "top_p"_a = 1.0f, "min_p"_a = 0.0f, "seed"_a = 0u, "position"_a = 0u,
       "token[0] (uint32) = a draw from softmax(logits[:vocab] / temperature) restricted by top_k, then "
       "top_p, then min_p (the host Sampler's order), with Philox-4x32-10 keyed by (seed, position); "
       "temperature 0 is argmax. scratch: sample_scratch_bytes(vocab) bytes; its first 16 uint32 words "
       "hold the draw's details (metal/sample.h, SAMPLE_H_*).");
}

}  // namespace qwenmetal::bindings
