"""Element codecs of kvdump v1 in numpy: float8 e4m3fn codes and bfloat16 bits.

e4m3fn (OCP FP8, "fn" = finite + NaN): bits S.EEEE.MMM, exponent bias 7.
  E = 0     : subnormal, value = (-1)^S * M/8 * 2^-6   (smallest 2^-9)
  E = 1..15 : normal,    value = (-1)^S * (1 + M/8) * 2^(E-7)
  E=15, M=7 : NaN (0x7F, 0xFF); no infinity; largest finite 0x7E = 448.
Unit roundoff: e4m3 2^-4, bf16 2^-8, fp32 2^-24.

The kvdump write rule (kvdump-v1 "Semantics") is
    code = e4m3_rne_satfinite(fp32(value) / fp32(kv_scale))
one IEEE binary32 division, then one rounding to nearest, ties to even, saturating to +-448.
464 is the midpoint between 448 and 480 (the step after 448 if the format went on); 464 ties to
448 (mantissa 110 is even) and anything above rounds past 448, so satfinite clamps it to 448.
"""

import numpy as np

E4M3_NAN_CODE = 0x7F
E4M3_MAX_FINITE_CODE = 0x7E
E4M3_MAX_FINITE = 448.0


def _positive_e4m3_values():
    """Values of codes 0x00..0x7E, increasing with the code."""
    codes = np.arange(E4M3_MAX_FINITE_CODE + 1)
    exponent = codes >> 3
    mantissa = (codes & 7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    return np.where(exponent == 0, subnormal, normal).astype(np.float32)


_POSITIVE_VALUES = _positive_e4m3_values()


def decode_e4m3(codes):
    """float32 values of uint8 e4m3fn codes (NaN codes give NaN)."""
    codes = np.asarray(codes, dtype=np.uint8)
    magnitude = codes & 0x7F
    values = _POSITIVE_VALUES[np.minimum(magnitude, E4M3_MAX_FINITE_CODE)]
    values = np.where(magnitude == E4M3_NAN_CODE, np.float32(np.nan), values)
    return np.where(codes & 0x80, -values, values).astype(np.float32)


def encode_e4m3(values):
    """e4m3fn codes of float32 values: round to nearest even, saturate to +-448.

    Infinities saturate too; NaN gives the canonical NaN code 0x7F. The sign of zero is kept.
    """
    x = np.asarray(values, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 31) << 7).astype(np.uint8)
    magnitude = np.abs(x)
    finite = np.isfinite(magnitude)
    safe = np.where(finite, magnitude, np.float32(0))
    # Quantum of the e4m3 binade holding |x|: 2^(e-3) for normals, 2^-9 below 2^-6. Dividing by a
    # power of two is exact, so rint (ties to even) rounds |x| / quantum exactly once.
    _, frexp_exponent = np.frexp(safe)  # safe = f * 2^frexp_exponent, f in [0.5, 1)
    exponent = np.maximum(frexp_exponent.astype(np.int32) - 1, -6)
    quantum = np.ldexp(np.float32(1), exponent - 3).astype(np.float32)
    with np.errstate(over="ignore"):  # |x| near float max rounds up to inf; saturated below
        rounded = (np.rint(safe / quantum) * quantum).astype(np.float32)
    rounded = np.where(finite, np.minimum(rounded, np.float32(E4M3_MAX_FINITE)), E4M3_MAX_FINITE)
    # Every rounded value is an e4m3 value, so its code is its index in the value table.
    code = np.searchsorted(_POSITIVE_VALUES, rounded.astype(np.float32)).astype(np.uint8)
    code = code | sign
    return np.where(np.isnan(x), np.uint8(E4M3_NAN_CODE), code).astype(np.uint8)


def quantize_e4m3(values_float32, kv_scale):
    """The kvdump write rule: e4m3_rne_satfinite(fp32(value) / fp32(kv_scale)), as uint8 codes.

    values_float32: any shape; must already be float32 (a bf16 tensor widens exactly). The
    quotient is one binary32 division, as the format prescribes.
    """
    x = np.asarray(values_float32)
    if x.dtype != np.float32:
        raise ValueError(f"quantize_e4m3: values must be float32, got {x.dtype}")
    with np.errstate(over="ignore"):  # a quotient past float32's range is inf, which saturates
        quotient = x / np.float32(kv_scale)
    return encode_e4m3(quotient)


def bf16_bits_from_float32(values):
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even.

    NaN stays a quiet NaN with its sign; values that round past the bf16 range become +-inf, as
    IEEE rounding does.
    """
    floats = np.asarray(values, dtype=np.float32)
    # Work on a 1-d view: numpy turns 0-d results into scalars, whose uint64 + int mixes to float.
    bits = floats.reshape(-1).view(np.uint32).astype(np.uint64)
    is_nan = (bits & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    rounding_bias = np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))
    rounded = (bits + rounding_bias) >> np.uint64(16)
    quiet_nan = (bits >> np.uint64(16)) | np.uint64(0x0040)
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16).reshape(floats.shape)


def float32_from_bf16_bits(bits):
    """Exact float32 values of bfloat16 bits."""
    halves = np.asarray(bits, dtype=np.uint16)
    wide = halves.reshape(-1).astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32).reshape(halves.shape)
