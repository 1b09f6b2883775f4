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
        # A stand-in for torch: the writer must view bfloat16 as 16-bit and float8_e4m3fn as
        # 8-bit integers through the tensor's own view(), without converting values.
        class Dtype:
            def __init__(self, name):
                self.name = name

            def __str__(self):
                return "torch." + self.name

        fake_torch = types.ModuleType("torch")
        fake_torch.int16, fake_torch.uint8 = Dtype("int16"), Dtype("uint8")

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
                assert dtype in (fake_torch.int16, fake_torch.uint8), dtype
                return Tensor(self.array.view(np.int16 if dtype is fake_torch.int16 else np.uint8),
                              dtype.name)

            def numpy(self):
                assert self.dtype.name in ("int16", "uint8", "float32"), self.dtype
                return self.array

        pool = self.pool()
        tensors = step_tensors(2, seed=5)
        q_nope_bits = kvdump.bf16_bits_from_float32(tensors["q_nope"])
        lse = np.ones((2, H), dtype=np.float32)
        with mock.patch.dict(sys.modules, {"torch": fake_torch}):
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


if __name__ == "__main__":
    unittest.main()
