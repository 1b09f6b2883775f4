// The v1.1 per_token_group rules (math: src/format/group_scales.hpp).
#include "src/format/group_scales.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/core/fp8_e4m3.hpp"

namespace kvaudit {
namespace {

// The smallest power of two >= q for a positive finite q (exact: frexp gives q = m * 2^e with
// m in [0.5, 1), so 2^(e-1) < q <= 2^e, with equality at the bottom only when m = 0.5).
double power_of_two_at_or_above(double q) {
  int e = 0;
  const double m = std::frexp(q, &e);
  return m == 0.5 ? std::ldexp(1.0, e - 1) : std::ldexp(1.0, e);
}

std::uint32_t float_bits(float x) { return std::bit_cast<std::uint32_t>(x); }

float read_f32_le(const std::uint8_t* p) {
  std::uint32_t bits = 0;
  for (int i = 0; i < 4; ++i) bits |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return std::bit_cast<float>(bits);
}

void write_f32_le(std::uint8_t* p, float x) {
  const std::uint32_t bits = float_bits(x);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(bits >> (8 * i));
}

std::uint8_t encode_with_scale(float x, float scale, bool reciprocal_scale) {
  return reciprocal_scale ? kvdump_quantize_reciprocal(x, scale) : kvdump_quantize(x, scale);
}

// What a faulty reader takes for the scale of group g.
float read_scale(const KvPool& pool, std::int64_t slot, int group, GroupReadFault fault) {
  const float stored = pool.group_scale(slot, group);
  switch (fault) {
    case GroupReadFault::kScaleAsPowerOfTwo: {
      // The exponent field alone: the mantissa bits are dropped (2^floor(log2 s) for normals).
      const std::uint32_t bits = float_bits(stored) & 0xFF800000u;
      return std::bit_cast<float>(bits);
    }
    case GroupReadFault::kScaleAsE8m0:
      return e8m0_decode(pool.row(slot)[pool.scales_offset() + group]);
    case GroupReadFault::kNone:
      break;
  }
  return stored;
}

}  // namespace

float finite_amax(std::span<const float> x) {
  float amax = 0.0f;
  for (const float v : x) {
    if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
  }
  return amax;
}

float group_scale_for(float amax, GroupScaleFormat format) {
  if (!(amax > 0.0f)) return 1.0f;
  if (format == GroupScaleFormat::kFloat32) {
    // Below about 2^-141.2 the quotient rounds to 0, and x / 0 would give NaN codes for the zero
    // elements: the scale is then the least float, 2^-149, as in power_of_two.
    return std::max(amax / kE4m3MaxFinite, std::numeric_limits<float>::denorm_min());
  }
  const double power = power_of_two_at_or_above(static_cast<double>(amax) / 448.0);
  if (format == GroupScaleFormat::kE8m0) {
    return static_cast<float>(std::clamp(power, std::ldexp(1.0, -127), std::ldexp(1.0, 127)));
  }
  // amax <= FLT_MAX, so the power fits above; below float's range it is the least float, 2^-149.
  return static_cast<float>(std::max(power, std::ldexp(1.0, -149)));
}

float e8m0_decode(std::uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(code) - 127));
}

std::uint8_t e8m0_encode(float power_of_two) {
  if (std::isnan(power_of_two)) return 0xFF;
  if (!(power_of_two > 0.0f)) return 0;
  const double power = power_of_two_at_or_above(static_cast<double>(power_of_two));
  int e = 0;
  std::frexp(power, &e);  // power = 0.5 * 2^e
  return static_cast<std::uint8_t>(std::clamp(e - 1 + 127, 0, 254));
}

float KvPool::group_scale(std::int64_t slot, int group) const {
  const std::uint8_t* p = row(slot) + scales_offset();
  if (scale_format == GroupScaleFormat::kE8m0) return e8m0_decode(p[group]);
  return read_f32_le(p + 4 * group);
}

void KvPool::set_group_scale(std::int64_t slot, int group, float scale) {
  std::uint8_t* p = row(slot) + scales_offset();
  if (scale_format == GroupScaleFormat::kE8m0) {
    p[group] = e8m0_encode(scale);
  } else {
    write_f32_le(p + 4 * group, scale);
  }
}

