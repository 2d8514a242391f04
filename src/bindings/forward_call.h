// What the two C++ backends' bindings share: float arrays handed to numpy, the forward() call (the
// logits mode parsed, the output allocated, the compute run with the GIL released), the interrupt
// poll the engines call between chunks / tokens / steps, and the session token list a call appends
// its consumed tokens to before control returns to Python, and a prefill's explicit positions / embedding rows.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/interrupt.h"
#include "core/row_inputs.h"

namespace qwenmetal::bindings {

inline nanobind::ndarray<nanobind::numpy, float> new_array(std::vector<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    float* p = new float[n ? n : 1];
    nanobind::capsule owner(p, [](void* q) noexcept { delete[] static_cast<float*>(q); });
    return nanobind::ndarray<nanobind::numpy, float>(p, shape.size(), shape.data(), owner);
}

// The engines' InterruptPoll: take the GIL, run the interpreter's pending signal handlers and throw
// what one raised (KeyboardInterrupt for a Ctrl-C) as nanobind::python_error.
inline void check_signals() {
    nanobind::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw nanobind::python_error();
}

// The poll for a call made now (GIL held): check_signals on the thread Python runs signal handlers in
// (the main thread); none elsewhere (a worker thread would only contend for the GIL).
inline InterruptPoll interrupt_poll() { return _PyOS_IsMainThread() ? &check_signals : nullptr; }

// A session's token list (or None) that a call appends the tokens its state consumed to, under the GIL
// before returning, so no interrupt can land between the C++ state advancing and its tokens following.
// Checked before the compute, so a wrong argument fails with the state untouched.
class Consumed {
  public:
    explicit Consumed(nanobind::handle h) {
        if (h.is_none()) return;
        if (!PyList_Check(h.ptr())) throw nanobind::type_error("consumed must be a list (a session's tokens)");
        list_ = nanobind::borrow(h);
    }
    template <class T>
    void append(const T* tokens, size_t n) {
        if (!list_.is_valid()) return;
        for (size_t i = 0; i < n; ++i)
            if (PyList_Append(list_.ptr(), nanobind::int_(int64_t(tokens[i])).ptr()) != 0)
                throw nanobind::python_error();      // out of memory: nothing else can fail here
    }

  private:
    nanobind::object list_;                          // null: None was passed
};

// A forward() call's explicit RoPE positions / embedding rows (qwenmetal.mrope.RowInputs) from its arguments
// pair_pos (int32 [n, half]), embed_rows (int64 [m]), embeds (float32 [m, hidden]) and rope_delta (the state's
// delta after the call; None: `state_delta`, the state's own): shapes checked here, values by the engine; the
// arrays are held while the call runs. get(): null when none of pair_pos, embeds, rope_delta is given.
class RowArgs {
  public:
    RowArgs(nanobind::handle pair_pos, nanobind::handle embed_rows, nanobind::handle embeds,
            nanobind::handle rope_delta, int64_t n, int64_t half, int64_t hidden, int64_t state_delta) {
        given_ = !(pair_pos.is_none() && embeds.is_none() && rope_delta.is_none());
        if (!given_) return;
        r_.rope_delta = rope_delta.is_none() ? state_delta : nanobind::cast<int64_t>(rope_delta);
        if (!pair_pos.is_none()) {
            pp_ = nanobind::cast<Arr<int32_t, 2>>(pair_pos);
            if (int64_t(pp_->shape(0)) != n || int64_t(pp_->shape(1)) != half)
                throw std::invalid_argument("pair_pos must be int32 [" + std::to_string(n) + ", " +
                                            std::to_string(half) + "]");
            r_.pair_pos = pp_->data();
        }
        if (!embeds.is_none()) {
            ev_ = nanobind::cast<Arr<float, 2>>(embeds);
            er_ = nanobind::cast<Arr<int64_t, 1>>(embed_rows);
            if (int64_t(ev_->shape(1)) != hidden || ev_->shape(0) != er_->shape(0))
                throw std::invalid_argument("embeds must be float32 [m, " + std::to_string(hidden) +
                                            "] for m embed_rows");
            r_.n_embeds = int64_t(ev_->shape(0));
            r_.embed_rows = er_->data();
            r_.embeds = ev_->data();
        }
    }
    const RowInputs* get() const { return given_ ? &r_ : nullptr; }

