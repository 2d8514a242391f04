// The Metal kernel sources embedded in the binary (Apple builds): one flattened MSL translation unit
// per kernel family, generated at build time by tools/embed_msl.py from metal/<family>.metal with its
// quoted includes inlined and #line directives kept (compile errors name metal/<file>:<line>).
// MetalDevice (src/metal/device.mm) compiles them with newLibraryWithSource: at first use, so a Mac
// with only the Command Line Tools (no `metal` compiler) runs the same kernels.
#pragma once
#include <cstddef>

namespace qwenmetal::gpu {

struct MslSource {
    const char* family;          // "norm" (metal/norm.metal)
    const char* origin;          // "metal/norm.metal"
    const char* source;          // the flattened MSL, NUL-terminated
    size_t length;               // strlen(source)
    const char* const* kernels;  // the host names it exports, nullptr-terminated
    size_t kernel_count;
    // The Metal Shading Language version the family is written for, "3.1" or "4.0" ("major.minor"): what
    // MTLCompileOptions.languageVersion is set to when it is compiled. From LANGUAGE_VERSION in
    // tools/embed_msl.py, the table tools/msl_conform.py checks the sources against.
    const char* language_version;
};

// every family, sorted by name (defined in the generated msl_sources.cpp)
extern const MslSource kMslSources[];
extern const size_t kMslSourceCount;

}  // namespace qwenmetal::gpu
