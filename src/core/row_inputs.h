// What a prefill call may pass beside its ids (qwenmetal.mrope.RowInputs), the same for the cpu engine and the
// Metal graph: explicit RoPE positions per frequency pair for every row, rows whose embedding lookup is replaced
// by given float rows (image features), and the state's rope_delta after the call (committed with it).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace qwenmetal {

struct RowInputs {
    const int32_t* pair_pos = nullptr;   // [n][rotary_dim / 2], or null: row i at position + i + rope_delta
    const int64_t* embed_rows = nullptr; // [n_embeds] increasing row indices of the call
    const float* embeds = nullptr;       // [n_embeds][hidden]
    int64_t n_embeds = 0;
    int64_t rope_delta = 0;              // the state's delta after the call

    // the embedding rows of a call of n ids: given with their values, increasing indices in 0..n-1; `who`
    // prefixes the message ("cpu engine", "metal backend")
    void check(int64_t n, const char* who) const {
        if (n_embeds < 0 || (n_embeds && (!embed_rows || !embeds)))
            throw std::invalid_argument(std::string(who) + ": embedding rows without their indices or values");
        for (int64_t j = 0; j < n_embeds; ++j)
            if (embed_rows[j] < 0 || embed_rows[j] >= n || (j && embed_rows[j] <= embed_rows[j - 1]))
                throw std::invalid_argument(std::string(who) +
                                            ": embedding rows must be increasing row indices of the call");
    }
};

}  // namespace qwenmetal
