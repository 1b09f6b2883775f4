"""kvdump v1.1 per_token_group slots as the protocol's pool file holds them (version 2), in numpy.

A slot of a per_token_group pool is model.slot_bytes bytes (docs/backend-protocol.md, "Version 2"):

    [Dc e4m3fn latent codes][G scales][Dr RoPE]          G = Dc / kv_scale_group_size
    scales: float32 little-endian (kv_scale_format float32, power_of_two) or one e8m0 byte each
    RoPE:   bf16 bits little-endian (kv_rope_dtype bfloat16) or e4m3fn codes (float8_e4m3fn)

(for Dc 512, Dr 64, groups of 128: 592 bytes with float32 scales and an e4m3 RoPE part, FlashInfer's
per-token form; 656 with a bf16 RoPE part, FlashMLA's packed slot).

`encode_rows` is the v1.1 write rule for new rows, kvdump.codec.quantize_rows (a group's scale
from its finite amax: fp32(amax / 448), the power of two at or above it, or its e8m0 code, 1 for
an all-zero group; codes e4m3_rne_satfinite(x / scale), or x * fp32(1 / scale) with the
reciprocal convention; the RoPE part as bf16 bits, or v1's per-tensor rule with kv_scale), packed
into slot bytes. `split_slots` reads slots back into their parts, `scale_values` decodes the
scales to float32 and `scale_array` lays them out as FlashInfer's ckv_scale_arr wants them:
contiguous float32 [num_pages, page_size, G], indexed by physical slot.

numpy only: no torch here, so this module (and what it computes) is testable anywhere.
"""

import numpy as np

from ..codec import decode_e4m3, decode_e8m0, float32_from_bf16_bits, quantize_rows


def float32_rows(new_kv):
    """float32 [n, D] of a step's new_kv as it arrives: uint16 bf16 bits (widened exactly) or
    float32."""
    new_kv = np.asarray(new_kv)
    if new_kv.dtype == np.uint16:
        return float32_from_bf16_bits(new_kv)
    return np.ascontiguousarray(new_kv, dtype=np.float32)


def encode_rows(rows_float32, model, kv_scale, reciprocal=False):
    """uint8 [n, slot_bytes]: rows [n, D] (float32) written by the v1.1 rule, as slot bytes."""
    rows = np.ascontiguousarray(rows_float32, dtype=np.float32).reshape(-1, model.row_width)
    codes, rope, scales = quantize_rows(
        rows, model.kv_lora_rank, model.kv_scale_group_size, model.kv_scale_format,
        model.kv_rope_dtype, kv_scale=kv_scale, reciprocal=reciprocal)
    n = rows.shape[0]
    if model.kv_scale_format == "e8m0":
        scale_bytes = scales.astype(np.uint8)
    else:
        scale_bytes = np.ascontiguousarray(scales.astype("<f4")).view(np.uint8)
    if model.kv_rope_dtype == "bfloat16":
        rope_bytes = np.ascontiguousarray(rope.astype("<u2")).view(np.uint8)
    else:
        rope_bytes = rope.astype(np.uint8)
    slots = np.concatenate([codes.astype(np.uint8).reshape(n, -1), scale_bytes.reshape(n, -1),
                            rope_bytes.reshape(n, -1)], axis=1)
    assert slots.shape[1] == model.slot_bytes, (slots.shape, model.slot_bytes)
    return np.ascontiguousarray(slots)


def split_slots(slots, model):
    """(codes [n, Dc] uint8, scales [n, G] float32 or uint8 e8m0 codes, rope [n, Dr] uint16 bf16
    bits or uint8 e4m3fn codes) of slot bytes [n, slot_bytes] (uint8)."""
    slots = np.asarray(slots, dtype=np.uint8).reshape(-1, model.slot_bytes)
    codes = slots[:, :model.kv_lora_rank]
    raw = np.ascontiguousarray(slots[:, model.scales_offset:model.rope_offset])
    scales = raw if model.kv_scale_format == "e8m0" else raw.view("<f4").astype(np.float32)
    rope = np.ascontiguousarray(slots[:, model.rope_offset:])
    if model.kv_rope_dtype == "bfloat16":
        rope = rope.view("<u2").astype(np.uint16)
    return codes, scales, rope


def scale_values(slots, model):
    """float32 [n, G]: each slot's group scales as values (e8m0: 2^(code - 127), 0xFF NaN)."""
    _, scales, _ = split_slots(slots, model)
    return decode_e8m0(scales) if model.kv_scale_format == "e8m0" else scales


def scale_array(pool_bytes, model):
    """FlashInfer's ckv_scale_arr of a whole pool: contiguous float32 [num_pages, page_size, G]
    (entry [page, offset, g] is slot page * page_size + offset's scale of group g)."""
    values = scale_values(pool_bytes, model)
    return np.ascontiguousarray(values.reshape(model.num_pages, model.page_size, -1))


def dequantize(slots, model, kv_scale, kpe_scale=None):
    """float64 [n, D]: the real values the format defines for slot bytes (latent code * its
    group's scale, RoPE bf16 value or code * kpe_scale, kpe_scale defaulting to kv_scale);
    exact (a product of 4 and 24 significant bits)."""
    codes, _, rope = split_slots(slots, model)
    scales = scale_values(slots, model).astype(np.float64)
    latent = decode_e4m3(codes).astype(np.float64) * np.repeat(
        scales, model.kv_scale_group_size, axis=1)
    if model.kv_rope_dtype == "bfloat16":
        rope_values = float32_from_bf16_bits(rope).astype(np.float64)
    else:
        scale = float(np.float32(kv_scale if kpe_scale is None else kpe_scale))
        rope_values = decode_e4m3(rope).astype(np.float64) * scale
    return np.concatenate([latent, rope_values], axis=1)
