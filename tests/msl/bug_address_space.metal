// Planted bug (tests/test_msl_check.py): address-space mix-ups that compile silently in the
// simulator (where device/threadgroup are empty macros) but not in Metal; clang's check mode
// (tools/msl_check.py) must reject every one of them.
#include <metal_stdlib>
using namespace metal;

inline float load_device(device const float* p, uint i) { return p[i]; }

template <typename T>
kernel void as_mixup(device const T* x [[buffer(0)]], device T* y [[buffer(1)]], constant uint& n [[buffer(2)]],
                     uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float tile[64];
    tile[tid] = float(x[tid]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    device float* out = tile;                            // BUG:tg-to-device  threadgroup array used as a device pointer
    thread float* local = x;                             // BUG:device-to-thread  device pointer into a thread pointer
    float v = load_device(tile, tid);                    // BUG:tg-arg  threadgroup memory passed for a device parameter
    n = 3;                                               // BUG:write-constant  writing through constant
    y[tid] = T(v + out[0] + local[0]);
}
INSTANTIATE_KERNEL("as_mixup_f32", as_mixup, float)
