"""kvdump.requantize: the same dump's FP8 pool at another per-tensor scale.

Expected codes are worked by hand from the e4m3fn layout (S.EEEE.MMM, bias 7, 2^-9 the least
subnormal, 448 = 0x7E the largest finite; docs/kvdump-v1.md "The write rule"), not by the code
under test; the whole-pool cross-check compares with a pool kvaudit synth's C++ writer wrote. The
kvaudit runs ($KVAUDIT_BINARY, else build/kvaudit) are skipped without a binary.
"""

import contextlib
import io
import os
import shutil
import subprocess
import tempfile
import unittest
from unittest import mock

import h5py
import numpy as np

from kvdump import KvDumpWriter, quantize_e4m3, requantize

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATASETS = os.path.join(ROOT, "datasets")
OLD_SCALE = 0.5

# Slot 0's source row and its codes at scale 1.0, by hand:
#   3.0    = 1.5 * 2^1:   E 8, M 4                          0 1000 100 = 0x44
#   -0.3   = 1.2 * 2^-2:  M 1.6 rounds to 2 (0.3125)        1 0101 010 = 0xAA
#   500    > 464: satfinite stores 448                       0x7E
#   0.001  = 0.512 * 2^-9: rounds to the least subnormal     0x01
#   1e-4   = 0.0512 * 2^-9: rounds to 0                      0x00
#   2.0    = 1.0 * 2^1:   E 8, M 0                           0 1000 000 = 0x40
SOURCE_ROW = [3.0, -0.3, 500.0, 0.001, 1e-4, 2.0]
SOURCE_CODES_AT_1 = [0x44, 0xAA, 0x7E, 0x01, 0x00, 0x40]
# The row step S000 writes to slot 1, and its codes at scale 1.0:
#   1.0 = 2^0: E 7 -> 0x38;  0.75 = 1.5 * 2^-1: E 6, M 4 -> 0x34;  -6 = 1.5 * 2^2: E 9, M 4 -> 0xCC;
#   100 = 1.5625 * 2^6: M 4.5 ties to even 4 (96) -> 0 1101 100 = 0x6C;  0.5 = 2^-1 -> 0x30;
#   -1.0 -> 0xB8
NEW_ROW = [1.0, 0.75, -6.0, 100.0, 0.5, -1.0]
NEW_CODES_AT_1 = [0x38, 0x34, 0xCC, 0x6C, 0x30, 0xB8]


def _kvaudit():
    return os.environ.get("KVAUDIT_BINARY") or os.path.join(ROOT, "build", "kvaudit")


def write_dump(path, captured_outputs=False, side_file=False):
    """Dc 4, Dr 2, page size 1, 4 slots, scale 0.5: slot 0 cached (SOURCE_ROW), slot 2 a NaN source
    stored as 0xFF, one prefill step writing NEW_ROW to slot 1 with the pool after it captured.
    The input follows the rule at its own scale (quantize_e4m3 builds it: the input, not the
    expectation)."""
    source = np.zeros((4, 1, 6), dtype=np.float32)
    source[0, 0] = SOURCE_ROW
    source[2, 0] = np.nan
    pool = quantize_e4m3(source, OLD_SCALE)
    pool[2, 0] = 0xFF
    after = pool.copy()
    after[1, 0] = quantize_e4m3(np.array(NEW_ROW, dtype=np.float32), OLD_SCALE)
    rng = np.random.default_rng(5)
    with KvDumpWriter(path, model="test", producer="test_requantize", num_heads=1,
                      kv_lora_rank=4, qk_rope_head_dim=2, sm_scale=0.5, page_size=1,
                      float32_inputs=True) as dump:
        dump.add_layer(0, OLD_SCALE, pool, kv_source=source)
        step = dump.add_step("prefill", [0, 1], [0, 2], [0, 1], [1], [1])
        extra = {}
        if captured_outputs:
            extra = {"out": rng.standard_normal((1, 1, 4)).astype(np.float32),
                     "lse": np.zeros((1, 1), dtype=np.float32)}
        step.add_layer(0, rng.standard_normal((1, 1, 4)).astype(np.float32),
                       rng.standard_normal((1, 1, 2)).astype(np.float32),
                       np.array([NEW_ROW], dtype=np.float32), kv_cache_after=after, **extra)
    if side_file:
        with h5py.File(path + ".module.h5", "w") as side:
            side.create_dataset("layers/L000/w_uv", data=np.arange(8.0).reshape(1, 2, 4))


