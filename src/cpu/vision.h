// The vision tower of Qwen3.5/3.6 (docs/vision.md, "The vision tower on the cpu engine"): the computation of
// python/qwenmetal/backends/reference_vision.py `VisionTower` in C++ on the engine's kernels and threads.
//
//   patch embedding    x = pixels W^T + b                      (cpu::linear, GEMM over all patches)
//   positions          x += bilinear taps of the learned table  (align_corners, 4 taps per patch)
//   depth blocks       x += proj(attn(rope2d(qkv(LN1 x))))      (attention per frame of each image, flash-style
//                      x += fc2(gelu_tanh(fc1(LN2 x)))           over key blocks, as GEMMs on the kernels)
//   merger             fc2(gelu_erf(fc1(LN(x) as [n/4, 4H])))   -> [n_merged, out_hidden]
//
// Linear weights are read in place, as the checkpoint stores them (bf16 / f16 / f32, or MLX-quantized);
// biases, norms and the position table are copied to float32 at construction. Activations are float32
// throughout; GEMMs run in row chunks of kVisionChunk patches (the GEMM inputs' prepared copies stay small).
// Work splits over threads by output rows (GEMMs, row-wise ops) and by (frame, head, query block)
// (attention); each output is computed the same way whatever the thread count.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/threadpool.h"
#include "cpu/quant.h"
#include "cpu/tensor.h"

namespace qwenmetal::cpu {

struct VisionDims {
    int64_t hidden = 0, heads = 0, head_dim = 0, inter = 0, depth = 0;
    int64_t in_channels = 0, temporal_patch = 0, patch = 0;   // patch_dim = C * T * P * P
    int64_t merge = 0;           // spatial_merge_size
    int64_t side = 0;            // the position table is side x side
    int64_t out_hidden = 0;
    bool gelu_tanh = true;       // block MLP activation: gelu_pytorch_tanh, else exact (erf) GELU
    double rope_theta = 10000.0;
    float eps = 1e-6f;           // LayerNorm
    int64_t patch_dim() const { return in_channels * temporal_patch * patch * patch; }
    int64_t merged_dim() const { return hidden * merge * merge; }
};

struct VisionBlock {
    std::vector<float> norm1, norm1_b, norm2, norm2_b;
    WMat qkv, proj, fc1, fc2;
    std::vector<float> qkv_b, proj_b, fc1_b, fc2_b;
};

struct VisionWeights {
    WMat patch;                              // [hidden, patch_dim]
    std::vector<float> patch_b;              // [hidden]
    std::vector<float> pos_embed;            // [side*side, hidden]
    std::vector<VisionBlock> blocks;
    std::vector<float> merger_norm, merger_norm_b;
    WMat merger_fc1, merger_fc2;             // [4H, 4H], [out_hidden, 4H]
    std::vector<float> merger_fc1_b, merger_fc2_b;
};

constexpr int64_t kVisionChunk = 256;         // patch rows per GEMM call
constexpr int64_t kVisionQueryBlock = 32;     // query rows per attention task (they share each key block)
constexpr int64_t kVisionMaxPatches = int64_t(1) << 20;   // as reference_vision.MAX_VISION_PATCHES

class VisionTower {
public:
    // Throws std::invalid_argument when a dimension is inconsistent or a weight's shape disagrees with `d`.
    VisionTower(const VisionDims& d, VisionWeights w);
    VisionTower(const VisionTower&) = delete;
    VisionTower& operator=(const VisionTower&) = delete;

    const VisionDims& dims() const { return d_; }
    size_t weight_bytes() const;

    // Throws std::invalid_argument (nothing computed) unless grid [n_images][3] (t, h, w) are positive, h and
    // w multiples of merge, the patches sum to n_patches (<= kVisionMaxPatches); returns the merged rows.
    int64_t check(int64_t n_patches, const int64_t* grid, int64_t n_images) const;
    // pixels [n_patches, patch_dim] -> out [check(...), out_hidden]. Scratch grows on the first large call.
    void encode(ThreadPool& pool, const float* pixels, int64_t n_patches, const int64_t* grid, int64_t n_images,
                float* out);

private:
    void gemm(ThreadPool& pool, const WMat& W, const std::vector<float>& bias, const float* X, int64_t M,
              int64_t ldx, float* Y, int64_t ldy, bool accumulate);
    void layer_norm(ThreadPool& pool, const float* x, int64_t rows, const std::vector<float>& w,
                    const std::vector<float>& b, float* out);
    void attention(ThreadPool& pool, const float* qkv, const std::vector<int64_t>& bounds, int64_t n, float* out);

    VisionDims d_;
    VisionWeights w_;
    Workspace ws_;
    FBuf x_, h_, qkv_, att_, mlp_, cos_, sin_;
};

}  // namespace qwenmetal::cpu
