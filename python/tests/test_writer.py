"""Tests of kvdump.KvDumpWriter: a round trip read back with h5py, and one refusal per rule of
kvdump-v1 "Errors" that a writer can see, each naming the object's path.

The small dump: H = 2 heads, Dc = 8, Dr = 4 (D = 12), page_size = 4, 6 pages, layers 0 and 77.
Step S000 (prefill), three requests:
  request 0: pages [2, 5], last page holds 2 -> kv_len 6; rows at positions 3, 4, 5
             -> slots 2*4+3 = 11, 5*4+0 = 20, 5*4+1 = 21
  request 1: no rows, no pages (skipped)
  request 2: page [0], last page holds 1 -> kv_len 1; one row at position 0 -> slot 0
Step S001 (decode): request 0 pages [2, 5], last 3 -> kv_len 7, row at position 6 -> slot 22;
  request 1 page [0], last 2 -> kv_len 2, row at position 1 -> slot 1.
(Slots worked out by hand from the format's Semantics.)

kvdump v1.1 (docs/kvdump-v1.md "Version 1.1"): the same steps with per_token_group pools, groups of
4 latent channels (G = 2), split (kv_cache [6, 4, 8], kv_rope [6, 4, 4], kv_scales [6, 4, 2]) or
packed flashmla_fp8 (kv_cache [6, 4, 8 + 4*2 + 2*4 = 24]); the group quantizer on hand-computed
cases; topk_indices checked against the rows' token positions (S000: 3, 4, 5 and 0; S001: 6, 1).

Run: /usr/bin/python3 -m unittest discover -s python/tests
"""

import os
import re
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

import h5py
import numpy as np

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PYTHON_DIR)

import kvdump  # noqa: E402

H, DC, DR, PAGE, PAGES = 2, 8, 4, 4, 6
D = DC + DR
ATTRS = dict(model="test-model", producer="test_writer.py", num_heads=H, kv_lora_rank=DC,
             qk_rope_head_dim=DR, sm_scale=0.125, page_size=PAGE)
PREFILL = dict(kind="prefill", qo_indptr=[0, 3, 3, 4], kv_indptr=[0, 2, 2, 3],
               kv_indices=[2, 5, 0], kv_last_page_len=[2, 0, 1], new_kv_slots=[11, 20, 21, 0])
DECODE = dict(kind="decode", qo_indptr=[0, 1, 2], kv_indptr=[0, 2, 3], kv_indices=[2, 5, 0],
              kv_last_page_len=[3, 2], new_kv_slots=[22, 1])


def step_tensors(rows, seed):
    rng = np.random.default_rng(seed)
    return dict(q_nope=rng.standard_normal((rows, H, DC)).astype(np.float32),
                q_pe=rng.integers(0, 0x7F00, (rows, H, DR)).astype(np.uint16),
                new_kv=rng.standard_normal((rows, D)).astype(np.float32))


def fake_torch(views, numpy_dtypes):
    """A stand-in for torch: a module with the dtypes `views` (e.g. ("int16", "uint8")) and a
    Tensor class whose view() reinterprets the array's bytes as one of them and whose numpy()
    accepts only `numpy_dtypes`, so a test fails if the writer converts values instead of
    viewing them. Returns (module, Tensor)."""

    class Dtype:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return "torch." + self.name

    module = types.ModuleType("torch")
    for name in views:
        setattr(module, name, Dtype(name))

    class Tensor:
        def __init__(self, array, dtype):
            self.array, self.dtype = array, Dtype(dtype)

        def detach(self):
            return self

        def cpu(self):
            return self

        def contiguous(self):
            return self

        def view(self, dtype):
            assert any(dtype is getattr(module, name) for name in views), dtype
            return Tensor(self.array.view(np.dtype(dtype.name)), dtype.name)

        def numpy(self):
            assert self.dtype.name in numpy_dtypes, self.dtype
            return self.array

    return module, Tensor


class WriterTestCase(unittest.TestCase):
    def setUp(self):
        self._dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._dir.name, "dump.h5")

    def tearDown(self):
        self._dir.cleanup()

    def writer(self, **overrides):
        return kvdump.KvDumpWriter(self.path, **{**ATTRS, **overrides})

    def pool(self, seed=0):
        return np.random.default_rng(seed).integers(0, 0x7F, (PAGES, PAGE, D)).astype(np.uint8)

    def assert_refused(self, path, call, *args, **kwargs):
        """call(...) raises ValueError whose message starts with "<path>: "."""
        with self.assertRaisesRegex(ValueError, "^" + re.escape(path + ": ")):
            call(*args, **kwargs)


