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


# --- kvdump v1.1: per-token-group scales (docs/kvdump-v1.md "Version 1.1") ------------------------
#
# A cached row x = fp32(new_kv[i]) of width D = Dc + Dr is stored as
#   latent codes [Dc] e4m3fn, one scale per group of `group_size` consecutive latent channels
#   (G = Dc / group_size scales), and the RoPE part [Dr] as bf16 bits or e4m3fn codes.
# Group g's scale comes from a = max |x_j| over the group's finite elements (float32):
#   float32      : scale = max(fp32(a / 448), 2^-149)      one binary32 division; never 0
#   power_of_two : scale = 2^k, the smallest power of two >= a / 448, exactly
#   e8m0         : that 2^k with k clamped to -127..127, stored as the byte k + 127
#   a = 0        : scale = 1 (e8m0 code 127), never 0
# and latent element j's code is e4m3_rne_satfinite(x_j / scale) (one binary32 division), or with
# the reciprocal convention (SGLang's quantizer) e4m3_rne_satfinite(x_j * fp32(1 / scale)).
# The flashmla_fp8 packed slot (FlashMLA's sparse FP8 cache, 656 bytes for Dc 512, Dr 64, groups
# of 128) is the bytes [Dc codes][G little-endian float32 scales][Dr little-endian bf16].

SCALE_FORMATS = ("float32", "power_of_two", "e8m0")
ROPE_DTYPES = ("bfloat16", "float8_e4m3fn")
E8M0_NAN_CODE = 0xFF
E8M0_BIAS = 127
# float32 powers of two run from 2^-149 (the smallest subnormal) to 2^127.
_FLOAT32_MIN_POWER, _FLOAT32_MAX_POWER = -149, 127
_LEAST_FLOAT32 = 2.0**_FLOAT32_MIN_POWER


