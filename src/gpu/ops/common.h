// What every host op function (src/gpu/ops/<family>.cpp) shares: the activation type a kernel is
// instantiated for, the kernel-name suffixes, and the argument checks. A host function checks
// shapes and dtypes, picks the variant, fills the params struct of metal/<family>.h, computes the
// grid and encodes one dispatch; tests reach kernels only through these functions.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "gpu/device.h"
#include "gpu/encoder.h"

namespace qwenmetal::gpu {

// Element type of activations (and of small per-channel weights such as norm gains).
// F32: exact tests against the float32 reference; BF16: production.
enum class Act : uint8_t { F32 = 0, BF16 = 1 };

inline const char* act_suffix(Act a) { return a == Act::F32 ? "f32" : "bf16"; }
inline uint64_t act_size(Act a) { return a == Act::F32 ? 4 : 2; }
inline Act parse_act(const std::string& s) {
    if (s == "f32" || s == "float32") return Act::F32;
    if (s == "bf16" || s == "bfloat16") return Act::BF16;
    throw std::invalid_argument("activation type must be 'float32' or 'bfloat16', got '" + s + "'");
}

// `b` must hold at least `bytes` bytes; `what` names the op and the argument in the error
inline void need(const Buffer& b, uint64_t bytes, const char* op, const char* what) {
    if (!b.valid()) throw std::invalid_argument(std::string(op) + ": " + what + " is not set");
    if (b.length < bytes)
        throw std::invalid_argument(std::string(op) + ": " + what + " holds " + std::to_string(b.length) +
                                    " bytes, needs " + std::to_string(bytes));
}

// Threads of a 1-D threadgroup of `kernel`: `want`, capped by the pipeline's maxTotalThreadsPerThreadgroup
// (Metal lowers it below 1024 for register-heavy pipelines), in whole SIMD-groups. For kernels that loop
// over their work by the threadgroup size; a kernel that needs an exact size declares
// [[kernel, max_total_threads_per_threadgroup(N)]] instead, and its pipeline then allows N.
inline uint32_t fit_threads(Encoder& e, const std::string& kernel, uint32_t want) {
    const uint32_t cap = e.device().max_threads(kernel) / 32 * 32;
    const uint32_t t = want < cap ? want : cap;
    return t < 32 ? 32 : t;
}

inline void check(bool ok, const char* op, const std::string& msg) {
    if (!ok) throw std::invalid_argument(std::string(op) + ": " + msg);
}

// An output that may be its input (in place) or another buffer, but never a partial overlap of the
// first `bytes` of each; returns true for in place.
inline bool same_or_disjoint(const Buffer& out, const Buffer& in, uint64_t bytes, const char* op, const char* what,
                             const char* of) {
    const bool same = out.address() == in.address();
    check(same || out.address() + bytes <= in.address() || in.address() + bytes <= out.address(), op,
          std::string(what) + " must be " + of + " itself or not overlap it");
    return same;
}

}  // namespace qwenmetal::gpu