class RoundTripTest(WriterTestCase):
    def test_fp8_dump_reads_back(self):
        pool0, pool77 = self.pool(0), self.pool(1)
        source = np.full((PAGES, PAGE, D), 0x3F80, dtype=np.uint16)  # bf16 1.0 everywhere
        prefill = step_tensors(4, seed=2)
        prefill["q_nope"][0, 0, 0] = 1 + 2.0**-8  # ties to bf16 1.0 = 0x3F80
        prefill["q_nope"][0, 0, 1] = 1 + 3 * 2.0**-8  # ties up to 0x3F82
        out = np.zeros((4, H, DC), dtype=np.uint16)
        lse = np.linspace(-1, 1, 4 * H, dtype=np.float32).reshape(4, H)
        with self.writer() as dump:
            dump.add_layer(0, 0.5, pool0, kv_source=source)
            dump.add_layer(77, 2.0, pool77)
            step = dump.add_step(**PREFILL)
            step.add_layer(0, **prefill, out=out, lse=lse, kv_cache_after=pool0)
            step.add_layer(77, **prefill)
            step = dump.add_step(**DECODE)
            for layer in (77, 0):
                step.add_layer(layer, **step_tensors(2, seed=3))

        with h5py.File(self.path, "r") as f:
            root = dict(f.attrs)
            self.assertEqual(root["format"], "kvdump")
            self.assertEqual(root["format_version"], 1)
            self.assertEqual(root["model"], "test-model")
            self.assertEqual(root["producer"], "test_writer.py")
            for name, value in (("num_heads", H), ("kv_lora_rank", DC), ("qk_rope_head_dim", DR),
                                ("page_size", PAGE)):
                self.assertEqual(root[name], value, name)
                self.assertEqual(f.attrs.get_id(name).dtype.kind, "i", name)
            self.assertEqual(f.attrs.get_id("sm_scale").dtype, np.dtype("<f8"))
            self.assertEqual(root["sm_scale"], 0.125)
            self.assertEqual(root["kv_dtype"], "float8_e4m3fn")
            self.assertEqual(root["kv_scale_kind"], "per_tensor")

            self.assertEqual(sorted(f["layers"]), ["L000", "L077"])
            layer = f["layers/L077"]
            self.assertEqual(layer.attrs["layer_id"], 77)
            self.assertEqual(layer.attrs.get_id("kv_scale").dtype, np.dtype("<f4"))
            self.assertEqual(layer.attrs["kv_scale"], 2.0)
            self.assertNotIn("kv_source", layer)
            cache = f["layers/L000/kv_cache"]
            self.assertEqual(cache.dtype, np.dtype("<u1"))
            self.assertEqual(cache.attrs["dtype"], "float8_e4m3fn")
            np.testing.assert_array_equal(cache[()], pool0)
            kv_source = f["layers/L000/kv_source"]
            self.assertEqual((kv_source.dtype, kv_source.attrs["dtype"]),
                             (np.dtype("<u2"), "bfloat16"))
            np.testing.assert_array_equal(kv_source[()], source)

            self.assertEqual(sorted(f["steps"]), ["S000", "S001"])
            s0 = f["steps/S000"]
            self.assertEqual(s0.attrs["kind"], "prefill")
            self.assertEqual(f["steps/S001"].attrs["kind"], "decode")
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                         "new_kv_slots"):
                self.assertEqual(s0[name].dtype, np.dtype("<i4"), name)
                np.testing.assert_array_equal(s0[name][()], PREFILL[name])
            l0 = s0["L000"]
            q_nope = l0["q_nope"]
            self.assertEqual((q_nope.dtype, q_nope.attrs["dtype"]), (np.dtype("<u2"), "bfloat16"))
            self.assertEqual(q_nope.shape, (4, H, DC))
            self.assertEqual([int(b) for b in q_nope[0, 0, :2]], [0x3F80, 0x3F82])
            np.testing.assert_array_equal(l0["q_pe"][()], prefill["q_pe"])
            self.assertEqual(l0["new_kv"].shape, (4, D))
            self.assertEqual(l0["out"].attrs["dtype"], "bfloat16")
            self.assertEqual(l0["lse"].dtype, np.dtype("<f4"))
            np.testing.assert_array_equal(l0["lse"][()], lse)
            self.assertEqual(l0["kv_cache_after"].attrs["dtype"], "float8_e4m3fn")
            self.assertEqual(sorted(s0["L077"]), ["new_kv", "q_nope", "q_pe"])
            self.assertEqual(sorted(f["steps/S001"]["L000"]), ["new_kv", "q_nope", "q_pe"])

    def test_bfloat16_pool(self):
        pool = np.full((PAGES, PAGE, D), 0xBF80, dtype=np.uint16)  # bf16 -1.0
        with self.writer(kv_dtype="bfloat16") as dump:
            dump.add_layer(0, 1.0, pool)
            dump.add_step(**DECODE).add_layer(0, **step_tensors(2, seed=4), kv_cache_after=pool)
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f.attrs["kv_dtype"], "bfloat16")
            cache = f["layers/L000/kv_cache"]
            self.assertEqual((cache.dtype, cache.attrs["dtype"]), (np.dtype("<u2"), "bfloat16"))
            np.testing.assert_array_equal(cache[()], pool)
            self.assertEqual(f["steps/S000/L000/kv_cache_after"].attrs["dtype"], "bfloat16")

    def test_torch_tensors_by_duck_typing(self):
        # The writer must view bfloat16 as 16-bit and float8_e4m3fn as 8-bit integers through the
        # tensor's own view(), without converting values.
        torch_module, Tensor = fake_torch(("int16", "uint8"), ("int16", "uint8", "float32"))
        pool = self.pool()
        tensors = step_tensors(2, seed=5)
        q_nope_bits = kvdump.bf16_bits_from_float32(tensors["q_nope"])
        lse = np.ones((2, H), dtype=np.float32)
        with mock.patch.dict(sys.modules, {"torch": torch_module}):
            with self.writer() as dump:
                dump.add_layer(0, 1.0, Tensor(pool, "float8_e4m3fn"))
                dump.add_step(**DECODE).add_layer(
                    0, q_nope=Tensor(q_nope_bits, "bfloat16"), q_pe=tensors["q_pe"],
                    new_kv=tensors["new_kv"], lse=Tensor(lse, "float32"))
            with h5py.File(self.path, "r") as f:
                np.testing.assert_array_equal(f["layers/L000/kv_cache"][()], pool)
                np.testing.assert_array_equal(f["steps/S000/L000/q_nope"][()], q_nope_bits)
                np.testing.assert_array_equal(f["steps/S000/L000/lse"][()], lse)
            with self.writer() as dump:
                self.assert_refused("/layers/L000/kv_cache", dump.add_layer, 0, 1.0,
                                    Tensor(pool, "float8_e5m2"))

    def test_import_does_not_import_torch(self):
        code = "import sys, kvdump; sys.exit(1 if 'torch' in sys.modules else 0)"
        result = subprocess.run([sys.executable, "-B", "-c", code], cwd=PYTHON_DIR)
        self.assertEqual(result.returncode, 0)


class CaptureOptionsTest(WriterTestCase):
    """float32_inputs and model_attributes, which kvdump.hf_capture uses."""

    def write_one_step(self, **options):
        source = np.full((PAGES, PAGE, D), 1 + 2.0**-20, dtype=np.float32)
        with self.writer(**options) as dump:
            dump.add_layer(0, 0.5, self.pool(0), kv_source=source)
            step = dump.add_step(**DECODE)
            step.add_layer(0, **step_tensors(2, seed=3))

    def test_float32_inputs_are_stored_unrounded(self):
        self.write_one_step(float32_inputs=True)
        expected = step_tensors(2, seed=3)
        with h5py.File(self.path, "r") as f:
            q_nope = f["steps/S000/L000/q_nope"]
            self.assertEqual(q_nope.dtype, np.float32)
            self.assertEqual(q_nope.attrs["dtype"], "float32")
            np.testing.assert_array_equal(q_nope[...], expected["q_nope"])
            np.testing.assert_array_equal(f["steps/S000/L000/new_kv"][...], expected["new_kv"])
            # 1 + 2^-20 is no bf16 value: kept only when stored as float32.
            self.assertEqual(float(f["layers/L000/kv_source"][0, 0, 0]), 1 + 2.0**-20)
            # q_pe was given as bf16 bits: stays bf16.
            self.assertEqual(f["steps/S000/L000/q_pe"].attrs["dtype"], "bfloat16")

    def test_without_float32_inputs_floats_round_to_bf16(self):
        self.write_one_step()
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f["layers/L000/kv_source"].dtype, np.uint16)
            self.assertEqual(f["steps/S000/L000/q_nope"].attrs["dtype"], "bfloat16")

    def test_model_attributes(self):
        self.write_one_step(model_attributes={"rope_type": "yarn", "rope_factor": 40.0,
                                              "qk_nope_head_dim": 192})
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f.attrs["rope_type"], "yarn")
            self.assertEqual(float(f.attrs["rope_factor"]), 40.0)
            self.assertEqual(int(f.attrs["qk_nope_head_dim"]), 192)
        self.assert_refused("/", self.writer, model_attributes={"sm_scale": 0.1})
        self.assert_refused("/", self.writer, model_attributes={"kv_rope_dtype": "bfloat16"})
        self.assert_refused("/", self.writer, model_attributes={"rope_factor": [40.0]})
        os.remove(self.path)
        self.assert_refused("/", self.writer, model_attributes={"format": "x"})
        self.assertFalse(os.path.exists(self.path))  # refused before the file is created