def decode_e8m0(codes):
    """float32 values 2^(code - 127) of uint8 e8m0 (float8_e8m0fnu) codes; 0xFF gives NaN.

    Code 0 is 2^-127, a float32 subnormal (exact); code 254 is 2^127.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    exponent = np.where(codes == E8M0_NAN_CODE, 0, codes.astype(np.int32) - E8M0_BIAS)
    values = np.ldexp(np.ones(codes.shape, dtype=np.float32), exponent).astype(np.float32)
    return np.where(codes == E8M0_NAN_CODE, np.float32(np.nan), values).astype(np.float32)


def _check_float32(x, who):
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"{who}: values must be float32, got {x.dtype} (a bf16 tensor widens "
                         "exactly: kvdump.float32_from_bf16_bits)")
    return x


def _check_group_args(width, group_size, scale_format, who):
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f'{who}: scale_format "{scale_format}" is not one of '
                         f'{", ".join(SCALE_FORMATS)}')
    if (isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer))
            or group_size < 1):
        raise ValueError(f"{who}: group_size = {group_size!r} is not a positive integer")
    if width % group_size:
        raise ValueError(f"{who}: group_size {group_size} does not divide the latent width {width}")


def _group_amax(groups):
    """max |x| over the finite elements of each group, float32, [..., G, group_size] -> [..., G]
    (0 for a group without a finite element)."""
    magnitude = np.abs(groups)
    magnitude = np.where(np.isfinite(magnitude), magnitude, np.float32(0))
    if magnitude.shape[-1] == 0:
        return np.zeros(magnitude.shape[:-1], dtype=np.float32)
    return magnitude.max(axis=-1).astype(np.float32)


def _power_of_two_exponent(amax):
    """k of the smallest power of two 2^k >= amax / 448, exactly, for finite amax > 0 (float32).

    amax = m * 2^e with m in [0.5, 1) (frexp, exact, subnormals included) and 448 = 0.875 * 2^9,
    so amax / 448 = (m / 0.875) * 2^(e - 9) with m / 0.875 in (0.57, 1.15):
    k = e - 9 when m <= 0.875, else e - 8. No logarithm, so no rounding.
    """
    mantissa, exponent = np.frexp(amax)
    exponent = exponent.astype(np.int32)
    return np.where(mantissa <= np.float32(0.875), exponent - 9, exponent - 8).astype(np.int32)


def group_scales(latent_float32, group_size, scale_format):
    """The v1.1 scales of the latent rows `latent_float32` [..., Dc] (float32): [..., G].

    float32 and power_of_two give float32 scales; e8m0 gives its uint8 codes (value
    2^(code - 127)). A group whose finite elements are all zero (or that has none) gets scale 1
    (e8m0 code 127). power_of_two is the smallest power of two >= amax / 448 that float32 holds
    (amax / 448 below 2^-149 gets 2^-149); e8m0 clamps the exponent to -127..127.

    The float32 rule is fp32(amax / 448), but at least 2^-149, the least float: for amax below
    about 2^-141.2 (deep float32 subnormals) the quotient rounds to 0, and a scale of 0 would
    give NaN codes (0 / 0) for the group's zero elements.
    """
    return _group_scales(latent_float32, group_size, scale_format, "group_scales")


def _group_scales(latent_float32, group_size, scale_format, who):
    x = _check_float32(latent_float32, who)
    if x.ndim < 1:
        raise ValueError(f"{who}: values must have a latent axis [..., Dc]")
    _check_group_args(x.shape[-1], group_size, scale_format, who)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = _group_amax(groups)
    zero = amax == 0
    if scale_format == "float32":
        scales = amax / np.float32(E4M3_MAX_FINITE)  # one binary32 division (float32 / float32)
        scales = np.maximum(scales, np.float32(_LEAST_FLOAT32))  # never 0: 0 / 0 would be NaN
        return np.where(zero, np.float32(1), scales).astype(np.float32)
    safe = np.where(zero, np.float32(1), amax)
    k = _power_of_two_exponent(safe)
    if scale_format == "power_of_two":
        k = np.clip(k, _FLOAT32_MIN_POWER, _FLOAT32_MAX_POWER)
        scales = np.ldexp(np.ones(k.shape, dtype=np.float32), k).astype(np.float32)
        return np.where(zero, np.float32(1), scales).astype(np.float32)
    k = np.clip(k, -E8M0_BIAS, E8M0_BIAS)
    return np.where(zero, E8M0_BIAS, k + E8M0_BIAS).astype(np.uint8)


def quantize_groups(latent_float32, group_size, scale_format, reciprocal=False):
    """The v1.1 write rule for latent rows [..., Dc] (float32): (codes [..., Dc] uint8 e4m3fn,
    scales [..., G]: float32, or uint8 e8m0 codes).

    code_j = e4m3_rne_satfinite(x_j / scale_g), scale_g the scale of j's group (group_scales),
    one binary32 division; reciprocal=True multiplies by fp32(1 / scale_g) instead (SGLang's
    quantizer; differs in the last bit of rare codes). NaN gives 0x7F, +-inf saturates to +-448.
    """
    return _quantize_groups(latent_float32, group_size, scale_format, reciprocal,
                            "quantize_groups")


def _quantize_groups(latent_float32, group_size, scale_format, reciprocal, who):
    x = _check_float32(latent_float32, who)
    scales = _group_scales(x, group_size, scale_format, who)
    values = decode_e8m0(scales) if scale_format == "e8m0" else scales
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    divisor = values[..., None]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if reciprocal:
            quotient = groups * (np.float32(1) / divisor)  # fp32(1 / scale), then one product
        else:
            quotient = groups / divisor
    return encode_e4m3(quotient.astype(np.float32)).reshape(x.shape), scales


def quantize_rows(rows_float32, kv_lora_rank, group_size, scale_format="float32",
                  rope_dtype="bfloat16", kv_scale=1.0, reciprocal=False):
    """The kvdump v1.1 write rule for whole cached rows [N, D] (float32, D = Dc + Dr):
    (latent codes [N, Dc] uint8 e4m3fn, rope [N, Dr], scales [N, G]).

    Latent part: quantize_groups(rows[:, :Dc], group_size, scale_format, reciprocal); scales are
    float32 (float32, power_of_two) or uint8 e8m0 codes (e8m0).
    RoPE part rows[:, Dc:]: rope_dtype "bfloat16" gives its bf16 bits (uint16, round to nearest
    even; exact for widened bf16 values), unscaled, and needs kv_scale 1; "float8_e4m3fn" gives
    v1's per-tensor rule quantize_e4m3(x, kv_scale) (uint8 codes; with reciprocal=True,
    x * fp32(1 / kv_scale)).
    """
    x = _check_float32(rows_float32, "quantize_rows")
    if x.ndim != 2:
        raise ValueError(f"quantize_rows: rows must be [N, D], got shape {tuple(x.shape)}")
    if (isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, (int, np.integer))
            or not 1 <= kv_lora_rank <= x.shape[1]):
        raise ValueError(f"quantize_rows: kv_lora_rank = {kv_lora_rank!r} is not in "
                         f"1..{x.shape[1]} (the row width D)")
    if rope_dtype not in ROPE_DTYPES:
        raise ValueError(f'quantize_rows: rope_dtype "{rope_dtype}" is not one of '
                         f'{", ".join(ROPE_DTYPES)}')
    scale = np.float32(float(kv_scale))
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"quantize_rows: kv_scale = {float(kv_scale)} is not finite and > 0 "
                         "(as float32)")
    if rope_dtype == "bfloat16" and scale != 1:
        raise ValueError(f"quantize_rows: kv_scale = {float(kv_scale)} must be 1 with a bfloat16 "
                         "RoPE part (it is stored unscaled)")
    codes, scales = _quantize_groups(np.ascontiguousarray(x[:, :kv_lora_rank]), group_size,
                                     scale_format, reciprocal, "quantize_rows")
    rope = x[:, kv_lora_rank:]
    if rope_dtype == "bfloat16":
        rope = bf16_bits_from_float32(rope)
    elif reciprocal:
        with np.errstate(over="ignore"):
            rope = encode_e4m3(rope * (np.float32(1) / scale))
    else:
        rope = quantize_e4m3(np.ascontiguousarray(rope), scale)
    return codes, rope, scales


def flashmla_fp8_width(kv_lora_rank, qk_rope_head_dim, group_size):
    """Bytes of one flashmla_fp8 slot: Dc + 4 * G + 2 * Dr (656 for 512, 64, groups of 128)."""
    _check_group_args(kv_lora_rank, group_size, "float32", "flashmla_fp8_width")
    return kv_lora_rank + 4 * (kv_lora_rank // group_size) + 2 * qk_rope_head_dim


def pack_flashmla_fp8(codes, rope_bits, scales):
    """FlashMLA's packed FP8 slots [..., Dc + 4G + 2Dr] uint8 from codes [..., Dc] (uint8 e4m3fn),
    rope_bits [..., Dr] (uint16 bf16 bits) and scales [..., G] (float32): the arguments are in
    quantize_rows's order, so pack_flashmla_fp8(*quantize_rows(rows, ...)) packs rows.

    Each slot's bytes are its Dc codes, then its G scales as little-endian float32, then its Dr
    RoPE values as little-endian bf16: the concatenation of the split layout's kv_cache,
    kv_scales and kv_rope, byte by byte. e8m0 scales and an e4m3 RoPE part have no packed form
    (kvdump-v1.md "Packed layout").
    """
    codes, scales, rope_bits = np.asarray(codes), np.asarray(scales), np.asarray(rope_bits)
    for name, arr, dtype in (("codes", codes, np.uint8), ("rope_bits", rope_bits, np.uint16),
                             ("scales", scales, np.float32)):
        if arr.dtype != dtype:
            raise ValueError(f"pack_flashmla_fp8: {name} must be {np.dtype(dtype).name}, got "
                             f"{arr.dtype}")
        if arr.ndim < 1 or arr.shape[:-1] != codes.shape[:-1]:
            raise ValueError(f"pack_flashmla_fp8: {name} shape {tuple(arr.shape)} does not match "
                             f"codes shape {tuple(codes.shape)} before the last axis")
    lead = codes.shape[:-1]
    parts = [codes.astype("<u1", copy=False),
             np.ascontiguousarray(scales.astype("<f4", copy=False)).view(np.uint8),
             np.ascontiguousarray(rope_bits.astype("<u2", copy=False)).view(np.uint8)]
    parts = [part.reshape(*lead, -1) for part in parts]
    return np.concatenate(parts, axis=-1).astype(np.uint8, copy=False)


def unpack_flashmla_fp8(packed, kv_lora_rank, group_size):
    """(codes [..., Dc] uint8, rope_bits [..., Dr] uint16, scales [..., G] float32) of packed
    flashmla_fp8 slots [..., Dc + 4G + 2Dr] (uint8); the inverse of pack_flashmla_fp8."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim < 1:
        raise ValueError(f"unpack_flashmla_fp8: packed must be uint8 [..., width], got "
                         f"{packed.dtype} of shape {tuple(packed.shape)}")
    _check_group_args(kv_lora_rank, group_size, "float32", "unpack_flashmla_fp8")
    groups = kv_lora_rank // group_size
    rope_bytes = packed.shape[-1] - kv_lora_rank - 4 * groups
    if rope_bytes < 0 or rope_bytes % 2:
        raise ValueError(f"unpack_flashmla_fp8: width {packed.shape[-1]} is not Dc + 4G + 2Dr "
                         f"for Dc {kv_lora_rank}, G {groups}")
    codes = packed[..., :kv_lora_rank].copy()
    scale_bytes = np.ascontiguousarray(packed[..., kv_lora_rank:kv_lora_rank + 4 * groups])
    rope = np.ascontiguousarray(packed[..., kv_lora_rank + 4 * groups:])
    scales = scale_bytes.view("<f4").astype(np.float32)
    rope_bits = rope.view("<u2").astype(np.uint16)
    return codes, rope_bits, scales