void write_grouped_row(KvPool& pool, std::int64_t slot, const float* x, float kv_scale,
                       bool reciprocal_scale, GroupWriteFault fault) {
  const int groups = pool.num_groups();
  std::uint8_t* codes = pool.row(slot);
  // The faults' one scale per token, calibrated on the whole latent part (not per group, and
  // without the RoPE part).
  const float token_scale = group_scale_for(
      finite_amax({x, static_cast<std::size_t>(pool.latent_width)}), pool.scale_format);
  for (int g = 0; g < groups; ++g) {
    const float* group = x + g * pool.group_size;
    const float amax = finite_amax({group, static_cast<std::size_t>(pool.group_size)});
    float scale = group_scale_for(amax, pool.scale_format);
    if (fault == GroupWriteFault::kZeroGroupScale && amax == 0.0f) scale = 0.0f;
    pool.set_group_scale(slot, g, scale);
  }
  for (int g = 0; g < groups; ++g) {
    const float stored = pool.group_scale(slot, g);
    float scale = stored;
    if (fault == GroupWriteFault::kScaleOne) scale = 1.0f;
    if (fault == GroupWriteFault::kKvScaleSplit) scale = token_scale;
    // A zero scale is only reached by the zero-group fault: x * (1 / 0) = 0 * inf = NaN.
    const bool reciprocal =
        reciprocal_scale || (fault == GroupWriteFault::kZeroGroupScale && stored == 0.0f);
    for (int j = g * pool.group_size; j < (g + 1) * pool.group_size; ++j) {
      codes[j] = encode_with_scale(x[j], scale, reciprocal);
    }
  }
  std::uint8_t* rope = codes + pool.rope_offset();
  const int dc = pool.latent_width;
  const float rope_scale = fault == GroupWriteFault::kRopeLatentScale ? token_scale : kv_scale;
  for (int j = 0; j < pool.rope_width(); ++j) {
    if (pool.rope_dtype == KvDtype::kBfloat16) {
      const std::uint16_t bits = bf16_from_float(x[dc + j]);
      rope[2 * j] = static_cast<std::uint8_t>(bits & 0xFF);
      rope[2 * j + 1] = static_cast<std::uint8_t>(bits >> 8);
    } else {
      rope[j] = encode_with_scale(x[dc + j], rope_scale, reciprocal_scale);
    }
  }
}

void dequantize_grouped_row_bf16(const KvPool& pool, std::int64_t slot, float kv_scale,
                                 GroupReadFault fault, std::uint16_t* row) {
  const std::uint8_t* codes = pool.row(slot);
  for (int g = 0; g < pool.num_groups(); ++g) {
    const float scale = read_scale(pool, slot, g, fault);
    for (int j = g * pool.group_size; j < (g + 1) * pool.group_size; ++j) {
      row[j] = bf16_from_float(e4m3_decode(codes[j]) * scale);
    }
  }
  const std::uint8_t* rope = codes + pool.rope_offset();
  const int dc = pool.latent_width;
  for (int j = 0; j < pool.rope_width(); ++j) {
    if (pool.rope_dtype == KvDtype::kBfloat16) {
      row[dc + j] = static_cast<std::uint16_t>(rope[2 * j] | (rope[2 * j + 1] << 8));
    } else {
      row[dc + j] = bf16_from_float(e4m3_decode(rope[j]) * kv_scale);
    }
  }
}

KvPool dequantize_grouped_pool_bf16(const KvPool& pool, float kv_scale, GroupReadFault fault,
                                    std::span<const std::int64_t> slots) {
  KvPool out = KvPool::zeros(KvDtype::kBfloat16, pool.num_slots, pool.row_width);
  std::vector<std::uint16_t> row(static_cast<std::size_t>(pool.row_width));
  for (const std::int64_t slot : slots) {
    dequantize_grouped_row_bf16(pool, slot, kv_scale, fault, row.data());
    for (int j = 0; j < pool.row_width; ++j) out.set_bf16_bits(slot, j, row[j]);
  }
  return out;
}

}  // namespace kvaudit