class RefusalTest(WriterTestCase):
    def test_root_attributes(self):
        self.assert_refused("/", self.writer, sm_scale=float("nan"))
        self.assert_refused("/", self.writer, sm_scale=float("inf"))
        self.assert_refused("/", self.writer, num_heads=0)
        self.assert_refused("/", self.writer, page_size=2.0)
        self.assert_refused("/", self.writer, kv_dtype="float8_e5m2")
        self.assertFalse(os.path.exists(self.path))  # refused before the file is created

    def test_layer_rules(self):
        with self.writer() as dump:
            for bad_scale in (0.0, -1.0, float("nan"), float("inf"), 1e-50):
                self.assert_refused("/layers/L003", dump.add_layer, 3, bad_scale, self.pool())
            self.assert_refused("/layers/L003/kv_cache", dump.add_layer, 3, 1.0,
                                self.pool().astype(np.float32))
            self.assert_refused("/layers/L003/kv_cache", dump.add_layer, 3, 1.0,
                                np.zeros((PAGES, PAGE, D + 1), np.uint8))
            dump.add_layer(3, 1.0, self.pool())
            self.assert_refused("/layers/L003", dump.add_layer, 3, 1.0, self.pool())
            with self.assertRaisesRegex(ValueError, re.escape(
                    "/layers/L004/kv_cache: shape (5, 4, 12) != (6, 4, 12)")):
                dump.add_layer(4, 1.0, np.zeros((PAGES - 1, PAGE, D), np.uint8))
            self.assert_refused("/layers/L004/kv_source", dump.add_layer, 4, 1.0, self.pool(),
                                kv_source=np.zeros((PAGES, PAGE, D), np.float64))
            dump.add_step(**DECODE).add_layer(3, **step_tensors(2, seed=0))
            self.assert_refused("/layers/L005", dump.add_layer, 5, 1.0, self.pool())

    def test_bfloat16_pool_scale_must_be_one(self):
        pool = np.zeros((PAGES, PAGE, D), np.uint16)
        with self.writer(kv_dtype="bfloat16") as dump:
            self.assert_refused("/layers/L000", dump.add_layer, 0, 2.0, pool)

    def test_step_before_layers(self):
        with self.writer() as dump:
            self.assert_refused("/steps/S000", dump.add_step, **DECODE)

    def check_step(self, path, **changes):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            self.assert_refused(path, dump.add_step, **{**PREFILL, **changes})

    def test_index_rules(self):
        self.check_step("/steps/S000", kind="extend")
        self.check_step("/steps/S000/qo_indptr", qo_indptr=[1, 3, 3, 4])
        self.check_step("/steps/S000/qo_indptr", qo_indptr=[])
        self.check_step("/steps/S000/qo_indptr", qo_indptr=[0, 3, 2, 4])
        self.check_step("/steps/S000/qo_indptr", qo_indptr=[0.0, 3.0, 3.0, 4.0])
        self.check_step("/steps/S000/kv_indptr", kv_indptr=[0, 2, 3])
        self.check_step("/steps/S000/kv_indptr", kv_indptr=[0, 2, 1, 3])
        self.check_step("/steps/S000/kv_indptr", kv_indptr=[0, 2, 2, 2])
        self.check_step("/steps/S000/kv_indices", kv_indices=[2, 6, 0])
        self.check_step("/steps/S000/kv_indices", kv_indices=[2, -1, 0])
        self.check_step("/steps/S000/kv_indices", kv_indices=[2, 2**31, 0])
        self.check_step("/steps/S000/kv_last_page_len", kv_last_page_len=[2, 0])
        self.check_step("/steps/S000/kv_last_page_len", kv_last_page_len=[0, 0, 1])
        self.check_step("/steps/S000/kv_last_page_len", kv_last_page_len=[5, 0, 1])
        self.check_step("/steps/S000/kv_last_page_len", kv_last_page_len=[2, 1, 1])
        self.check_step("/steps/S000/new_kv_slots", new_kv_slots=[11, 20, 21])
        # Neighbouring slot of row 2 (position 5 is slot 21, not 22).
        self.check_step("/steps/S000/new_kv_slots", new_kv_slots=[11, 20, 22, 0])
        # Two-row request with kv_len 1: row 0 would sit at position -1.
        self.check_step("/steps/S000/kv_indptr", qo_indptr=[0, 3, 3, 5],
                        new_kv_slots=[11, 20, 21, 0, 1])
        self.check_step("/steps/S000/qo_indptr", **{**PREFILL, "kind": "decode"})

    def test_validate_step_indices_alone(self):
        arrays = kvdump.validate_step_indices("/steps/S007", num_pages=PAGES, page_size=PAGE,
                                              **PREFILL)
        for name, value in arrays.items():
            self.assertEqual(value.dtype, np.dtype("<i4"), name)
            np.testing.assert_array_equal(value, PREFILL[name])
        self.assert_refused("/steps/S007/kv_indices", kvdump.validate_step_indices, "/steps/S007",
                            num_pages=5, page_size=PAGE, **PREFILL)

    def test_new_kv_slots_message(self):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            with self.assertRaisesRegex(ValueError, re.escape(
                    "/steps/S000/new_kv_slots: row 2 (request 0, position 5) has slot 22, but "
                    "that position's slot is 21")):
                dump.add_step(**{**PREFILL, "new_kv_slots": [11, 20, 22, 0]})

    def test_step_layer_rules(self):
        with self.writer(num_heads=8, kv_lora_rank=512) as dump:
            dump.add_layer(0, 1.0, np.zeros((PAGES, PAGE, 512 + DR), np.uint8))
            dump.add_step(**DECODE).add_layer(0, np.zeros((2, 8, 512), np.uint16),
                                              np.zeros((2, 8, DR), np.uint16),
                                              np.zeros((2, 512 + DR), np.uint16))
            # One request, pages [2, 5] full: 8 tokens, 4 new rows at positions 4..7 = slots 20..23.
            step = dump.add_step(kind="prefill", qo_indptr=[0, 4], kv_indptr=[0, 2],
                                 kv_indices=[2, 5], kv_last_page_len=[4],
                                 new_kv_slots=[20, 21, 22, 23])
            good = dict(q_nope=np.zeros((4, 8, 512), np.uint16),
                        q_pe=np.zeros((4, 8, DR), np.uint16),
                        new_kv=np.zeros((4, 512 + DR), np.uint16))
            with self.assertRaisesRegex(ValueError, "^" + re.escape(
                    "/steps/S001/L000/q_nope: shape (4, 16, 512) != (4, 8, 512)") + "$"):
                step.add_layer(0, **{**good, "q_nope": np.zeros((4, 16, 512), np.uint16)})
            self.assert_refused("/steps/S001/L000/q_pe", step.add_layer, 0,
                                **{**good, "q_pe": np.zeros((4, 8, DR), np.float64)})
            self.assert_refused("/steps/S001/L000/new_kv", step.add_layer, 0,
                                **{**good, "new_kv": np.zeros((4, 512), np.uint16)})
            self.assert_refused("/steps/S001/L000/out", step.add_layer, 0, **good,
                                out=np.zeros((4, 8, DR), np.uint16))
            self.assert_refused("/steps/S001/L000/lse", step.add_layer, 0, **good,
                                lse=np.zeros((4, 8), np.float64))
            self.assert_refused("/steps/S001/L000/lse", step.add_layer, 0, **good,
                                lse=np.zeros((4, 7), np.float32))
            self.assert_refused("/steps/S001/L000/kv_cache_after", step.add_layer, 0, **good,
                                kv_cache_after=np.zeros((PAGES, PAGE, 512 + DR), np.uint16))
            self.assert_refused("/steps/S001/L001", step.add_layer, 1, **good)
            step.add_layer(0, **good)
            self.assert_refused("/steps/S001/L000", step.add_layer, 0, **good)

    def test_close_requires_every_layer_in_every_step(self):
        dump = self.writer()
        dump.add_layer(0, 1.0, self.pool())
        dump.add_layer(2, 1.0, self.pool())
        dump.add_step(**DECODE).add_layer(0, **step_tensors(2, seed=0))
        self.assert_refused("/steps/S000/L002", dump.close)
        dump.close()  # already closed: nothing more to say

    def test_two_rows_writing_one_slot(self):
        # Requests 0 and 1 share page 2 and both put their last token in its slot 2 * 4 + 1.
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            with self.assertRaisesRegex(ValueError, "^" + re.escape(
                    "/steps/S000/new_kv_slots: rows 0 and 1 both write slot 9: two writes of one "
                    "slot in one step would race") + "$"):
                dump.add_step("decode", qo_indptr=[0, 1, 2], kv_indptr=[0, 1, 2],
                              kv_indices=[2, 2], kv_last_page_len=[2, 2], new_kv_slots=[9, 9])


