// The vision tower (Qwen3.5/3.6's ViT, docs/vision.md) on the Metal graph: the float32 computation of
// python/qwenmetal/backends/reference_vision.py's VisionTower over the device interface (gpu/device.h), so it runs
// on MetalDevice and SimDevice alike, from the prefill kernels and the vision family's own:
//
//   x = patch_embed(pixels) (gemm over all patches)                 [n, H]
//   x = (x + b) + pos_embed taps (vision_pos_embed: 4 host-computed bilinear taps per patch into the learned table)
//   for each block:
//       h = layer_norm(x, norm1)                                    (norm family)
//       qkv = gemm(h, attn.qkv)                                     [n, 3H]
//       q, K, V = vision_rope(qkv + bias)                           2-D rotary by host-computed cos/sin rows
//       mix = attention_prefill(q) without the causal mask, one dispatch per (frame of an) image, or per block of
//             its query rows when the watchdog budget asks for it (every block sees all the frame's keys)
//       x += proj(mix) (gemm, residual fused); x += proj.bias       (vision_bias_act)
//       h = layer_norm(x, norm2)
//       a = gelu_tanh(fc1(h) + b)                                   (gemm, vision_bias_act)
//       x += fc2(a) (residual fused); x += fc2.bias
//   h = layer_norm(x, merger.norm) read as [n / m^2, m^2 H] (the processor's rows are already in merge-block order)
//   out = fc2(gelu_erf(fc1(h) + b)) + b                             [n / m^2, out_hidden]
//
// A call is one encoder whose command buffers the watchdog budget (GpuOptions::command_buffer_seconds of the
// engine, gpu/cost.h) cuts, committed back to back with no host wait between them; the host writes the pixels,
// the taps and the cos/sin tables first and reads the merged rows back at the end. Weights are bound in place
// (bf16, f32, or MLX affine 2..8-bit: WeightBinder); the biases, norms and the position table are converted to
// the activation type once. The engine (a GpuEngine: its device, activation type, GEMM route, budget) must
// outlive the tower; a call holds the engine's lock (GpuEngine::exclusive).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/weights.h"
#include "gpu/model.h"

namespace qwenmetal::gpu {

// The tower's dimensions, from config.json's vision_config (python/qwenmetal/config.py, VisionConfig)
struct VisionShape {
    uint32_t depth = 0, hidden = 0, heads = 0, inter = 0;
    uint32_t patch_dim = 0;            // in_channels * temporal_patch_size * patch_size^2
    uint32_t merge = 0;                // spatial_merge_size
    uint32_t out_hidden = 0;
    uint32_t grid_side = 0;            // sqrt(num_position_embeddings)
    double rope_theta = 10000.0;
    bool gelu_tanh = true;             // the blocks' activation: gelu_pytorch_tanh, else the exact gelu
    float eps = 1e-6f;
    uint32_t head_dim() const { return heads ? hidden / heads : 0; }
    uint32_t merged_dim() const { return hidden * merge * merge; }
};

class GpuVision {
  public:
    // `w`: the tower's canonical tensors (qwenmetal.weights, Weights.vision). std::invalid_argument for a missing
    // or misshapen tensor or a shape the kernels do not take.
    GpuVision(GpuEngine& engine, const VisionShape& shape, const WeightTable& w);
    GpuVision(const GpuVision&) = delete;
    GpuVision& operator=(const GpuVision&) = delete;
    ~GpuVision();

    const VisionShape& shape() const { return s_; }
    uint64_t weight_bytes() const { return weight_bytes_; }
    uint64_t copied_bytes() const { return copied_bytes_; }
    // rows of the output for `grid` (n_images x (t, h, w)); std::invalid_argument for a grid the tower refuses
    int64_t merged_rows(const int64_t* grid, int64_t n_images) const;
    // One call: pixels f32 [n_patches, patch_dim] (each image's patches in merge-block order), grid int64
    // [n_images, 3]; writes out f32 [merged_rows, out_hidden] (caller-allocated). The command buffers of the
    // last call: last_command_buffers().
    void encode(const float* pixels, const int64_t* grid, int64_t n_images, float* out);
    uint64_t last_command_buffers() const { return last_cbs_; }
    // Encode, commit and wait one call for `grid` (pixels not written, nothing read back): what it cost. For
    // encode-only costing.
    StepCost cost(const int64_t* grid, int64_t n_images);

  private:
    struct Block {
        Buffer norm1, norm1_b, norm2, norm2_b;        // T [H]
        Matrix qkv, proj, fc1, fc2;                   // [3H, H], [H, H], [I, H], [H, I]
        Buffer qkv_b, proj_b, fc1_b, fc2_b;           // T [3H], [H], [I], [H]
    };
    struct Scratch;
    int64_t check_grid(const int64_t* grid, int64_t n_images) const;   // patches
    void ensure(uint32_t n);
    void write_tables(const int64_t* grid, int64_t n_images);
    void encode_all(Encoder& e, const int64_t* grid, int64_t n_images, uint32_t n);

    GpuEngine& engine_;
    VisionShape s_;
    Act act_;
    Matrix patch_, m_fc1_, m_fc2_;
    Buffer patch_b_, pos_, m_norm_, m_norm_b_, m_fc1_b_, m_fc2_b_;
    std::vector<Block> blocks_;
    std::unique_ptr<Scratch> sc_;
    uint64_t weight_bytes_ = 0, copied_bytes_ = 0, last_cbs_ = 0;
};

}  // namespace qwenmetal::gpu
