"""Tests of kvdump.codec against slow per-element references written from the format definitions.

The e4m3 reference decodes all 256 codes from their bit fields, then picks, in exact integer
arithmetic (every float32 is an integer multiple of 2^-149), the nearest finite value of the input's
sign, ties to the even code. Taking the nearest *finite* value is the satfinite rule: above 448 the
next step would be 480, so everything up to the midpoint 464 (inclusive, 448's mantissa 110 is
even) rounds to 448 and everything above saturates to it. Inf saturates too; NaN gives 0x7F.

Run: /usr/bin/python3 -m unittest discover -s python/tests
"""

import math
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvdump  # noqa: E402

SCALE_EXPONENT = 149  # float32's smallest subnormal is 2^-149


def slow_e4m3_integer(code):
    """|value| of a finite e4m3fn code times 2^149, from S.EEEE.MMM with bias 7."""
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 0:
        return mantissa << (SCALE_EXPONENT - 9)  # M/8 * 2^-6
    return (8 + mantissa) << (SCALE_EXPONENT + exponent - 7 - 3)  # (1 + M/8) * 2^(E-7)


def slow_e4m3_value(code):
    if code & 0x7F == 0x7F:
        return math.nan
    value = slow_e4m3_integer(code) / 2.0**SCALE_EXPONENT
    return -value if code & 0x80 else value


FINITE_POSITIVE = [(code, slow_e4m3_integer(code)) for code in range(0x7F)]


