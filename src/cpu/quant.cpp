#include "cpu/quant.h"

namespace qwenmetal::cpu {

void dequantize_affine(const uint32_t* w, const float* scales, const float* biases, float* out,
                       size_t rows, size_t in_features, int bits, int group_size) {
    const size_t per_word = 32 / bits;
    const size_t words = in_features / per_word;
    const size_t groups = in_features / group_size;
    const uint32_t mask = (1u << bits) - 1u;
    for (size_t r = 0; r < rows; ++r) {
        const uint32_t* wr = w + r * words;
        const float* sr = scales + r * groups;
        const float* br = biases + r * groups;
        float* o = out + r * in_features;
        for (size_t k = 0; k < words; ++k) {
            uint32_t word = wr[k];
            const size_t base = k * per_word;
            const size_t g = base / group_size;  // a word never straddles a group (group_size % per_word == 0)
            const float s = sr[g], b = br[g];
            for (size_t j = 0; j < per_word; ++j) {
                o[base + j] = s * static_cast<float>(word & mask) + b;
                word >>= bits;
            }
        }
    }
}

}  // namespace qwenmetal::cpu
