// CPU identification (cpu_info.h): cpuid/xgetbv on x86-64, getauxval + MIDR_EL1 on Linux arm64,
// sysctl on Apple; the family/model -> micro-architecture tables.
#include "cpu/cpu_info.h"

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cpu/amx.h"
#include "cpu/gemm_vnni.h"
#include "cpu/kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QM_X86 1
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace qwenmetal::cpu {

namespace {

#if QM_X86
struct IntelModel {
    int model;
    const char* name;
};
// Intel family 6 display models (Intel SDM vol. 4 table 2-1 and the kernel's intel-family.h)
constexpr IntelModel kIntel[] = {
    {0x3C, "haswell"},        {0x3F, "haswell"},          {0x45, "haswell"},         {0x46, "haswell"},
    {0x3D, "broadwell"},      {0x47, "broadwell"},        {0x4F, "broadwell"},       {0x56, "broadwell"},
    {0x4E, "skylake"},        {0x5E, "skylake"},          {0x8E, "skylake"},         {0x9E, "skylake"},
    {0xA5, "skylake"},        {0xA6, "skylake"},          {0x55, "skylake-server"},  {0x66, "cannonlake"},
    {0x7D, "icelake-client"}, {0x7E, "icelake-client"},   {0x6A, "icelake-server"},  {0x6C, "icelake-server"},
    {0x8C, "tigerlake"},      {0x8D, "tigerlake"},        {0xA7, "rocketlake"},      {0x97, "alderlake"},
    {0x9A, "alderlake"},      {0xBE, "alderlake"},        {0xB7, "raptorlake"},      {0xBA, "raptorlake"},
    {0xBF, "raptorlake"},     {0xAA, "meteorlake"},       {0xAC, "meteorlake"},      {0xBD, "lunarlake"},
    {0xC5, "arrowlake"},      {0xC6, "arrowlake"},        {0x8F, "sapphirerapids"},  {0xCF, "emeraldrapids"},
    {0xAD, "graniterapids"},  {0xAE, "graniterapids"},    {0xAF, "sierraforest"},    {0xB6, "grandridge"},
};

// The micro-architecture the features imply, for models the table lacks and for virtual machines whose
// cpuid model does not match the features they pass through (a hypervisor may show a Sapphire Rapids
// with AMX as model 0xA7, a Rocket Lake, which has no AMX): the newest Intel generation with that set
std::string intel_by_features(const CpuFeatures& f) {
    if (f.amx_tile) return "sapphirerapids";
    if (f.avx512_core() && f.avx512_vnni) return f.avx512_bf16 ? "cooperlake" : "icelake-server";
    if (f.avx512_core()) return "skylake-server";
    if (f.avx_vnni) return "alderlake";
    if (f.avx2_core()) return "haswell";
    return "unknown";
}

std::string intel_uarch(int family, int model, int stepping, const CpuFeatures& f) {
    if (family != 6) return intel_by_features(f);
    std::string name;
    for (const IntelModel& m : kIntel)
        if (m.model == model) name = m.name;
    if (name == "skylake-server")   // one model, three generations told apart by stepping
        name = stepping >= 10 ? "cooperlake" : stepping >= 5 ? "cascadelake" : "skylake-server";
    const bool server_amx = name == "sapphirerapids" || name == "emeraldrapids" || name == "graniterapids";
    const bool has512 = name.find("server") != std::string::npos || name == "cascadelake" || name == "cooperlake" ||
                        name == "cannonlake" || name == "icelake-client" || name == "tigerlake" ||
                        name == "rocketlake" || server_amx;
    // a model the table lacks, or one the features contradict (see intel_by_features); client chips
    // with AVX-512 fused off (Alder Lake and later) are consistent with has512 = false
    if (name.empty() || server_amx != f.amx_tile || (f.avx512f && !has512)) return intel_by_features(f);
    return name;
}

std::string amd_uarch(int family, int model, const CpuFeatures& f) {
    if (family == 0x17)
        return (model >= 0x30 || model == 0x47) ? "zen2" : "zen";   // 0x00-0x2F: Zen / Zen+
    if (family == 0x19) {   // Zen 3 and Zen 4 share family 0x19; Zen 4 is the one with AVX-512
        const bool zen4_model = (model >= 0x10 && model <= 0x1F) || (model >= 0x60 && model <= 0x7F) ||
                                (model >= 0xA0 && model <= 0xAF);
        return zen4_model || f.avx512f ? "zen4" : "zen3";
    }
    if (family == 0x1A) return "zen5";
    if (family == 0x18) return "zen";   // Hygon Dhyana
    return "unknown";
}

void detect_x86(CpuInfo& ci) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return;
    const unsigned max_leaf = a;
    char vendor[13];
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    vendor[12] = 0;
    ci.vendor = vendor;
    __get_cpuid(1, &a, &b, &c, &d);
    const int base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
    ci.stepping = a & 0xF;
    ci.family = base_family == 0xF ? base_family + int((a >> 20) & 0xFF) : base_family;
    ci.model = (base_family == 6 || base_family == 0xF) ? (int((a >> 16) & 0xF) << 4) + base_model : base_model;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
    uint64_t xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = (uint64_t(hi) << 32) | lo;
    }
    const bool os_avx = avx && (xcr0 & 0x6) == 0x6;              // XMM, YMM state
    const bool os_512 = os_avx && (xcr0 & 0xE0) == 0xE0;         // opmask, ZMM_Hi256, Hi16_ZMM
    const bool os_amx = os_512 && (xcr0 & 0x60000) == 0x60000;   // XTILECFG, XTILEDATA
    CpuFeatures& f = ci.f;
    f.fma = os_avx && (c & (1u << 12));
    f.f16c = os_avx && (c & (1u << 29));
    if (max_leaf >= 7) {
        __get_cpuid_count(7, 0, &a, &b, &c, &d);
        const unsigned sub_leaves = a;
        f.avx2 = os_avx && (b & (1u << 5));
        f.avx512f = os_512 && (b & (1u << 16));
        f.avx512dq = os_512 && (b & (1u << 17));
        f.avx512bw = os_512 && (b & (1u << 30));
        f.avx512vl = os_512 && (b & (1u << 31));
        f.gfni = c & (1u << 8);
        f.avx512_vnni = os_512 && (c & (1u << 11));
        f.amx_bf16 = os_amx && (d & (1u << 22));
        f.amx_tile = os_amx && (d & (1u << 24));
        f.amx_int8 = os_amx && (d & (1u << 25));
        if (sub_leaves >= 1) {
            __get_cpuid_count(7, 1, &a, &b, &c, &d);
            f.avx_vnni = os_avx && (a & (1u << 4));
            f.avx512_bf16 = os_512 && (a & (1u << 5));
        }
    }
    __get_cpuid(0x80000000, &a, &b, &c, &d);
    if (a >= 0x80000004) {
        char brand[49] = {};
        for (unsigned i = 0; i < 3; ++i) {
            __get_cpuid(0x80000002 + i, &a, &b, &c, &d);
            std::memcpy(brand + 16 * i, &a, 4);
            std::memcpy(brand + 16 * i + 4, &b, 4);
            std::memcpy(brand + 16 * i + 8, &c, 4);
            std::memcpy(brand + 16 * i + 12, &d, 4);
        }
        std::string s(brand);
        const size_t first = s.find_first_not_of(' '), last = s.find_last_not_of(' ');
        if (first != std::string::npos) ci.model_name = s.substr(first, last - first + 1);
    }
    if (ci.vendor == "GenuineIntel") ci.uarch = intel_uarch(ci.family, ci.model, ci.stepping, f);
    else if (ci.vendor == "AuthenticAMD" || ci.vendor == "HygonGenuine") ci.uarch = amd_uarch(ci.family, ci.model, f);
}
#endif

