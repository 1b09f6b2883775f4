// Rows of e4m3 codes decoded to floats on the host, for the exact reference's KV rows (a GLM-5
// layer's pool is 8 x 4,097 rows of 576 codes: 19 million values a layer).
//
//   e4m3_decode_row: out[i] = e4m3_decode(codes[i]) for i < n, bit for bit (NaN codes as its quiet
//   NaNs, the sign kept), and the code of the largest finite magnitude with the sign cleared (e4m3
//   codes order as their magnitudes do; 0x7f, NaN, is no magnitude; 0 where there is none).
//
// e4m3_value_table's one load per element cannot be vectorised; this form is integer steps without
// branches, which the compiler vectorises (16 codes per step with AVX-512).
#pragma once

#include <cstdint>

namespace kvaudit {

std::uint8_t e4m3_decode_row(const std::uint8_t* codes, int n, float* out);

}  // namespace kvaudit
