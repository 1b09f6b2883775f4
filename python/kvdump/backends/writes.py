"""How an adapter writes a step's new KV rows into an FP8 pool: the write rules servers use.

new_kv [n, D] arrives as bf16 (what a server holds) or float32 (a dump whose values are not all
bf16), s = the layer's kv_scale (float32). Rules (`--write`):

  server    PyTorch's own cast, as SGLang's KV-buffer write does it:
                (new_kv / s).to(torch.float8_e4m3fn)
            new_kv stays a bf16 tensor, so the quotient is a bf16 tensor: PyTorch computes it in
            float32 and rounds it to bf16 (on CUDA, by multiplying with the float32 reciprocal of
            the Python scalar; on CPU by a float32 division), then the cast rounds that bf16 to
            e4m3fn, nearest even, WITHOUT saturation: a magnitude past 464 becomes the NaN code
            (c10 fp8e4m3fn_from_fp32_value). Two roundings: where the bf16 quotient lands on an
            e4m3 midpoint, the code can differ by one from a single rounding of x / s. With
            s = 1 (SGLang's MLA pool applies no scale: `cache_k.to(self.dtype)`) the division is
            exact and only the cast remains. kvaudit compares every written code with kvdump's
            rule and reports what differs; this adapter does not correct it.
  saturate  the same, clamped to +-448 (in the quotient's dtype) before the cast.
  kvdump    kvdump v1's rule: e4m3_rne_satfinite(fp32(x) / fp32(s)): one float32 division (a
            tensor divisor, so no reciprocal shortcut), clamp to +-448, cast; NaN gives 0x7F.
            With hello's reciprocal_scale: fp32(x) * fp32(1 / s), kvaudit's --reciprocal-scale.

The planted fault round-toward-zero replaces the final rounding by a truncation toward zero
(saturating at 448) on the rule's quotient.

A bfloat16 pool stores new_kv as bf16 bits (float32 rounded to nearest even); rules do not apply.
torch is imported by the functions, so that the rules' names and texts load without it.
"""

import numpy as np

WRITE_RULES = {
    "server": "(new_kv / kv_scale).to(torch.float8_e4m3fn): the quotient in new_kv's dtype (bf16: "
              "float32 arithmetic rounded to bf16), then PyTorch's cast (round to nearest even, no "
              "saturation: |x| > 464 gives the NaN code)",
    "saturate": "(new_kv / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn): the quotient in "
                "new_kv's dtype, clamped, then PyTorch's cast",
    "kvdump": "e4m3_rne_satfinite(fp32(x) / fp32(kv_scale)) (kvdump v1)",
}

E4M3_MAX = 448.0
NAN_CODE = 0x7F


def quotient(new_kv, kv_scale, rule, reciprocal=False):
    """new_kv / kv_scale as the rule computes it (bf16 or float32 tensor)."""
    import torch

    if rule in ("server", "saturate"):
        q = new_kv / float(kv_scale)  # a Python scalar, as in `cache_k / k_scale`
        return q.clamp(-E4M3_MAX, E4M3_MAX) if rule == "saturate" else q
    if rule != "kvdump":
        raise ValueError(f"unknown write rule {rule}")
    x = new_kv.float()
    scale = np.float32(kv_scale)
    if reciprocal:
        return x * torch.full_like(x, float(np.float32(1) / scale))
    return x / torch.full_like(x, float(scale))


def canonical_nan(codes, q):
    """kvdump's encoder (and the GPU's cvt) give 0x7F for a NaN input whatever its sign."""
    import torch

    return torch.where(torch.isnan(q), torch.full_like(codes, NAN_CODE), codes)


def round_toward_zero_codes(q):
    """e4m3fn codes of q rounded toward zero, saturating at +-448."""
    import torch

    q32 = q.float().clamp(-E4M3_MAX, E4M3_MAX)
    codes = q32.to(torch.float8_e4m3fn).view(torch.uint8)
    nearest = codes.view(torch.float8_e4m3fn).float()
    away = nearest.abs() > q32.abs()  # rounded up in magnitude (never true for NaN)
    # e4m3 codes of one sign are ordered by magnitude: one code lower is the next value toward 0.
    lowered = (codes & 0x80) | ((codes & 0x7F) - 1)
    return canonical_nan(torch.where(away, lowered, codes), q32)


def fp8_codes(new_kv, kv_scale, rule, reciprocal=False, round_toward_zero=False):
    """uint8 [n, D] e4m3fn codes of the rows, written by `rule`."""
    import torch

    q = quotient(new_kv, kv_scale, rule, reciprocal)
    if round_toward_zero:
        return round_toward_zero_codes(q)
    if rule == "kvdump":
        q = q.clamp(-E4M3_MAX, E4M3_MAX)
        return canonical_nan(q.to(torch.float8_e4m3fn).view(torch.uint8), q)
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def bf16_bits(new_kv):
    """int16 [n, D] bf16 bits of the rows (a bfloat16 pool)."""
    import torch

    return new_kv.to(torch.bfloat16).view(torch.int16)
