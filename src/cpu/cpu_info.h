// What CPU this is: vendor, model, micro-architecture and the instruction-set features the kernels
// care about, detected once (cpuid + xgetbv on x86-64; getauxval / MIDR on Linux arm64, sysctl on
// Apple). This is the one place the engine asks the hardware; the kernel tables (kernels_*.cpp), the
// AMX check and the Python binding `_core.cpu_info()` all read it from here.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace qwenmetal::cpu {

// Features usable by this process: the CPU reports them and (x86) the OS saves their register state
// (XCR0), so an AVX-512 CPU under an OS without ZMM state support reports no avx512*.
struct CpuFeatures {
    bool avx2 = false, fma = false, f16c = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
    bool avx512_vnni = false, avx512_bf16 = false, avx_vnni = false, gfni = false;
    // AMX: the CPU has the tile unit and the OS enables tile state in XCR0; a process must still ask
    // for the tile data permission before using it (amx_available() in amx.h)
    bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
    bool asimd = false, dotprod = false, i8mm = false, bf16 = false;   // arm64
    bool avx512_core() const { return avx512f && avx512bw && avx512vl && avx512dq && fma && f16c; }
    bool avx2_core() const { return avx2 && fma && f16c; }
};

struct CpuInfo {
    std::string vendor;       // "GenuineIntel", "AuthenticAMD", "Apple", "ARM", ... or "unknown"
    std::string model_name;   // the brand string (x86 cpuid 0x80000002-4, Apple sysctl) or "unknown"
    int family = 0, model = 0, stepping = 0;   // x86: display family/model; arm64: MIDR implementer/part
    // e.g. "sapphirerapids", "icelake-server", "alderlake", "zen4", "neoverse-v1", "apple-m2", "unknown"
    std::string uarch;
    CpuFeatures f;
    // the /proc/cpuinfo-style names of the features present (avx2, avx512_vnni, amx_int8, dotprod, ...)
    std::vector<std::string> feature_names() const;
};

// detected at the first call (thread-safe static init), then fixed
const CpuInfo& cpu_info();

// The variant each kernel family uses now (it follows the forcing switches: set_isa, set_vnni,
// set_vnni_gemm, set_amx, set_neon_dot): {"gemv", "avx512"}, {"gemv_int", "avx512-vnni"}, {"gemm_int", "amx"}, ...
std::vector<std::pair<std::string, std::string>> kernel_choices();

}  // namespace qwenmetal::cpu
