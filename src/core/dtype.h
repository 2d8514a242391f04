// Element types of checkpoint tensors and the scalar conversions every C++ part shares.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace qwenmetal {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

inline size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// round to nearest even (NaN kept quiet)
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else {                       // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) { mant <<= 1; --exp; }
            mant &= 0x3ffu;
            u = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float load_scalar(const void* p, DType d, size_t i) {
    switch (d) {
        case DType::F32: return static_cast<const float*>(p)[i];
        case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
        default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
}

}  // namespace qwenmetal