#if defined(__aarch64__)
// Arm-designed cores by MIDR part number (implementer 0x41); the Graviton generations are N1, V1, V2
std::string arm_uarch(int implementer, int part) {
    if (implementer != 0x41) return "unknown";
    switch (part) {
        case 0xD0C: return "neoverse-n1";
        case 0xD40: return "neoverse-v1";
        case 0xD49: return "neoverse-n2";
        case 0xD4F: return "neoverse-v2";
        case 0xD8E: return "neoverse-n3";
        case 0xD84: return "neoverse-v3";
        case 0xD0B: return "cortex-a76";
        case 0xD41: return "cortex-a78";
        case 0xD44: return "cortex-x1";
        default: return "unknown";
    }
}
#endif

#if defined(__aarch64__) && defined(__linux__)
void detect_linux_arm64(CpuInfo& ci) {
    // HWCAP bits of the arm64 Linux ABI (arch/arm64/include/uapi/asm/hwcap.h)
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    ci.f.asimd = hw & (1ul << 1);
    ci.f.dotprod = hw & (1ul << 20);
    ci.f.i8mm = hw2 & (1ul << 13);
    ci.f.bf16 = hw2 & (1ul << 14);
    unsigned long long midr = 0;
    if (FILE* fp = std::fopen("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1", "r")) {
        if (std::fscanf(fp, "%llx", &midr) != 1) midr = 0;
        std::fclose(fp);
    }
    ci.family = int((midr >> 24) & 0xFF);   // implementer
    ci.model = int((midr >> 4) & 0xFFF);    // part number
    ci.stepping = int(midr & 0xF);          // revision
    ci.vendor = ci.family == 0x41 ? "ARM" : ci.family == 0x61 ? "Apple" : ci.family == 0 ? "unknown" : "arm64";
    ci.uarch = arm_uarch(ci.family, ci.model);
}
#endif

