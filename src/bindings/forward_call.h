// What the two C++ backends' bindings share: float arrays handed to numpy, and the forward() call
// (the logits mode parsed, the output allocated, the compute run with the GIL released).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace qwenmetal::bindings {

inline nanobind::ndarray<nanobind::numpy, float> new_array(std::vector<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    float* p = new float[n ? n : 1];
    nanobind::capsule owner(p, [](void* q) noexcept { delete[] static_cast<float*>(q); });
    return nanobind::ndarray<nanobind::numpy, float>(p, shape.size(), shape.data(), owner);
}

// logits "none" / "last" / "all" -> 0 / 1 / 2; run(want, float* dst) fills [1 or n, vocab] (dst null for 0)
template <class Run>
nanobind::object forward_call(int64_t n, size_t vocab, const std::string& logits, Run&& run) {
    int want;
    if (logits == "none") want = 0;
    else if (logits == "last") want = 1;
    else if (logits == "all") want = 2;
    else throw std::invalid_argument("logits must be 'last', 'all' or 'none', got '" + logits + "'");
    nanobind::object out = nanobind::none();
    float* dst = nullptr;
    if (want) {
        auto arr = want == 2 ? new_array({size_t(n), vocab}) : new_array({vocab});
        dst = arr.data();
        out = nanobind::cast(arr);
    }
    {
        nanobind::gil_scoped_release release;
        run(want, dst);
    }
    return out;
}

}  // namespace qwenmetal::bindings