class OutputFileTest(WriterTestCase):
    """The file appears only when complete (atomic by default), or is written as it goes
    (incremental=True, for captures that may stop); /steps exists from the start."""

    def leftovers(self):
        return sorted(name for name in os.listdir(self._dir.name) if name != "dump.h5")

    def test_exception_leaves_no_file(self):
        with self.assertRaises(ValueError):
            with self.writer() as dump:
                dump.add_layer(0, 1.0, self.pool())
                self.assertFalse(os.path.exists(self.path))  # not before close
                dump.add_layer(0, 1.0, self.pool())  # twice: ValueError
        self.assertFalse(os.path.exists(self.path))
        self.assertEqual(self.leftovers(), [])

    def test_exception_keeps_an_existing_file(self):
        with open(self.path, "wb") as old:
            old.write(b"previous content")
        with self.assertRaises(RuntimeError):
            with self.writer() as dump:
                dump.add_layer(0, 1.0, self.pool())
                raise RuntimeError("the capture failed")
        with open(self.path, "rb") as old:
            self.assertEqual(old.read(), b"previous content")
        self.assertEqual(self.leftovers(), [])

    def test_incomplete_close_leaves_no_file(self):
        dump = self.writer()
        dump.add_layer(0, 1.0, self.pool())
        dump.add_layer(2, 1.0, self.pool())
        dump.add_step(**DECODE).add_layer(0, **step_tensors(2, seed=0))
        self.assert_refused("/steps/S000/L002", dump.close)
        self.assertFalse(os.path.exists(self.path))
        self.assertEqual(self.leftovers(), [])

    def test_dropped_writer_leaves_no_temporary(self):
        dump = self.writer()
        dump.add_layer(0, 1.0, self.pool())
        del dump
        import gc

        gc.collect()
        self.assertFalse(os.path.exists(self.path))
        self.assertEqual(self.leftovers(), [])

    def test_permissions_of_a_plain_file(self):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
        mask = os.umask(0)
        os.umask(mask)
        self.assertEqual(os.stat(self.path).st_mode & 0o777, 0o666 & ~mask)

    def test_dump_without_steps_has_the_steps_group(self):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
        with h5py.File(self.path, "r") as f:
            self.assertIn("steps", f)
            self.assertEqual(len(f["steps"]), 0)
        binary = os.environ.get("KVAUDIT_BINARY")
        if binary and os.path.exists(binary):
            info = subprocess.run([binary, "info", self.path], capture_output=True, text=True)
            self.assertEqual(info.returncode, 0, info.stdout + info.stderr)

    def test_incremental_writes_the_path_and_flushes(self):
        dump = self.writer(incremental=True)
        dump.add_layer(0, 1.0, self.pool())
        step = dump.add_step(**DECODE)
        step.add_layer(0, **step_tensors(2, seed=0))
        dump.flush()
        self.assertEqual(self.leftovers(), [])
        # Another reader sees the flushed step while the writer is still open.
        code = ("import h5py, sys; f = h5py.File(sys.argv[1], 'r', locking=False); "
                "print(sorted(f['steps']), sorted(f['steps/S000']))")
        seen = subprocess.run([sys.executable, "-c", code, self.path], capture_output=True,
                              text=True)
        self.assertEqual(seen.returncode, 0, seen.stderr)
        self.assertIn("['S000'] ['L000', 'kv_indices'", seen.stdout)
        with self.assertRaises(RuntimeError):
            with dump:
                raise RuntimeError("the server stopped")
        self.assertTrue(os.path.exists(self.path))  # an incremental file is kept as written
        with h5py.File(self.path, "r") as f:
            self.assertEqual(sorted(f["steps"]), ["S000"])

    def test_flush_after_close_is_refused(self):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
        self.assert_refused("/", dump.flush)



# --- kvdump v1.1 ----------------------------------------------------------------------------------

GROUP = 4  # latent channels per scale: G = DC / GROUP = 2 scales per slot
G = DC // GROUP
PACKED = DC + 4 * G + 2 * DR  # flashmla_fp8 slot bytes: 8 codes, 2 float32 scales, 4 bf16


def float32_of_bits(bits):
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def grouped_pool(seed, scale_format="float32", rope_dtype="bfloat16", kv_scale=1.0):
    """(codes [PAGES, PAGE, DC], rope [PAGES, PAGE, DR], scales [PAGES, PAGE, G], rows [S, D])
    of random rows quantized with the v1.1 rule."""
    rows = np.random.default_rng(seed).standard_normal((PAGES * PAGE, D)).astype(np.float32)
    rows[1, :GROUP] = 0  # one all-zero group: scale 1
    codes, rope, scales = kvdump.quantize_rows(rows, DC, GROUP, scale_format, rope_dtype, kv_scale)
    return (codes.reshape(PAGES, PAGE, DC), rope.reshape(PAGES, PAGE, DR),
            scales.reshape(PAGES, PAGE, G), rows)


class V11WriterTestCase(WriterTestCase):
    def grouped_writer(self, **overrides):
        options = dict(kv_scale_kind="per_token_group", kv_scale_group_size=GROUP,
                       kv_scale_format="float32", kv_rope_dtype="bfloat16")
        return self.writer(**{**options, **overrides})

    def assert_dataset(self, dataset, dtype, shape, dtype_attr):
        self.assertEqual(dataset.dtype, np.dtype(dtype), dataset.name)
        self.assertEqual(dataset.shape, shape, dataset.name)
        self.assertEqual(dataset.attrs.get("dtype"), dtype_attr, dataset.name)


