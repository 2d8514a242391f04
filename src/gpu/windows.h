// Overlapping windows over a host range larger than the device's maximum buffer length.
//
// Metal caps one MTLBuffer at maxBufferLength (on a Mac with little memory, less than a safetensors shard
// of the 35B model). Rather than copy such a shard, MetalDevice::wrap maps it as several buffers over
// overlapping windows of its pages, so that every tensor of the shard lies whole inside one of them: a view
// is bound from the window that contains it. `plan_windows` decides the windows, `window_of` finds a view's.
// Pure arithmetic, shared by the device and the tests (gpu.plan_windows).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace qwenmetal::gpu {

struct Window {
    uint64_t start = 0, length = 0;   // bytes from the (page-aligned) base of the range
};

// Windows of at most `max_len` bytes (whole pages) covering [0, bytes), each starting a whole number of
// pages after the previous and overlapping it by at least `max_view` bytes, so that any range of at most
// `max_view` bytes lies inside one window. One window when the range fits one buffer. Throws
// std::invalid_argument when max_view leaves no room to advance (max_view + page > max_len).
inline std::vector<Window> plan_windows(uint64_t bytes, uint64_t max_len, uint64_t max_view, uint64_t page) {
    if (page == 0 || max_len < page) throw std::invalid_argument("plan_windows: max_len must hold a page");
    const uint64_t len = max_len / page * page;
    if (bytes <= len) return {Window{0, bytes}};
    if (max_view + page > len)
        throw std::invalid_argument("plan_windows: a view of " + std::to_string(max_view) + " bytes cannot be mapped "
                                    "within buffers of at most " + std::to_string(max_len) + " bytes");
    const uint64_t step = (len - max_view) / page * page;
    std::vector<Window> w;
    for (uint64_t s = 0;; s += step) {
        w.push_back(Window{s, bytes - s < len ? bytes - s : len});
        if (s + len >= bytes) break;
    }
    return w;
}

// The window holding [offset, offset + length) whole (the last such: every view of at most max_view bytes has
// one), or SIZE_MAX.
inline size_t window_of(const std::vector<Window>& w, uint64_t offset, uint64_t length) {
    for (size_t i = w.size(); i-- > 0;)
        if (w[i].start <= offset && offset + length <= w[i].start + w[i].length) return i;
    return SIZE_MAX;
}

}  // namespace qwenmetal::gpu
