// Denormal (subnormal) floats are flushed to zero while the CPU engine computes (x86-64).
//
// An x86 core takes a microcode assist (on the order of 100 cycles) for each SIMD operation with a
// denormal input or result. The chunked Gated DeltaNet produces them routinely: its decays
// exp(G_i - G_j) over a chunk, and a state that decays over many tokens, fall below FLT_MIN for heads
// with a strong decay (measured: one head of 512 tokens at 128x128, 1.7 ms with a weak decay, 19 ms with
// a strong one, before this). FTZ | DAZ in MXCSR makes such results and inputs zero; what changes is
// below 1.2e-38 in absolute value. ARM cores (NEON) handle denormals at full speed: nothing is changed
// there.
//
// The compute pool's workers set it for their lifetime (ThreadPool::worker); a calling thread sets it
// only for the duration of a call (FlushDenormals, restoring its own mode), so the caller's process
// (numpy, the user's code) keeps IEEE denormals.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace qwenmetal {

#if defined(__x86_64__) || defined(_M_X64)
constexpr unsigned kMxcsrFlushDenormals = 0x8040;   // FTZ (bit 15) | DAZ (bit 6)

inline void flush_denormals_this_thread() { _mm_setcsr(_mm_getcsr() | kMxcsrFlushDenormals); }

class FlushDenormals {
public:
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kMxcsrFlushDenormals); }
    ~FlushDenormals() { _mm_setcsr(saved_); }
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;

private:
    unsigned saved_;
};
#else
inline void flush_denormals_this_thread() {}

class FlushDenormals {   // nothing to change; user-provided so that a guard variable is not "unused"
public:
    FlushDenormals() {}
    ~FlushDenormals() {}
    FlushDenormals(const FlushDenormals&) = delete;
    FlushDenormals& operator=(const FlushDenormals&) = delete;
};
#endif

}  // namespace qwenmetal