def slow_e4m3_code(x):
    """e4m3_rne_satfinite of one float32 value (a Python float holding it exactly)."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0x00
    if math.isinf(x):
        return sign | 0x7E
    numerator, denominator = abs(x).as_integer_ratio()
    target = (numerator << SCALE_EXPONENT) // denominator  # exact: denominator <= 2^149
    best_code, best_distance = None, None
    for code, value in FINITE_POSITIVE:
        distance = abs(target - value)
        if (best_distance is None or distance < best_distance
                or (distance == best_distance and code % 2 == 0)):
            best_code, best_distance = code, distance
    return sign | best_code


def slow_bf16_bits(x):
    """Nearest bf16 of one float32 by exact comparison of the two bf16 neighbours, ties to the
    even pattern; the step past the largest finite bf16 stands for 2^128 (IEEE overflow to inf)."""
    bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if math.isnan(x):
        return (bits >> 16) | 0x40
    low = bits >> 16
    if bits & 0xFFFF == 0:
        return low
    high = low + 1

    def magnitude(pattern):
        pattern &= 0x7FFF
        if pattern == 0x7F80:
            return 2 ** 128
        return abs(np.array([pattern << 16], dtype=np.uint32).view(np.float32)[0].item())

    from fractions import Fraction
    target = Fraction(abs(x))
    d_low, d_high = abs(target - Fraction(magnitude(low))), abs(target - Fraction(magnitude(high)))
    if d_low < d_high or (d_low == d_high and low % 2 == 0):
        return low
    return high


def e4m3_values():
    return sorted(slow_e4m3_integer(code) / 2.0**SCALE_EXPONENT for code in range(0x7F))


def e4m3_midpoints():
    values = e4m3_values()
    return [(a + b) / 2 for a, b in zip(values, values[1:])] + [464.0]


def e4m3_sweep():
    """float32 values: every e4m3 value and midpoint, their float32 neighbours, 448/464/480,
    float32 subnormals, inf/NaN, a dense linear sweep and a geometric one, both signs."""
    points = e4m3_values() + e4m3_midpoints()
    points += [448.0, 464.0, 480.0, 496.0, 512.0, 1e4, 3.4028234e38, 1e-45, 1e-40, 2.0**-126]
    points += [2.0**-10, 3 * 2.0**-11, 2.0**-11]
    base = np.array(points, dtype=np.float32)
    with np.errstate(over="ignore"):  # float32 max steps up to inf, which saturates too
        up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(0))
    dense = np.linspace(0, 520, 12001, dtype=np.float32)
    geometric = np.exp2(np.linspace(-16, 10, 6001)).astype(np.float32)
    positive = np.concatenate([base, up, down, dense, geometric])
    special = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    return np.concatenate([positive, -positive, special])


class E4m3Test(unittest.TestCase):
    def test_decode_matches_bit_fields(self):
        decoded = kvdump.decode_e4m3(np.arange(256, dtype=np.uint8))
        for code in range(256):
            expected = slow_e4m3_value(code)
            if math.isnan(expected):
                self.assertTrue(np.isnan(decoded[code]), hex(code))
            else:
                self.assertEqual(decoded[code], expected, hex(code))
        self.assertEqual(decoded[0x7E], 448.0)
        self.assertEqual(decoded[0x01], 2.0**-9)

    def test_known_codes(self):
        # Hand-derived: 464 ties to 448 (even), above saturates; 1.0625 ties down to 1.0 (0x38),
        # 1.1875 ties up to 1.25 (0x3A); 2^-10 ties to zero; 3*2^-10 ties to 2*2^-9 (0x02).
        cases = {448.0: 0x7E, 464.0: 0x7E, 480.0: 0x7E, 1e30: 0x7E, 1.0625: 0x38, 1.1875: 0x3A,
                 2.0**-10: 0x00, 3 * 2.0**-10: 0x02, -2.5: 0xC2, -0.0: 0x80, 1e-45: 0x00}
        codes = kvdump.encode_e4m3(np.array(list(cases), dtype=np.float32))
        self.assertEqual([int(c) for c in codes], list(cases.values()))

    def test_quantize_matches_slow_reference(self):
        for kv_scale in (1.0, 0.37, 0.125, 3.0, 1.0 / 448.0):
            scale32 = np.float32(kv_scale)
            # Values whose quotient lands on or beside an e4m3 midpoint: there fp32 division and
            # multiplying by an fp32 reciprocal round differently, so the rule is pinned down.
            ties = np.array([m * float(scale32) for m in e4m3_midpoints()], dtype=np.float32)
            sweep = np.concatenate([e4m3_sweep(), ties, np.nextafter(ties, np.float32(0)),
                                    np.nextafter(ties, np.float32(1e9)), -ties])
            codes = kvdump.quantize_e4m3(sweep, kv_scale)
            with np.errstate(over="ignore"):
                quotients = [np.float32(v) / scale32 for v in sweep]  # one binary32 division
            for i, quotient in enumerate(quotients):
                expected = slow_e4m3_code(float(quotient))
                if codes[i] != expected:
                    self.fail(f"kv_scale {kv_scale}: value {sweep[i]!r} -> quotient {quotient!r}: "
                              f"code {int(codes[i]):#04x}, expected {expected:#04x}")

    def test_quantize_requires_float32(self):
        with self.assertRaises(ValueError):
            kvdump.quantize_e4m3(np.zeros(3, dtype=np.float64), 1.0)


class Bf16Test(unittest.TestCase):
    def test_known_bits(self):
        # 1 + 2^-8 ties to 1.0 (even), 1 + 3*2^-8 ties up to 1 + 2^-6; the largest float rounds
        # past bf16's largest finite 0x7F7F to inf; NaN stays quiet NaN.
        values = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -2.0, 3.4028234e38, np.inf],
                          dtype=np.float32)
        self.assertEqual([int(b) for b in kvdump.bf16_bits_from_float32(values)],
                         [0x3F80, 0x3F80, 0x3F82, 0xC000, 0x7F80, 0x7F80])
        nan_bits = int(kvdump.bf16_bits_from_float32(np.array([np.nan], np.float32))[0])
        self.assertEqual(nan_bits & 0x7FC0, 0x7FC0)

    def test_scalars_and_shapes(self):
        # A 0-d value (a numpy scalar, or a Python float) keeps its shape, as a 2-d array does.
        self.assertEqual(int(kvdump.bf16_bits_from_float32(np.float32(1 + 3 * 2.0**-8))), 0x3F82)
        self.assertEqual(kvdump.bf16_bits_from_float32(-2.0).shape, ())
        self.assertEqual(float(kvdump.float32_from_bf16_bits(np.uint16(0xC000))), -2.0)
        grid = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32)
        bits = kvdump.bf16_bits_from_float32(grid)
        self.assertEqual(bits.shape, (2, 2))
        np.testing.assert_array_equal(kvdump.float32_from_bf16_bits(bits), grid)

    def test_round_trip_is_exact(self):
        bits = np.arange(0, 0x10000, dtype=np.uint32).astype(np.uint16)
        finite = bits[(bits & 0x7F80) != 0x7F80]
        back = kvdump.bf16_bits_from_float32(kvdump.float32_from_bf16_bits(finite))
        np.testing.assert_array_equal(back, finite)

    def test_matches_slow_reference(self):
        rng = np.random.default_rng(7)
        patterns = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
        ties = (rng.integers(0, 0x7F7F, size=500).astype(np.uint32) << 16) | 0x8000
        values = np.concatenate([patterns, ties, ties | 0x80000000]).view(np.float32)
        got = kvdump.bf16_bits_from_float32(values)
        for value, bits in zip(values, got):
            if math.isnan(value):
                continue
            self.assertEqual(int(bits), slow_bf16_bits(float(value)), repr(value))


class GroupScaleTest(unittest.TestCase):
    def test_float32_scale_that_underflows_is_the_least_float_not_zero(self):
        # amax 2^-145: 2^-145 / 448 is below half of 2^-149 and rounds to 0 in binary32. The
        # scale is 2^-149 instead, and the codes are x / 2^-149: 16 (0x58) and zeros, never NaN.
        rows = np.zeros((1, 8), dtype=np.float32)
        rows[0, 0] = np.float32(2.0**-145)
        codes, scales = kvdump.quantize_groups(rows, 8, "float32")
        self.assertEqual(float(scales[0, 0]), 2.0**-149)
        self.assertEqual(codes.tolist(), [[0x58, 0, 0, 0, 0, 0, 0, 0]])
        # Just above: a quotient that is itself the least float keeps its own value.
        self.assertEqual(float(kvdump.group_scales(np.full((1, 8), np.float32(448 * 2.0**-149)),
                                                   8, "float32")[0, 0]), 2.0**-149)


if __name__ == "__main__":
    unittest.main()
