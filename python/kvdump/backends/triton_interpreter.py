"""Running a peer's Triton kernel on the CPU under Triton's interpreter (`--triton-interpreter`).

Triton's interpreter (TRITON_INTERPRET=1, triton/runtime/interpreter.py) runs a @triton.jit
function on CPU tensors, one program at a time, each tl op as NumPy. It keeps bf16 values as their
uint16 bit patterns; three of its ops get bf16 or narrowing conversions wrong for the kernels
judged here (checked on Triton 3.9.0, NumPy 2.4; the first also on 3.6.0):

  - tl.dot(a, b) with bf16 operands: InterpreterBuilder.create_dot calls np.matmul on the uint16
    arrays, i.e. multiplies the bit patterns as integers (a 16 x 16 x 32 product of N(0, 1) values
    off by 2.6e10). A GPU's bf16 MMA multiplies the values exactly and accumulates in fp32.
  - fp32 -> bf16 (x.to(tl.bfloat16), and a store of fp32 values into a bf16 tensor): cast_impl
    truncates the mantissa (round toward zero). The GPU rounds to nearest even (cvt.rn.bf16.f32).
  - fp32 / bf16 / fp16 -> fp8e4nv (x.to(tl.float8e4nv), what SGLang's decode does to q and P):
    create_fp_to_fp rounds half up on the dropped bits, loses the carry into the exponent and does
    not saturate. The GPU (sm90) converts through fp32 with cvt.rn.satfinite.e4m3x2.f32: nearest
    even, |x| > 448 -> +-448, NaN stays NaN.

enable() sets TRITON_INTERPRET=1 (before the kernel file is imported: triton.jit reads it when it
wraps each function) and replaces three methods of the interpreter's builder:
  - create_dot: a bf16 operand is widened to fp32 exactly (its bits shifted into the top half of an
    fp32), then A[M, K] @ B[K, N] in fp32 (NumPy's matmul: exact products, fp32 sums in BLAS's
    order, not the MMA's) plus the accumulator D [M, N]; every other dtype goes to Triton's own.
  - fp32 -> bf16 conversions (cast_impl, create_fp_to_fp): PyTorch's float32 -> bfloat16
    conversion, round to nearest even (NaN stays NaN, overflow goes to Inf, as cvt.rn does).
  - fp32 / bf16 / fp16 -> fp8e4nv (create_fp_to_fp): widened to fp32 exactly, clamped to +-448,
    then PyTorch's float32 -> float8_e4m3fn conversion (nearest even).
Everything else (FP8 -> wider conversions and FP8 tl.dot, which the interpreter does through
fp16, exp, log, reductions) is Triton's own. What remains different from a GPU run is summation
order and the MMA's internal accumulation: results agree to rounding noise, not bit for bit
(docs/peer-kernels.md "Without a GPU" has the numbers).
"""

import os

import numpy as np

PATCHES = ("tl.dot on bf16 operands: operands widened to fp32 exactly, fp32 matmul (the "
           "interpreter multiplies bf16 bit patterns as integers)",
           "fp32 -> bf16 casts and stores: round to nearest even (the interpreter truncates)",
           "fp32/bf16/fp16 -> fp8e4nv casts: nearest even, satfinite (+-448), as sm90's "
           "cvt.rn.satfinite (the interpreter rounds half up without carry or saturation)")
E4M3_MAX = 448.0


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def bf16_bits_to_fp32(bits):
    """uint16 bf16 bit patterns -> float32 values, exactly (bf16 is fp32's top 16 bits)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(values, torch):
    """float32 values -> uint16 bf16 bit patterns, round to nearest even (PyTorch's conversion)."""
    array = np.ascontiguousarray(values, dtype=np.float32)
    rounded = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy()
    return rounded.view(np.uint16).reshape(array.shape)


def widened_fp32(handle, tl):
    """A bf16, fp16 or fp32 TensorHandle's values as float32, exactly; None for other dtypes."""
    scalar = handle.dtype.scalar
    if scalar == tl.bfloat16:
        return bf16_bits_to_fp32(handle.data)
    if scalar == tl.float16:
        return np.asarray(handle.data).view(np.float16).astype(np.float32)
    if scalar == tl.float32:
        return np.asarray(handle.data, dtype=np.float32)
    return None


def fp32_to_e4m3_bits(values, torch):
    """float32 values -> e4m3fn codes (uint8), nearest even, satfinite: |x| > 448 -> +-448."""
    array = np.clip(np.ascontiguousarray(values, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    codes = torch.from_numpy(array).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return codes.reshape(array.shape)


def patch_builder(builder_class, tl, torch):
    """Replace InterpreterBuilder's bf16 dot and fp32 -> bf16 conversions (module docstring)."""
    if getattr(builder_class, "_kvdump_patched", False):
        return
    triton_dot = builder_class.create_dot
    triton_cast = builder_class.cast_impl
    triton_fp_to_fp = builder_class.create_fp_to_fp

    def operand(handle):
        if handle.dtype.scalar == tl.bfloat16:
            return bf16_bits_to_fp32(handle.data)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_fp32, b_fp32 = operand(a), operand(b)
        if a_fp32 is None and b_fp32 is None:
            return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_fp32 = a_fp32 if a_fp32 is not None else a.data.astype(np.float32)
        b_fp32 = b_fp32 if b_fp32 is not None else b.data.astype(np.float32)
        product = np.matmul(a_fp32, b_fp32, dtype=np.float32)
        return type(d)((product + d.data).astype(d.data.dtype), d.dtype.scalar)

    def to_bf16(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return type(src)(fp32_to_bf16_bits(src.data, torch), dst_type.scalar)
        return None

    def to_e4m3(src, dst_type):
        values = widened_fp32(src, tl) if dst_type.scalar == tl.float8e4nv else None
        if values is None:
            return None
        return type(src)(fp32_to_e4m3_bits(values, torch), dst_type.scalar)

    def cast_impl(self, src, dst_type):
        converted = to_bf16(src, dst_type)
        return converted if converted is not None else triton_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        converted = to_bf16(src, dst_type)
        if converted is None:
            converted = to_e4m3(src, dst_type)
        if converted is not None:
            return converted
        return triton_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_class.create_dot = create_dot
    builder_class.cast_impl = cast_impl
    builder_class.create_fp_to_fp = create_fp_to_fp
    builder_class._kvdump_patched = True


def enable(torch):
    """Turn the interpreter on for kernels imported from now on, with the patches above. Returns
    what describe records."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime import interpreter

    patch_builder(interpreter.InterpreterBuilder, tl, torch)
    return summary()


def summary():
    import triton

    return {"on": True, "device": "cpu (Triton's interpreter, NumPy; not a GPU run)",
            "triton": triton.__version__, "numpy": np.__version__, "patches": list(PATCHES)}