def run_main(argv):
    """(exit status, stderr) of python -m kvdump.requantize ARGV."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = requantize.main(argv)
    return status, err.getvalue()


class Requantize(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="requantize_")
        self.dump = os.path.join(self.work, "in.h5")
        self.out = os.path.join(self.work, "out.h5")

    def tearDown(self):
        shutil.rmtree(self.work, ignore_errors=True)

    def test_codes_at_scale_one_are_the_rules_by_hand(self):
        write_dump(self.dump, side_file=True)
        self.assertEqual(run_main([self.dump, self.out, "--kv-scale", "1.0"]), (0, ""))
        with h5py.File(self.out, "r") as f, h5py.File(self.dump, "r") as before:
            layer = f["layers/L000"]
            self.assertEqual(layer.attrs["kv_scale"], np.float32(1.0))
            self.assertEqual(layer.attrs["kv_scale_before_requantize"], np.float32(OLD_SCALE))
            self.assertEqual(layer["kv_cache"][0, 0].tolist(), SOURCE_CODES_AT_1)
            self.assertEqual(layer["kv_cache"][2, 0].tolist(), [0xFF] * 6)  # NaN keeps its byte
            after = f["steps/S000/L000/kv_cache_after"]
            self.assertEqual(after[1, 0].tolist(), NEW_CODES_AT_1)
            self.assertEqual(after[0, 0].tolist(), SOURCE_CODES_AT_1)
            for name in ("layers/L000/kv_source", "steps/S000/L000/new_kv",
                         "steps/S000/L000/q_nope", "steps/S000/new_kv_slots"):
                np.testing.assert_array_equal(f[name][...], before[name][...], err_msg=name)
            self.assertIn("--kv-scale 1.0 from in.h5", f.attrs["requantized_by"])
        with open(self.dump + ".module.h5", "rb") as a, open(self.out + ".module.h5", "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_planted_scale_not_applied_is_caught_by_kvaudit_integrity(self):
        if not os.path.exists(_kvaudit()):
            self.skipTest(f"needs a kvaudit binary ({_kvaudit()})")
        write_dump(self.dump)
        good = os.path.join(self.work, "good.h5")
        self.assertEqual(run_main([self.dump, good, "--kv-scale", "4"])[0], 0)
        info = subprocess.run([_kvaudit(), "info", good], capture_output=True, text=True)
        self.assertEqual(info.returncode, 0, info.stderr)
        check = subprocess.run([_kvaudit(), "check", good, "--backend", "cpu-fp8"],
                               capture_output=True, text=True)
        self.assertIn("integrity checks, 0 failed", check.stdout, check.stdout + check.stderr)
        # The planted rule: the new scale not applied (codes of x, read as codes * 4).
        real = requantize.quantize_e4m3

        def scale_not_applied(values, scale):
            return real(values, 1.0) if np.float32(scale) == np.float32(4) else real(values, scale)

        with mock.patch.object(requantize, "quantize_e4m3", scale_not_applied):
            self.assertEqual(run_main([self.dump, self.out, "--kv-scale", "4"])[0], 0)
        check = subprocess.run([_kvaudit(), "check", self.out, "--backend", "cpu-fp8"],
                               capture_output=True, text=True)
        self.assertEqual(check.returncode, 1, check.stdout + check.stderr)
        self.assertRegex(check.stdout, r"integrity checks, [1-9]\d* failed")
        self.assertIn("captured_pool", check.stdout)

    def test_amax_reproduces_the_pool_kvaudit_synth_wrote_with_the_recommended_scales(self):
        # datasets/recipes.sh writes the same source rows with scale 1 and with the scales kvaudit
        # calibrate recommends (amax/448 per layer), through kvaudit's C++ writer.
        served = os.path.join(DATASETS, "glm5_outliers_scale1.h5")
        calibrated = os.path.join(DATASETS, "glm5_outliers_calibrated.h5")
        self.assertEqual(run_main([served, self.out, "--kv-scale", "amax"]), (0, ""))
        with h5py.File(self.out, "r") as f, h5py.File(calibrated, "r") as expected:
            for layer in ("L000", "L001"):
                self.assertEqual(f[f"layers/{layer}"].attrs["kv_scale"],
                                 expected[f"layers/{layer}"].attrs["kv_scale"])
                np.testing.assert_array_equal(f[f"layers/{layer}/kv_cache"][...],
                                              expected[f"layers/{layer}/kv_cache"][...])

    def test_layers_selects_and_calibrate_json_gives_the_scale(self):
        served = os.path.join(DATASETS, "glm5_outliers_scale1.h5")
        scales = os.path.join(self.work, "scales.json")
        with open(scales, "w", encoding="utf-8") as f:
            f.write('{"layers": [{"layer_id": 1, "k_scale": 2.5, "v_scale": 2.5}]}')
        self.assertEqual(run_main([served, self.out, "--kv-scale", f"calibrate:{scales}",
                                   "--layers", "1"]), (0, ""))
        with h5py.File(self.out, "r") as f, h5py.File(served, "r") as before:
            self.assertEqual(f["layers/L001"].attrs["kv_scale"], np.float32(2.5))
            self.assertEqual(f["layers/L000"].attrs["kv_scale"], np.float32(1.0))
            np.testing.assert_array_equal(f["layers/L000/kv_cache"][...],
                                          before["layers/L000/kv_cache"][...])
        status, err = run_main([served, self.out, "--kv-scale", f"calibrate:{scales}"])
        self.assertEqual(status, 2)
        self.assertIn("/layers/L000: layer 0 has no recommended k_scale", err)

    def test_refusals(self):
        write_dump(self.dump, captured_outputs=True)
        status, err = run_main([self.dump, self.dump, "--kv-scale", "1"])
        self.assertEqual((status, err.count("\n")), (2, 1))
        self.assertIn("OUT is IN", err)
        status, err = run_main([self.dump, self.out, "--kv-scale", "0"])
        self.assertEqual(status, 2)
        self.assertIn("--kv-scale 0: 0.0 is not finite and > 0", err)
        status, err = run_main([self.dump, self.out, "--kv-scale", "1"])
        self.assertEqual(status, 2)
        self.assertIn("/steps/S000/L000/out: captured from the pool", err)
        self.assertFalse(os.path.exists(self.out))
        self.assertEqual(run_main([self.dump, self.out, "--kv-scale", "1",
                                   "--drop-captured-outputs"]), (0, ""))
        with h5py.File(self.out, "r") as f:
            self.assertNotIn("out", f["steps/S000/L000"])
            self.assertNotIn("lse", f["steps/S000/L000"])
        self.assertEqual(sorted(os.listdir(self.work)), ["in.h5", "out.h5"])  # no temporaries

    def test_a_missing_object_is_one_line_and_exit_2(self):
        # A malformed dump (a step's new_kv deleted) is bad input, not a traceback.
        write_dump(self.dump)
        with h5py.File(self.dump, "r+") as f:
            del f["steps/S000/L000/new_kv"]
        status, err = run_main([self.dump, self.out, "--kv-scale", "1"])
        self.assertEqual((status, err.count("\n")), (2, 1), err)
        self.assertIn("a required object is missing", err)
        self.assertIn("new_kv", err)
        self.assertFalse(os.path.exists(self.out))

    def test_refuses_a_pool_that_is_not_its_rows_by_the_rule(self):
        write_dump(self.dump)
        with h5py.File(self.dump, "r+") as f:
            f["steps/S000/L000/kv_cache_after"][3, 0, 1] = 0x22  # a write fault in an unused slot
        status, err = run_main([self.dump, self.out, "--kv-scale", "1"])
        self.assertEqual(status, 2)
        self.assertIn("/steps/S000/L000/kv_cache_after[3, 0, 1]: holds code 0x22 where the write "
                      "rule at the dump's kv_scale 0.5 gives 0x00 (1 codes differ)", err)
        with h5py.File(self.dump, "r+") as f:
            del f["layers/L000/kv_source"]
        status, err = run_main([self.dump, self.out, "--kv-scale", "1"])
        self.assertEqual(status, 2)
        self.assertIn("in.h5:/layers/L000: no kv_source", err)

    def test_refuses_per_token_group(self):
        grouped = os.path.join(DATASETS, "glm5_dsa_flashmla.h5")
        status, err = run_main([grouped, self.out, "--kv-scale", "1"])
        self.assertEqual(status, 2)
        self.assertIn("kv_scale_kind is per_token_group", err)


if __name__ == "__main__":
    unittest.main()