class V11RoundTripTest(V11WriterTestCase):
    def check_root(self, f, scale_format, rope_dtype, layout):
        self.assertEqual(f.attrs["format_version"], 1)
        self.assertEqual(f.attrs.get_id("format_minor_version").dtype, np.dtype("<i4"))
        self.assertEqual(f.attrs["format_minor_version"], 1)
        self.assertEqual(f.attrs["kv_scale_kind"], "per_token_group")
        self.assertEqual(f.attrs.get_id("kv_scale_group_size").dtype.kind, "i")
        self.assertEqual(f.attrs["kv_scale_group_size"], GROUP)
        self.assertEqual(f.attrs["kv_scale_format"], scale_format)
        self.assertEqual(f.attrs["kv_rope_dtype"], rope_dtype)
        self.assertEqual(f.attrs["kv_cache_layout"], layout)
        self.assertEqual(f.attrs["kv_dtype"], "float8_e4m3fn")

    def test_split_bf16_rope_float32_scales(self):
        codes, rope, scales, rows = grouped_pool(0)
        after = grouped_pool(1)
        source = kvdump.bf16_bits_from_float32(rows).reshape(PAGES, PAGE, D)
        with self.grouped_writer() as dump:
            dump.add_layer(0, 1.0, codes, kv_rope=rope, kv_scales=scales, kv_source=source)
            step = dump.add_step(**DECODE)
            step.add_layer(0, **step_tensors(2, seed=2), kv_cache_after=after[0],
                           kv_rope_after=after[1], kv_scales_after=after[2])
        with h5py.File(self.path, "r") as f:
            self.check_root(f, "float32", "bfloat16", "split")
            layer = f["layers/L000"]
            self.assertEqual(sorted(layer), ["kv_cache", "kv_rope", "kv_scales", "kv_source"])
            self.assertEqual(layer.attrs["kv_scale"], 1.0)
            self.assert_dataset(layer["kv_cache"], "<u1", (PAGES, PAGE, DC), "float8_e4m3fn")
            self.assert_dataset(layer["kv_rope"], "<u2", (PAGES, PAGE, DR), "bfloat16")
            self.assert_dataset(layer["kv_scales"], "<f4", (PAGES, PAGE, G), "float32")
            self.assert_dataset(layer["kv_source"], "<u2", (PAGES, PAGE, D), "bfloat16")
            np.testing.assert_array_equal(layer["kv_cache"][()], codes)
            np.testing.assert_array_equal(layer["kv_rope"][()], rope)
            np.testing.assert_array_equal(layer["kv_scales"][()], scales)
            self.assertEqual(layer["kv_scales"][0, 1, 0], 1.0)  # the all-zero group
            l0 = f["steps/S000/L000"]
            self.assertEqual(sorted(l0), ["kv_cache_after", "kv_rope_after", "kv_scales_after",
                                          "new_kv", "q_nope", "q_pe"])
            self.assert_dataset(l0["kv_cache_after"], "<u1", (PAGES, PAGE, DC), "float8_e4m3fn")
            self.assert_dataset(l0["kv_rope_after"], "<u2", (PAGES, PAGE, DR), "bfloat16")
            self.assert_dataset(l0["kv_scales_after"], "<f4", (PAGES, PAGE, G), "float32")
            np.testing.assert_array_equal(l0["kv_scales_after"][()], after[2])

    def test_split_e4m3_rope_e8m0_scales(self):
        codes, rope, scales, _ = grouped_pool(3, "e8m0", "float8_e4m3fn", kv_scale=0.5)
        with self.grouped_writer(kv_scale_format="e8m0", kv_rope_dtype="float8_e4m3fn") as dump:
            dump.add_layer(0, 0.5, codes, kv_rope=rope, kv_scales=scales)
            dump.add_step(**DECODE).add_layer(0, **step_tensors(2, seed=2), kv_cache_after=codes,
                                              kv_rope_after=rope, kv_scales_after=scales)
        with h5py.File(self.path, "r") as f:
            self.check_root(f, "e8m0", "float8_e4m3fn", "split")
            layer = f["layers/L000"]
            self.assertEqual(layer.attrs["kv_scale"], 0.5)
            self.assert_dataset(layer["kv_rope"], "<u1", (PAGES, PAGE, DR), "float8_e4m3fn")
            self.assert_dataset(layer["kv_scales"], "<u1", (PAGES, PAGE, G), "float8_e8m0fnu")
            np.testing.assert_array_equal(layer["kv_rope"][()], rope)
            np.testing.assert_array_equal(layer["kv_scales"][()], scales)
            self.assertEqual(layer["kv_scales"][0, 1, 0], 127)  # the all-zero group: 2^0
            l0 = f["steps/S000/L000"]
            self.assert_dataset(l0["kv_scales_after"], "<u1", (PAGES, PAGE, G), "float8_e8m0fnu")
            self.assert_dataset(l0["kv_rope_after"], "<u1", (PAGES, PAGE, DR), "float8_e4m3fn")

    def test_flashmla_fp8_packed(self):
        codes, rope, scales, _ = grouped_pool(4, "power_of_two")
        packed = kvdump.pack_flashmla_fp8(codes, rope, scales)
        self.assertEqual(packed.shape, (PAGES, PAGE, PACKED))
        self.assertEqual(kvdump.flashmla_fp8_width(DC, DR, GROUP), PACKED)
        with self.grouped_writer(kv_scale_format="power_of_two",
                                 kv_cache_layout="flashmla_fp8") as dump:
            dump.add_layer(0, 1.0, packed)
            dump.add_layer(77, 1.0, packed)
            step = dump.add_step(**PREFILL)
            step.add_layer(0, **step_tensors(4, seed=5), kv_cache_after=packed)
            step.add_layer(77, **step_tensors(4, seed=6))
        with h5py.File(self.path, "r") as f:
            self.check_root(f, "power_of_two", "bfloat16", "flashmla_fp8")
            layer = f["layers/L000"]
            self.assertEqual(sorted(layer), ["kv_cache"])
            self.assert_dataset(layer["kv_cache"], "<u1", (PAGES, PAGE, PACKED), "flashmla_fp8")
            np.testing.assert_array_equal(layer["kv_cache"][()], packed)
            after = f["steps/S000/L000/kv_cache_after"]
            self.assert_dataset(after, "<u1", (PAGES, PAGE, PACKED), "flashmla_fp8")
            self.assertNotIn("kv_rope_after", f["steps/S000/L000"])
            stored = layer["kv_cache"][()]
        parts = kvdump.unpack_flashmla_fp8(stored, DC, GROUP)
        for part, original in zip(parts, (codes, rope, scales)):
            self.assertEqual(part.dtype, original.dtype)
            np.testing.assert_array_equal(part, original)

    def test_plain_v1_file_has_no_minor_version(self):
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            dump.add_step(**DECODE).add_layer(0, **step_tensors(2, seed=0))
        with h5py.File(self.path, "r") as f:
            for name in ("format_minor_version", "kv_scale_group_size", "kv_scale_format",
                         "kv_rope_dtype", "kv_cache_layout"):
                self.assertNotIn(name, f.attrs)
            self.assertEqual(f.attrs["kv_scale_kind"], "per_tensor")

    def test_topk_indices_mark_the_file_1_1(self):
        # S000 rows sit at positions 3, 4, 5 (request 0) and 0 (request 2); S001 at 6 and 1.
        topk = np.array([[3, -1, 0], [-1, 4, 2], [5, 0, -1], [-1, -1, 0]], dtype=np.int64)
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            dump.add_layer(77, 1.0, self.pool())
            step = dump.add_step(**PREFILL)
            step.add_layer(0, **step_tensors(4, seed=1), topk_indices=topk)
            step.add_layer(77, **step_tensors(4, seed=1))  # dense for this layer
            step = dump.add_step(**DECODE)
            step.add_layer(0, **step_tensors(2, seed=2), topk_indices=[[6], [1]])
            step.add_layer(77, **step_tensors(2, seed=2), topk_indices=[[0, 6], [-1, 0]])
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f.attrs["format_minor_version"], 1)
            self.assertEqual(f.attrs["kv_scale_kind"], "per_tensor")
            self.assertNotIn("kv_scale_group_size", f.attrs)
            stored = f["steps/S000/L000/topk_indices"]
            self.assertEqual((stored.dtype, stored.shape), (np.dtype("<i4"), (4, 3)))
            self.assertNotIn("dtype", stored.attrs)
            np.testing.assert_array_equal(stored[()], topk)
            self.assertNotIn("topk_indices", f["steps/S000/L077"])
            self.assertEqual(f["steps/S001/L077/topk_indices"].shape, (2, 2))

    def test_e8m0_scales_from_torch_by_duck_typing(self):
        # A torch.float8_e8m0fnu tensor: viewed as uint8, never converted.
        torch_module, Tensor = fake_torch(("uint8",), ("uint8",))
        codes, rope, scales, _ = grouped_pool(7, "e8m0")
        with mock.patch.dict(sys.modules, {"torch": torch_module}):
            with self.grouped_writer(kv_scale_format="e8m0") as dump:
                self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, codes,
                                    kv_rope=rope, kv_scales=Tensor(scales, "float8_e4m3fn"))
                dump.add_layer(0, 1.0, codes, kv_rope=rope,
                               kv_scales=Tensor(scales, "float8_e8m0fnu"))
        with h5py.File(self.path, "r") as f:
            np.testing.assert_array_equal(f["layers/L000/kv_scales"][()], scales)


