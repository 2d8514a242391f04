// "[a, b, c]": a tensor shape as error messages print it (one definition for every engine's checks).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace qwenmetal {

inline std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
}

}  // namespace qwenmetal