#if defined(__APPLE__) && defined(__aarch64__)
bool sysctl_flag(const char* name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
}
void detect_apple_arm64(CpuInfo& ci) {
    ci.vendor = "Apple";
    char brand[128] = {};
    size_t n = sizeof brand - 1;
    if (sysctlbyname("machdep.cpu.brand_string", brand, &n, nullptr, 0) == 0) ci.model_name = brand;
    ci.f.asimd = true;   // every arm64 Mac
    ci.f.dotprod = sysctl_flag("hw.optional.arm.FEAT_DotProd");
    ci.f.i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
    ci.f.bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16");
    // "Apple M2 Pro" -> "apple-m2"
    const std::string s = ci.model_name;
    if (s.rfind("Apple M", 0) == 0) {
        size_t e = 7;
        while (e < s.size() && s[e] >= '0' && s[e] <= '9') ++e;
        if (e > 7) ci.uarch = "apple-m" + s.substr(7, e - 7);
    }
}
#endif

CpuInfo detect() {
    CpuInfo ci;
#if QM_X86
    detect_x86(ci);
#elif defined(__APPLE__) && defined(__aarch64__)
    detect_apple_arm64(ci);
#elif defined(__aarch64__) && defined(__linux__)
    detect_linux_arm64(ci);
#endif
    if (ci.vendor.empty()) ci.vendor = "unknown";
    if (ci.model_name.empty()) ci.model_name = "unknown";
    if (ci.uarch.empty()) ci.uarch = "unknown";
    return ci;
}

}  // namespace

std::vector<std::string> CpuInfo::feature_names() const {
    const std::pair<bool, const char*> all[] = {
        {f.avx2, "avx2"},          {f.fma, "fma"},           {f.f16c, "f16c"},         {f.avx512f, "avx512f"},
        {f.avx512bw, "avx512bw"},  {f.avx512vl, "avx512vl"}, {f.avx512dq, "avx512dq"}, {f.avx512_vnni, "avx512_vnni"},
        {f.avx512_bf16, "avx512_bf16"}, {f.avx_vnni, "avx_vnni"}, {f.gfni, "gfni"},    {f.amx_tile, "amx_tile"},
        {f.amx_int8, "amx_int8"},  {f.amx_bf16, "amx_bf16"}, {f.asimd, "asimd"},       {f.dotprod, "dotprod"},
        {f.i8mm, "i8mm"},          {f.bf16, "bf16"},
    };
    std::vector<std::string> out;
    for (const auto& [on, name] : all)
        if (on) out.emplace_back(name);
    return out;
}

const CpuInfo& cpu_info() {
    static const CpuInfo ci = detect();
    return ci;
}

std::vector<std::pair<std::string, std::string>> kernel_choices() {
    const Kernels& k = kernels();
    // the int8/int16-activation GEMV (kernels.inc q4i8_gemv): the ISA's SIMD kernel, else scalar code
    std::string gemv_int = "scalar";
    if (k.isa == Isa::AVX512) gemv_int = vnni_enabled() ? "avx512-vnni" : "avx512bw";
    else if (k.isa == Isa::AVX2) gemv_int = avx_vnni_enabled() ? "avx-vnni" : "avx2";
    else if (k.isa == Isa::NEON) {   // the NEON integer variant in use (the i8mm one's GEMV is sdot's)
        const NeonDot d = neon_dot();
        return {{"gemv", k.name},
                {"gemv_int", std::string("neon-") + neon_dot_name(d == NeonDot::I8MM ? NeonDot::DotProd : d)},
                {"gemm_int", std::string("neon-") + neon_dot_name(d)}};
    }
    // its prefill GEMM: AMX tiles, the AVX-512 VNNI GEMM (kernels_vnni.cpp), the AVX-512 register tile,
    // the ymm rows-in-lanes GEMM (avx-vnni-gemm, from 16 inputs; kernels_vnni.cpp), else the GEMV once per input row
    std::string gemm_int = gemv_int + "-rows";
    if (k.isa == Isa::AVX512) gemm_int = amx_enabled() ? "amx" : vnni_gemm_enabled() ? "avx512-vnni-gemm" : gemv_int;
    else if (k.isa == Isa::AVX2 && avx_vnni_gemm_enabled()) gemm_int = "avx-vnni-gemm";
    return {{"gemv", k.name}, {"gemv_int", gemv_int}, {"gemm_int", gemm_int}};
}

}  // namespace qwenmetal::cpu