class GroupQuantizerTest(unittest.TestCase):
    """The v1.1 write rule (kvdump-v1.md "The write rule with per_token_group") on cases worked
    out by hand. Groups of 4: scale = amax / 448 (float32), the next power of two, or its e8m0
    byte (exponent + 127); codes e4m3_rne_satfinite(x / scale)."""

    def quantize(self, values, scale_format, reciprocal=False):
        return kvdump.quantize_groups(np.array(values, dtype=np.float32), GROUP, scale_format,
                                      reciprocal)

    def test_amax_three_times_448(self):
        # Group 0: amax 1344 = 448 * 3. float32: scale 3, codes of 448, 1/3, -2/3, 0:
        #   448 = 0x7E; 1/3 -> 0.34375 = 1.375 * 2^-2 (E 5, M 3) = 0x2B; -2/3 -> -0.6875 = 0xB3.
        # power_of_two: 1344 / 448 = 3 -> 4; 336 -> 320 (tie 10.5 quanta of 32 -> 10) = 0x7A;
        #   0.25 = 0x28; -0.5 = 0xB0. e8m0: the same 4 = 2^2, code 129.
        # Group 1 is all zeros: scale 1 (e8m0 code 127) and zero codes.
        row = [448 * 3, 1, -2, 0, 0, 0, 0, 0]
        codes, scales = self.quantize(row, "float32")
        self.assertEqual(scales.dtype, np.float32)
        self.assertEqual(scales.tolist(), [3.0, 1.0])
        self.assertEqual(codes.tolist(), [0x7E, 0x2B, 0xB3, 0, 0, 0, 0, 0])
        codes, scales = self.quantize(row, "power_of_two")
        self.assertEqual(scales.tolist(), [4.0, 1.0])
        self.assertEqual(codes.tolist(), [0x7A, 0x28, 0xB0, 0, 0, 0, 0, 0])
        codes_e8m0, scales = self.quantize(row, "e8m0")
        self.assertEqual(scales.dtype, np.uint8)
        self.assertEqual(scales.tolist(), [129, 127])
        self.assertEqual(codes_e8m0.tolist(), codes.tolist())
        self.assertEqual(kvdump.decode_e8m0(scales).tolist(), [4.0, 1.0])

    def test_all_zero_group(self):
        for scale_format, one in (("float32", 1.0), ("power_of_two", 1.0), ("e8m0", 127)):
            codes, scales = self.quantize(np.zeros((3, 8)), scale_format)
            self.assertEqual(codes.shape, (3, 8))
            self.assertFalse(codes.any(), scale_format)
            self.assertEqual(scales.shape, (3, G))
            self.assertTrue(np.all(scales == one), scale_format)

    def test_saturation_and_non_finite(self):
        # Non-finite elements take no part in amax (448, scale 1): +-inf saturates to +-448,
        # NaN gives 0x7F. A group with no finite element is "all zero": scale 1.
        codes, scales = self.quantize([np.inf, 448, -np.inf, np.nan,
                                       np.nan, np.inf, 0, 0], "float32")
        self.assertEqual(scales.tolist(), [1.0, 1.0])
        self.assertEqual(codes.tolist(), [0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x7E, 0, 0])
        # An e4m3 RoPE part follows v1's rule with kv_scale: 1000 / 2 = 500 saturates to 448;
        # -928 / 2 = -464 ties down to -448; 3 / 2 = 1.5 = 0x3C.
        rows = np.zeros((1, DC + 3), dtype=np.float32)
        rows[0, DC:] = [1000, -928, 3]
        _, rope, _ = kvdump.quantize_rows(rows, DC, GROUP, "float32", "float8_e4m3fn", 2.0)
        self.assertEqual(rope.tolist(), [[0x7E, 0xFE, 0x3C]])

    def test_float32_scale_is_one_division(self):
        # amax 1: scale = fp32(1 / 448) (0x3B124925), and 1 / scale = 447.99997... rounds to 448.
        codes, scales = self.quantize([1, 0.5, 0, 0], "float32")
        self.assertEqual(scales[0], np.float32(1) / np.float32(448))
        self.assertEqual(int(scales[0:1].view(np.uint32)[0]), 0x3B124925)
        self.assertEqual(codes.tolist(), [0x7E, kvdump.quantize_e4m3(
            np.float32([0.5]), scales[0])[0], 0, 0])

    def test_reciprocal_differs_from_division(self):
        # amax 5: scale s = fp32(5 / 448) (0x3C36DB6E). x = 0x39700001: x / s is exactly
        # 0.020508..13 before rounding; the binary32 division rounds it to 0.0205078125, the
        # midpoint of codes 0x0A (1.25 * 2^-6) and 0x0B (1.375 * 2^-6), which ties to even 0x0A.
        # x * fp32(1 / s) rounds to just above the midpoint: 0x0B.
        x = float32_of_bits(0x39700001)
        scale = np.float32(5) / np.float32(448)
        self.assertEqual(int(np.array([scale]).view(np.uint32)[0]), 0x3C36DB6E)
        self.assertEqual(x / scale, np.float32(0.0205078125))
        self.assertGreater(x * (np.float32(1) / scale), np.float32(0.0205078125))
        codes, scales = self.quantize([5, x, 0, 0], "float32")
        self.assertEqual(scales[0], scale)
        self.assertEqual(codes.tolist(), [0x7E, 0x0A, 0, 0])
        codes, _ = self.quantize([5, x, 0, 0], "float32", reciprocal=True)
        self.assertEqual(codes.tolist(), [0x7E, 0x0B, 0, 0])

    def test_power_of_two_is_exact(self):
        # The smallest 2^k >= amax / 448, checked with exact rationals around every boundary
        # amax = 448 * 2^k (and the float32 extremes); e8m0 clamps k to -127..127.
        from fractions import Fraction

        boundaries = np.array([448.0 * 2.0**k for k in range(-140, 119, 7)], dtype=np.float32)
        amax = np.concatenate([boundaries, np.nextafter(boundaries, np.float32(0)),
                               np.nextafter(boundaries, np.float32(np.inf)),
                               np.float32([449, 447, 1, 3.4028235e38, 2.0**-149, 2.0**-126])])
        rows = np.zeros((amax.size, GROUP), dtype=np.float32)
        rows[:, 1] = -amax
        scales = kvdump.group_scales(rows, GROUP, "power_of_two")[:, 0]
        codes = kvdump.group_scales(rows, GROUP, "e8m0")[:, 0]
        for a, scale, code in zip(amax, scales, codes):
            exact = Fraction(float(a)) / 448
            k = 0
            while Fraction(2) ** k < exact:
                k += 1
            while Fraction(2) ** (k - 1) >= exact:
                k -= 1
            self.assertEqual(Fraction(float(scale)), Fraction(2) ** max(k, -149), float(a))
            self.assertEqual(int(code), min(max(k, -127), 127) + 127, float(a))
            self.assertLessEqual(Fraction(float(a)) / Fraction(float(scale)), 448)  # no saturation

    def test_decode_e8m0(self):
        values = kvdump.decode_e8m0(np.array([0, 126, 127, 129, 254, 255], dtype=np.uint8))
        self.assertEqual(values.dtype, np.float32)
        self.assertEqual(values[:5].tolist(), [2.0**-127, 0.5, 1.0, 4.0, 2.0**127])
        self.assertTrue(np.isnan(values[5]))

    def test_quantize_rows(self):
        rows = np.random.default_rng(8).standard_normal((5, D)).astype(np.float32)
        codes, rope, scales = kvdump.quantize_rows(rows, DC, GROUP)
        self.assertEqual((codes.dtype, codes.shape), (np.uint8, (5, DC)))
        self.assertEqual((rope.dtype, rope.shape), (np.uint16, (5, DR)))
        self.assertEqual((scales.dtype, scales.shape), (np.float32, (5, G)))
        np.testing.assert_array_equal(rope, kvdump.bf16_bits_from_float32(rows[:, DC:]))
        # Each latent element: v1's rule with its group's scale in place of kv_scale.
        for n in range(5):
            for g in range(G):
                part = rows[n, g * GROUP:(g + 1) * GROUP]
                self.assertEqual(scales[n, g], np.max(np.abs(part)) / np.float32(448))
                np.testing.assert_array_equal(codes[n, g * GROUP:(g + 1) * GROUP],
                                              kvdump.quantize_e4m3(part, scales[n, g]))
        _, rope_e4m3, _ = kvdump.quantize_rows(rows, DC, GROUP, "e8m0", "float8_e4m3fn", 0.25)
        np.testing.assert_array_equal(rope_e4m3, kvdump.quantize_e4m3(rows[:, DC:], 0.25))

    def test_quantizer_refusals(self):
        rows = np.zeros((2, D), dtype=np.float32)
        cases = [
            ((rows.astype(np.float64), DC, GROUP), "values must be float32"),
            ((rows, DC, 3), "group_size 3 does not divide the latent width 8"),
            ((rows, DC, 0), "group_size = 0 is not a positive integer"),
            ((rows, DC, GROUP, "e5m2"), 'scale_format "e5m2" is not one of'),
            ((rows, DC, GROUP, "float32", "float16"), 'rope_dtype "float16" is not one of'),
            ((rows, DC, GROUP, "float32", "bfloat16", 2.0), "must be 1 with a bfloat16 RoPE"),
            ((rows, DC, GROUP, "float32", "float8_e4m3fn", 0.0), "is not finite and > 0"),
            ((rows, D + 1, GROUP), "kv_lora_rank = 13 is not in 1..12"),
            ((rows[0], DC, GROUP), "rows must be [N, D]"),
        ]
        for args, message in cases:
            with self.assertRaisesRegex(ValueError, "^quantize_rows: .*" + re.escape(message)):
                kvdump.quantize_rows(*args)


