"""Planted faults: wrong conventions an adapter can be told to use (`--fault NAME`, repeatable).

They exist so that tests (and CI) can show that kvaudit's checks and its diagnosis catch a
backend that gets a convention wrong, through the same external-backend path a real kernel takes.
A run with a fault is never a measurement of the kernel; the adapter names its faults in
`describe` ("faults") so that reports say so.

Each fault changes one stage of a step (s = kv_scale, the layer's float32 scale):

  write   round-toward-zero   codes rounded toward zero instead of to nearest even (saturating
                              at +-448): every inexact quotient that round-to-nearest rounds up in
                              magnitude lands one code low (kvaudit: off_by_one_code)
  read    scale-pow2          dequantize with s rounded down to a power of two, 2^floor(log2 s)
          scale-pow2-nearest  ... with s rounded to the nearest power of two (ties up)
          scale-reciprocal    ... with 1 / s
          scale-twice         ... with s * s
          scale-missing       ... without s (codes read as values)
          scale-latent-only   ... with s on the latent part (ckv) only, the rope part unscaled
          read-e5m2           FP8 bytes read as e5m2 instead of e4m3fn (torch adapter only)
  softmax sm-scale-missing    scores not multiplied by sm_scale
          sm-scale-log2e      sm_scale * log2(e) (the base-2 kernel's folded scale) used with e^x
          p-e4m3              probabilities rounded to e4m3 before P.V (torch adapter only)
  output  lse-base2           lse returned in base 2, log2(sum 2^(s * log2 e)) = lse / ln 2
                              (FlashInfer's default: run() without return_lse_base_on_e)
"""

import math
from dataclasses import dataclass

import numpy as np

FAULTS = {
    "round-toward-zero": ("write", "codes rounded toward zero instead of to nearest even"),
    "scale-pow2": ("read", "kv_scale rounded down to a power of two when dequantizing"),
    "scale-pow2-nearest": ("read", "kv_scale rounded to the nearest power of two when "
                                   "dequantizing"),
    "scale-reciprocal": ("read", "1 / kv_scale used to dequantize"),
    "scale-twice": ("read", "kv_scale applied twice when dequantizing"),
    "scale-missing": ("read", "kv_scale not applied when dequantizing"),
    "scale-latent-only": ("read", "kv_scale applied to the latent part only, not the rope part"),
    "read-e5m2": ("read", "FP8 bytes read as e5m2 instead of e4m3fn"),
    "sm-scale-missing": ("softmax", "scores not multiplied by sm_scale"),
    "sm-scale-log2e": ("softmax", "sm_scale multiplied by log2(e) and used with exp"),
    "p-e4m3": ("softmax", "probabilities rounded to e4m3 before P.V"),
    "lse-base2": ("output", "lse returned in base 2 instead of natural log"),
}

# The faults that replace kv_scale by another value (one at a time; scale-latent-only combines).
SCALE_FAULTS = ("scale-pow2", "scale-pow2-nearest", "scale-reciprocal", "scale-twice",
                "scale-missing")

LOG2E = 1.0 / math.log(2.0)


def floor_pow2(x):
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1)


def nearest_pow2(x):
    mantissa, exponent = math.frexp(x)
    return math.ldexp(1.0, exponent if mantissa >= 0.75 else exponent - 1)


@dataclass(frozen=True)
class Conventions:
    """The conventions a step is computed with: kvdump v1's, except where a fault says not."""

    faults: tuple = ()

    def has(self, name):
        return name in self.faults

    def read_scales(self, kv_scale):
        """(ckv_scale, kpe_scale): the multipliers that dequantize the two parts of a row, as
        float32 values (FlashInfer's ckv_scale / kpe_scale)."""
        s = float(np.float32(kv_scale))
        if self.has("scale-pow2"):
            s = floor_pow2(s)
        elif self.has("scale-pow2-nearest"):
            s = nearest_pow2(s)
        elif self.has("scale-reciprocal"):
            s = 1.0 / s
        elif self.has("scale-twice"):
            s = s * s
        elif self.has("scale-missing"):
            s = 1.0
        ckv = float(np.float32(s))
        return ckv, (1.0 if self.has("scale-latent-only") else ckv)

    def softmax_scale(self, sm_scale):
        if self.has("sm-scale-missing"):
            return 1.0
        if self.has("sm-scale-log2e"):
            return sm_scale * LOG2E
        return sm_scale

    @property
    def lse_base2(self):
        return self.has("lse-base2")

    @property
    def round_toward_zero(self):
        return self.has("round-toward-zero")

    def describe(self):
        return [f"{name}: {FAULTS[name][1]}" for name in self.faults]


def check_faults(names, available, adapter):
    """Conventions for `names`; a fault the adapter cannot plant is refused as unsupported."""
    from .protocol import unsupported

    for name in names:
        if name not in available:
            raise unsupported(f"fault {name} is not available in the {adapter} adapter "
                              f"(it plants: {', '.join(sorted(available))})")
    read = [n for n in names if n in SCALE_FAULTS]
    if len(read) > 1:
        raise unsupported(f"faults {', '.join(read)} all change kv_scale; plant one at a time")
    return Conventions(tuple(names))
