"""kvdump: write kvdump v1 HDF5 files (docs/kvdump-v1.md, v1.1 included) for `kvaudit` from a
running server.

numpy and h5py only; torch tensors are accepted by duck typing (torch is not imported here).
"""

from .codec import (
    bf16_bits_from_float32,
    decode_e4m3,
    decode_e8m0,
    encode_e4m3,
    flashmla_fp8_width,
    float32_from_bf16_bits,
    group_scales,
    pack_flashmla_fp8,
    quantize_e4m3,
    quantize_groups,
    quantize_rows,
    unpack_flashmla_fp8,
)
from .writer import KvDumpWriter, StepWriter, validate_step_indices

__all__ = [
    "KvDumpWriter",
    "StepWriter",
    "bf16_bits_from_float32",
    "decode_e4m3",
    "decode_e8m0",
    "encode_e4m3",
    "flashmla_fp8_width",
    "float32_from_bf16_bits",
    "group_scales",
    "pack_flashmla_fp8",
    "quantize_e4m3",
    "quantize_groups",
    "quantize_rows",
    "unpack_flashmla_fp8",
    "validate_step_indices",
]