class FlashMlaPackingTest(unittest.TestCase):
    def test_packed_bytes_are_the_split_parts_concatenated(self):
        rows = np.random.default_rng(9).standard_normal((6, D)).astype(np.float32)
        codes, rope, scales = kvdump.quantize_rows(rows, DC, GROUP, "power_of_two")
        packed = kvdump.pack_flashmla_fp8(codes, rope, scales)
        self.assertEqual((packed.dtype, packed.shape), (np.uint8, (6, PACKED)))
        for n in range(6):
            expected = (codes[n].tobytes() + scales[n].astype("<f4").tobytes()
                        + rope[n].astype("<u2").tobytes())
            self.assertEqual(packed[n].tobytes(), expected)

    def test_one_slot_by_hand(self):
        # Codes 0x7E, 0x01, ...; scales 3.0 (0x40400000) and 0.5 (0x3F000000) little-endian;
        # RoPE bf16 1.0 (0x3F80) and -2.0 (0xC000) little-endian.
        codes = np.array([0x7E, 1, 2, 3, 4, 5, 6, 7], dtype=np.uint8)
        scales = np.array([3.0, 0.5], dtype=np.float32)
        rope = np.array([0x3F80, 0xC000, 0, 1], dtype=np.uint16)
        packed = kvdump.pack_flashmla_fp8(codes, rope, scales)
        self.assertEqual(packed.tobytes(), bytes([0x7E, 1, 2, 3, 4, 5, 6, 7,
                                                  0, 0, 0x40, 0x40, 0, 0, 0, 0x3F,
                                                  0x80, 0x3F, 0, 0xC0, 0, 0, 1, 0]))
        back = kvdump.unpack_flashmla_fp8(packed, DC, GROUP)
        self.assertEqual([part.tolist() for part in back],
                         [codes.tolist(), rope.tolist(), [3.0, 0.5]])

    def test_flashmla_width_656(self):
        self.assertEqual(kvdump.flashmla_fp8_width(512, 64, 128), 656)
        rows = np.random.default_rng(10).standard_normal((3, 576)).astype(np.float32)
        parts = kvdump.quantize_rows(rows, 512, 128, "power_of_two")
        packed = kvdump.pack_flashmla_fp8(*parts)
        self.assertEqual(packed.shape, (3, 656))
        for part, original in zip(kvdump.unpack_flashmla_fp8(packed, 512, 128), parts):
            np.testing.assert_array_equal(part, original)

    def test_packing_refusals(self):
        codes = np.zeros((2, DC), np.uint8)
        scales = np.ones((2, G), np.float32)
        rope = np.zeros((2, DR), np.uint16)
        with self.assertRaisesRegex(ValueError, "^pack_flashmla_fp8: scales must be float32"):
            kvdump.pack_flashmla_fp8(codes, rope, scales.view(np.uint8)[:, :G])
        with self.assertRaisesRegex(ValueError, "^pack_flashmla_fp8: rope_bits must be uint16"):
            kvdump.pack_flashmla_fp8(codes, rope.astype(np.float32), scales)
        with self.assertRaisesRegex(ValueError, "^pack_flashmla_fp8: scales shape"):
            kvdump.pack_flashmla_fp8(codes, rope, scales[:1])
        with self.assertRaisesRegex(ValueError, "^unpack_flashmla_fp8: width 23 is not"):
            kvdump.unpack_flashmla_fp8(np.zeros((2, PACKED - 1), np.uint8), DC, GROUP)


