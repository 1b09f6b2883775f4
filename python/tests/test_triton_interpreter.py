"""kvdump.backends.triton_interpreter: the corrections it makes to Triton's interpreter, on values
worked by hand (a bf16 tl.dot, fp32 -> bf16 casts and stores, fp32 / bf16 -> e4m3 casts), and the
adapter switch that turns it on. Needs torch and triton (a CUDA build of torch from PyPI brings triton; no GPU is used):
skipped, by name, where either is missing."""

import os
import sys
import types
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

try:
    import torch
    import triton  # noqa: F401

    MISSING = None
except ImportError as error:  # pragma: no cover - depends on the venv
    MISSING = f"torch and triton are needed: {error}"


def kernels():
    """The test kernels, defined after enable() so that triton.jit wraps them for the
    interpreter."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        rows = tl.arange(0, N)[:, None] * N
        cols = tl.arange(0, N)[None, :]
        a = tl.load(a_ptr + rows + cols)
        b = tl.load(b_ptr + rows + cols)
        tl.store(c_ptr + rows + cols, tl.dot(a, b))

    @triton.jit
    def store_bf16(x_ptr, y_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))  # fp32 into a bf16 tensor

    @triton.jit
    def cast_bf16(x_ptr, y_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        x = tl.load(x_ptr + offsets)
        tl.store(y_ptr + offsets, x.to(tl.bfloat16).to(tl.float32))

    @triton.jit
    def cast_e4m3(x_ptr, y_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        x = tl.load(x_ptr + offsets)
        tl.store(y_ptr + offsets, x.to(tl.float8e4nv).to(tl.float32))

    return dot16, store_bf16, cast_bf16, cast_e4m3


@unittest.skipIf(MISSING, MISSING)
class InterpreterCorrections(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from kvdump.backends import triton_interpreter

        cls.saved = os.environ.get("TRITON_INTERPRET")
        cls.summary = triton_interpreter.enable(torch)
        cls.dot16, cls.store_bf16, cls.cast_bf16, cls.cast_e4m3 = kernels()

    @classmethod
    def tearDownClass(cls):
        if cls.saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = cls.saved

    def test_bf16_dot_multiplies_values(self):
        # A = 3 I, B[i, j] = (i - j) / 4 (exact in bf16): C = A B = 3 B = 0.75 (i - j).
        n = 16
        i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        a = torch.eye(n, dtype=torch.bfloat16) * 3
        b = torch.from_numpy(((i - j) / 4.0).astype(np.float32)).to(torch.bfloat16)
        c = torch.zeros((n, n), dtype=torch.float32)
        self.dot16[(1,)](a, b, c, n)
        self.assertEqual(c.numpy().tolist(), (0.75 * (i - j)).tolist())

    def rounding_cases(self):
        # bf16 keeps 7 explicit mantissa bits: the ulp at 1 is 2^-7.
        return [
            (1 + 2**-7 + 2**-8, 1 + 2**-6),  # halfway, 1 + 2^-7 odd: to the even 1 + 2^-6
            (1 + 2**-8, 1.0),  # halfway, 1.0 even: stays (truncation agrees here)
            (1 + 2**-8 + 2**-12, 1 + 2**-7),  # above halfway: up (truncation gives 1.0)
            (-(1 + 2**-8 + 2**-12), -(1 + 2**-7)),  # the same, negative
            (3.0, 3.0),  # exact
        ]

    def test_fp32_stored_into_bf16_rounds_to_nearest_even(self):
        cases = self.rounding_cases()
        x = torch.tensor([v for v, _ in cases] + [0.0] * 3, dtype=torch.float32)
        y = torch.zeros(8, dtype=torch.bfloat16)
        self.store_bf16[(1,)](x, y, 8)
        self.assertEqual(y.float().tolist()[:5], [r for _, r in cases])

    def test_fp32_cast_to_bf16_rounds_to_nearest_even(self):
        cases = self.rounding_cases()
        x = torch.tensor([v for v, _ in cases] + [0.0] * 3, dtype=torch.float32)
        y = torch.zeros(8, dtype=torch.float32)
        self.cast_bf16[(1,)](x, y, 8)
        self.assertEqual(y.tolist()[:5], [r for _, r in cases])

    def test_fp32_and_bf16_cast_to_e4m3_round_to_nearest_even_and_saturate(self):
        # e4m3 keeps 3 explicit mantissa bits: the ulp at 1 is 2^-3, at 256 it is 32; largest 448.
        cases = [
            (1 + 2**-3 + 2**-4, 1 + 2**-2),  # halfway, 1 + 2^-3 odd: to the even 1.25
            (1 + 2**-4, 1.0),  # halfway, 1.0 even: stays
            (1.875 + 2**-4, 2.0),  # halfway, 1.875 odd: up, the carry into the exponent
            (1.5 + 2**-6, 1.5),  # below halfway: down
            (432.0, 448.0),  # halfway between 416 (odd) and 448 (even): 448
            (1000.0, 448.0),  # beyond the largest: satfinite
            (-1000.0, -448.0),
            (2**-9, 2**-9),  # the smallest subnormal, exact
        ]
        for dtype in (torch.float32, torch.bfloat16):  # every input is exact in bf16 too
            x = torch.tensor([v for v, _ in cases], dtype=dtype)
            y = torch.zeros(8, dtype=torch.float32)
            self.cast_e4m3[(1,)](x, y, 8)
            self.assertEqual(y.tolist(), [r for _, r in cases], str(dtype))

    def test_summary_says_cpu_interpreter(self):
        self.assertTrue(self.summary["on"])
        self.assertIn("not a GPU run", self.summary["device"])
        self.assertEqual(len(self.summary["patches"]), 3)


@unittest.skipIf(MISSING, MISSING)
class AdapterSwitch(unittest.TestCase):
    """--triton-interpreter: the CPU by default, refused with a CUDA device."""

    def options(self, **extra):
        return types.SimpleNamespace(**{"triton_interpreter": True, "device": None,
                                        "kernel_file": None, "num_kv_splits": 0,
                                        "lse_dtype": "bfloat16", "fault": [], **extra})

    def test_parser_has_the_switch(self):
        from kvdump.backends.__main__ import build_parser

        for adapter in ("vllm-triton-mla", "sglang-triton-mla"):
            options = build_parser().parse_args([adapter, "--triton-interpreter"])
            self.assertTrue(options.triton_interpreter)

    def test_cpu_is_the_default_device(self):
        from kvdump.backends.vllm_triton_mla import VllmTritonMlaAdapter

        self.assertEqual(VllmTritonMlaAdapter(self.options()).default_device, "cpu")
        without = VllmTritonMlaAdapter(self.options(triton_interpreter=False))
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            self.assertIsNone(without.default_device)


if __name__ == "__main__":
    unittest.main()
