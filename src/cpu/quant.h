// MLX affine quantization (model-spec §3): value = scale * q + bias per group of `group_size`
// consecutive inputs of a row; q packed LSB-first into uint32 words (8 per word at 4 bits,
// 4 per word at 8 bits).
#pragma once
#include <cstddef>
#include <cstdint>

namespace qwenmetal::cpu {

// Dequantize `rows` rows of `in_features` values into float32 `out` [rows, in_features].
// w: [rows, in_features * bits / 32]; scales, biases: [rows, in_features / group_size].
void dequantize_affine(const uint32_t* w, const float* scales, const float* biases, float* out,
                       size_t rows, size_t in_features, int bits, int group_size);

}  // namespace qwenmetal::cpu
