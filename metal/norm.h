// norm family: parameters shared by metal/norm.metal and its host functions (src/gpu/ops/norm.cpp).
#pragma once
#ifndef __METAL_VERSION__
#include <cstdint>
#endif

struct NormParams {
    uint32_t H;     // elements per row
    float eps;      // added to mean(x^2)
};
static_assert(sizeof(NormParams) == 8, "NormParams: 2 x 4 bytes, as the host packs it");

struct CopyParams {
    uint32_t H;     // elements per row
};
static_assert(sizeof(CopyParams) == 4, "CopyParams: 4 bytes, as the host packs it");

// one threadgroup per row; threads: about H / 4, a multiple of 32, at most NORM_MAX_THREADS
#define NORM_MAX_THREADS 1024u