class V11RefusalTest(V11WriterTestCase):
    def test_root_options(self):
        cases = [
            (dict(kv_scale_group_size=None), "kv_scale_group_size = None is not a positive"),
            (dict(kv_scale_group_size=3), "kv_scale_group_size = 3 does not divide kv_lora_rank"),
            (dict(kv_scale_format="ue8m0"), "kv_scale_format 'ue8m0' is not one of"),
            (dict(kv_scale_format=None), "kv_scale_format None is not one of"),
            (dict(kv_rope_dtype="float16"), "kv_rope_dtype 'float16' is not one of"),
            (dict(kv_cache_layout="flashmla"), "kv_cache_layout 'flashmla' is not one of"),
            (dict(kv_cache_layout="flashmla_fp8", kv_scale_format="e8m0"),
             'must be "float32" or "power_of_two", not "e8m0"'),
            (dict(kv_cache_layout="flashmla_fp8", kv_rope_dtype="float8_e4m3fn"),
             'kv_rope_dtype must be "bfloat16"'),
            (dict(kv_dtype="bfloat16"), 'needs kv_dtype "float8_e4m3fn", not "bfloat16"'),
            (dict(kv_scale_kind="per_block"), 'kv_scale_kind "per_block" is not one of'),
        ]
        for overrides, message in cases:
            with self.assertRaisesRegex(ValueError, "^/: .*" + re.escape(message)):
                self.grouped_writer(**overrides)
        with self.assertRaisesRegex(ValueError, "^/: kv_scale_group_size = 4 is a per_token_group "
                                                "option"):
            self.writer(kv_scale_group_size=4)
        self.assertFalse(os.path.exists(self.path))

    def test_layer_rules(self):
        codes, rope, scales, _ = grouped_pool(0)
        with self.grouped_writer() as dump:
            self.assert_refused("/layers/L000/kv_rope", dump.add_layer, 0, 1.0, codes,
                                kv_scales=scales)
            self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, codes,
                                kv_rope=rope)
            self.assert_refused("/layers/L000/kv_cache", dump.add_layer, 0, 1.0,
                                np.zeros((PAGES, PAGE, D), np.uint8), kv_rope=rope,
                                kv_scales=scales)
            self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, codes,
                                kv_rope=rope, kv_scales=scales.astype(np.float64))
            self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, codes,
                                kv_rope=rope, kv_scales=scales[:, :, :1])
            self.assert_refused("/layers/L000/kv_rope", dump.add_layer, 0, 1.0, codes,
                                kv_rope=rope.astype(np.uint8), kv_scales=scales)
            self.assert_refused("/layers/L000", dump.add_layer, 0, 2.0, codes, kv_rope=rope,
                                kv_scales=scales)
            dump.add_layer(0, 1.0, codes, kv_rope=rope, kv_scales=scales)  # the refusals left
            with self.assertRaisesRegex(ValueError, re.escape(  # num_pages unset until now
                    "/layers/L001/kv_cache: shape (5, 4, 8) != (6, 4, 8)")):
                dump.add_layer(1, 1.0, codes[:5], kv_rope=rope[:5], kv_scales=scales[:5])
        with self.grouped_writer(kv_scale_format="e8m0") as dump:
            self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, codes,
                                kv_rope=rope, kv_scales=scales)  # float32 for e8m0 codes
        with self.grouped_writer(kv_cache_layout="flashmla_fp8") as dump:
            packed = kvdump.pack_flashmla_fp8(codes, rope, scales)
            self.assert_refused("/layers/L000/kv_rope", dump.add_layer, 0, 1.0, packed,
                                kv_rope=rope)
            self.assert_refused("/layers/L000/kv_cache", dump.add_layer, 0, 1.0,
                                packed.view(np.int8))
            self.assert_refused("/layers/L000/kv_cache", dump.add_layer, 0, 1.0, codes)
        with self.writer() as dump:
            self.assert_refused("/layers/L000/kv_scales", dump.add_layer, 0, 1.0, self.pool(),
                                kv_scales=scales)

    def test_step_pool_after_all_or_none(self):
        codes, rope, scales, _ = grouped_pool(0)
        with self.grouped_writer() as dump:
            dump.add_layer(0, 1.0, codes, kv_rope=rope, kv_scales=scales)
            step = dump.add_step(**DECODE)
            tensors = step_tensors(2, seed=1)
            self.assert_refused("/steps/S000/L000/kv_scales_after", step.add_layer, 0, **tensors,
                                kv_cache_after=codes, kv_rope_after=rope)
            self.assert_refused("/steps/S000/L000/kv_rope_after", step.add_layer, 0, **tensors,
                                kv_rope_after=rope)
            self.assert_refused("/steps/S000/L000/kv_cache_after", step.add_layer, 0, **tensors,
                                kv_cache_after=codes[..., :DC - 1], kv_rope_after=rope,
                                kv_scales_after=scales)
            step.add_layer(0, **tensors)

    def check_topk(self, message, topk, step=PREFILL):
        """The refusal of `topk` for layer 0 of S000, whose message is exactly `message`."""
        with self.writer() as dump:
            dump.add_layer(0, 1.0, self.pool())
            added = dump.add_step(**step)
            tensors = step_tensors(added.num_rows, seed=0)
            with self.assertRaisesRegex(ValueError, "^" + re.escape(
                    "/steps/S000/L000/topk_indices: " + message) + "$"):
                added.add_layer(0, **tensors, topk_indices=topk)
            added.add_layer(0, **tensors)
        with h5py.File(self.path, "r") as f:  # a refused topk_indices leaves a plain v1 file
            self.assertNotIn("format_minor_version", f.attrs)

    def test_topk_rules(self):
        # S000 rows sit at token positions 3, 4, 5 and 0.
        good = [[3, -1], [4, 0], [5, 1], [0, -1]]
        self.check_topk("row 0 (token position 3): entry 1 = 4 is neither -1 nor a position in "
                        "0..3 (causal)", [[3, 4], [4, 0], [5, 1], [0, -1]])
        self.check_topk("row 3 (token position 0): entry 0 = -2 is neither -1 nor a position in "
                        "0..0 (causal)", [[3, -1], [4, 0], [5, 1], [-2, 0]])
        self.check_topk("row 2 (token position 5) lists position 5 twice (entries 0 and 2)",
                        [[3, -1, -1], [4, 0, -1], [5, 1, 5], [0, -1, -1]])
        self.check_topk("row 1 (token position 4) lists no position (every entry is -1); a row "
                        "attends to at least one token", [[3, -1], [-1, -1], [5, 1], [0, -1]])
        self.check_topk("shape (4, 0): K = 0, but every row lists at least one position",
                        np.zeros((4, 0), np.int32))
        self.check_topk("shape (3, 2) has 3 rows, not Nq = 4", good[:3])
        self.check_topk("shape (8,) is not two-dimensional [Nq, K]", np.ravel(good))
        self.check_topk("dtype float32 is not an integer type", np.array(good, np.float32))
        self.check_topk("values do not fit int32", np.array([[3, 2**31]] + good[1:]))
        # S001 (decode) rows at positions 6 and 1: position 2 is past row 1's.
        self.check_topk("row 1 (token position 1): entry 0 = 2 is neither -1 nor a position in "
                        "0..1 (causal)", [[6, 0], [2, 1]], step=DECODE)


if __name__ == "__main__":
    unittest.main()