  private:
    template <class T, size_t N>
    using Arr = nanobind::ndarray<const T, nanobind::ndim<N>, nanobind::c_contig, nanobind::device::cpu>;
    bool given_ = false;
    RowInputs r_;
    std::optional<Arr<int32_t, 2>> pp_;
    std::optional<Arr<int64_t, 1>> er_;
    std::optional<Arr<float, 2>> ev_;
};

// logits "none" / "last" / "all" -> 0 / 1 / 2; run(want, float* dst, poll) fills [1 or n, vocab] (dst
// null for 0); the n ids are appended to `consumed` when run returns
template <class Run>
nanobind::object forward_call(const int64_t* ids, int64_t n, size_t vocab, const std::string& logits,
                              nanobind::handle consumed, Run&& run) {
    int want;
    if (logits == "none") want = 0;
    else if (logits == "last") want = 1;
    else if (logits == "all") want = 2;
    else throw std::invalid_argument("logits must be 'last', 'all' or 'none', got '" + logits + "'");
    Consumed sink(consumed);
    nanobind::object out = nanobind::none();
    float* dst = nullptr;
    if (want) {
        auto arr = want == 2 ? new_array({size_t(n), vocab}) : new_array({vocab});
        dst = arr.data();
        out = nanobind::cast(arr);
    }
    const InterruptPoll poll = interrupt_poll();
    {
        nanobind::gil_scoped_release release;
        run(want, dst, poll);
    }
    sink.append(ids, size_t(n));
    return out;
}

// A batched step over B sessions: `states` (a list of B engine states, cast to S*), `consumed` None or a
// list of B session token lists; run(S* const* states, float* dst [B, vocab]) runs with the GIL released,
// then ids[r] is appended to consumed[r]. Everything is checked before the compute.
template <class S, class Run>
nanobind::object batch_call(nanobind::list states, const int64_t* ids, int64_t n, size_t vocab,
                            nanobind::handle consumed, Run&& run) {
    if (int64_t(nanobind::len(states)) != n)
        throw std::invalid_argument("decode_batch: " + std::to_string(nanobind::len(states)) + " states for " +
                                    std::to_string(n) + " ids");
    std::vector<S*> ptrs;
    for (nanobind::handle h : states) ptrs.push_back(&nanobind::cast<S&>(h));
    std::vector<Consumed> sinks;
    if (!consumed.is_none()) {
        if (!PyList_Check(consumed.ptr()) || PyList_GET_SIZE(consumed.ptr()) != n)
            throw nanobind::type_error("consumed must be None or a list of one token list per state");
        for (int64_t r = 0; r < n; ++r) sinks.emplace_back(nanobind::handle(PyList_GET_ITEM(consumed.ptr(), r)));
    }
    auto arr = new_array({size_t(n > 0 ? n : 0), vocab});
    {
        nanobind::gil_scoped_release release;
        run(ptrs.data(), arr.data());
    }
    for (size_t r = 0; r < sinks.size(); ++r) sinks[r].append(ids + r, 1);
    return nanobind::cast(arr);
}

// rewind(): run() rolls the state back by `drop` tokens, which leave the session's token list `consumed`
// (or None) in the same call, so the tokens and the state cannot part; the list is checked first
template <class Run>
void rewind_call(int64_t drop, nanobind::handle consumed, Run&& run) {
    if (!consumed.is_none()) {
        if (!PyList_Check(consumed.ptr())) throw nanobind::type_error("consumed must be a list (a session's tokens)");
        if (drop > 0 && PyList_GET_SIZE(consumed.ptr()) < drop)
            throw std::invalid_argument("consumed holds fewer tokens than the rewind drops");
    }
    {
        nanobind::gil_scoped_release release;
        run();
    }
    if (!consumed.is_none() && drop > 0) {
        const Py_ssize_t len = PyList_GET_SIZE(consumed.ptr());
        if (PyList_SetSlice(consumed.ptr(), len - drop, len, nullptr) != 0) throw nanobind::python_error();
    }
}

}  // namespace qwenmetal::bindings
