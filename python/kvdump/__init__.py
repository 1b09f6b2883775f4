"""kvdump: write kvdump v1 HDF5 files (docs/kvdump-v1.md) for `kvaudit` from a running server.

numpy and h5py only; torch tensors are accepted by duck typing (torch is not imported here).
"""

from .codec import (
    bf16_bits_from_float32,
    decode_e4m3,
    encode_e4m3,
    float32_from_bf16_bits,
    quantize_e4m3,
)
from .writer import KvDumpWriter, StepWriter, validate_step_indices

__all__ = [
    "KvDumpWriter",
    "StepWriter",
    "bf16_bits_from_float32",
    "decode_e4m3",
    "encode_e4m3",
    "float32_from_bf16_bits",
    "quantize_e4m3",
    "validate_step_indices",
]
