"""kvdump.indexer_fp8: the deployed DSA indexer quantization (docs/indexer-fp8.md) against values
worked out by hand, the tie-aware recall, the integrity check of the indexer cache's writes, the
command's refusals, and (with torch and transformers) the capture of a tiny GLM-5 module into
kvdump v1.2 as kvaudit reads it.

Expected values are derived in the comments from the rule's definition, not computed by the code
under test. Needs numpy and h5py; the capture case also torch, transformers and a kvaudit binary
($KVAUDIT_BINARY, else build/kvaudit), skipped without them unless KVAUDIT_REQUIRE_HF=1.
"""

import io
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import numpy as np

from kvdump import indexer_fp8

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Quantizer(unittest.TestCase):
    def test_hadamard_of_four(self):
        # Sylvester: rows (1 1 1 1), (1 -1 1 -1), (1 1 -1 -1), (1 -1 -1 1); times (1, 2, 3, 4):
        # 10, 1 - 2 + 3 - 4 = -2, 1 + 2 - 3 - 4 = -4, 1 - 2 - 3 + 4 = 0.
        np.testing.assert_array_equal(indexer_fp8.hadamard_matrix(4) @ [1, 2, 3, 4],
                                      [10, -2, -4, 0])

    def test_all_ones_key(self):
        # x = 128 ones. Hadamard row 0 sums to 128, every other row to 0; times 128^-0.5:
        # y = (8 sqrt 2 = 11.3137..., 0, ..., 0); bf16 keeps 8 significant bits: 11.3125
        # (1.0110101 x 2^3). amax / 448 = 0.02525..., the power of two above it 2^-5 = 0.03125.
        # 11.3125 / 0.03125 = 362, between the e4m3 values 352 and 384 (step 32 in [256, 448)):
        # nearer 352 = 1.375 x 2^8, code 0 1111 011 = 0x7B = 123. The other codes are +0.
        codes, scales = indexer_fp8.deployed_quantize(np.ones(128, dtype=np.float32))
        self.assertEqual(scales.tolist(), [0.03125])
        self.assertEqual(int(codes[0]), 123)
        self.assertEqual(np.count_nonzero(codes[1:]), 0)

    def test_scale_is_a_power_of_two_at_or_above_amax_over_448(self):
        # amax 1: 1/448 = 0.00223 lies between 2^-9 and 2^-8: the scale is 2^-8. amax 0: the floor
        # 1e-4 gives 1e-4 / 448 = 2.23e-7, between 2^-23 (1.19e-7) and 2^-22 (2.38e-7): 2^-22.
        # amax 448 * 3 = 1344: 3, rounded up to 4.
        y = np.zeros((3, 128), dtype=np.float32)
        y[0, 5], y[2, 0] = -1.0, 1344.0
        scales = indexer_fp8.block_scales(y, 128)
        self.assertEqual(scales[:, 0].tolist(), [2.0 ** -8, 2.0 ** -22, 4.0])

    def test_codes_of_a_block_with_a_power_of_two_scale(self):
        # y = (1344, 100, -3, 0.01, 0...): scale 4 (above). 1344 / 4 = 336 lies halfway between
        # the e4m3 values 320 (1.010 x 2^8) and 352 (1.011 x 2^8): to even, 320, code 0 1111 010
        # = 122. 100 / 4 = 25, halfway between 24 (1.100 x 2^4) and 26 (1.101 x 2^4): 24, code
        # 0 1011 100 = 92. -3 / 4 = -0.75 = -1.100 x 2^-1: 1 0110 100 = 180. 0.01 / 4 = 0.0025
        # = 1.28 subnormal quanta of 2^-9: 1 quantum, code 1.
        y = np.zeros((1, 128), dtype=np.float32)
        y[0, :4] = [1344.0, 100.0, -3.0, 0.01]
        codes, scales = indexer_fp8.quantize_blocks(y, 128)
        self.assertEqual(scales.tolist(), [[4.0]])
        self.assertEqual(codes[0, :4].tolist(), [122, 92, 180, 1])

    def test_planted_defects_are_caught(self):
        # The rotation skipped: y = ones, scale 2^-8, every code 256 = 2^8, 0 1111 000 = 120,
        # not the (123, 0, ...) above.
        codes, _ = indexer_fp8.deployed_quantize(np.ones(128, dtype=np.float32), hadamard=False)
        self.assertEqual(int(codes[0]), 120)
        self.assertNotEqual(int(codes[0]), 123)
        # The scale not rounded to a power of two: float32 gives 1/448, not 2^-8.
        y = np.zeros((1, 128), dtype=np.float32)
        y[0, 0] = 1.0
        unrounded = indexer_fp8.block_scales(y, 128, "float32")[0, 0]
        self.assertNotEqual(float(unrounded), 2.0 ** -8)


class Recall(unittest.TestCase):
    def test_ties_at_the_kth_score_count_as_hits(self):
        # exact = (3, 2, 0, 0, 0), k = 3: tokens 0 and 1 must be picked, any one zero fills the
        # third place. (0, 1, 4) is a valid top-3: recall 1; (0, 2, 3) misses token 1: 2/3.
        exact = np.array([3.0, 2.0, 0.0, 0.0, 0.0])
        self.assertEqual(indexer_fp8.recall_with_ties([0, 1, 4], exact, 3), 1.0)
        self.assertAlmostEqual(indexer_fp8.recall_with_ties([0, 2, 3], exact, 3), 2 / 3)
        self.assertEqual(indexer_fp8.recall_with_ties([0, 1, 2], exact, 3), 1.0)

    def test_exact_scores_relu_then_weights(self):
        # q = (1, 0) and (0, 1) heads, weights (2, -1), sm 0.5, keys (4, -6), (-2, 2):
        # token 0: 2 relu(0.5 * 4) - relu(0.5 * -6) = 4; token 1: 2 relu(-1) - relu(1) = -1.
        q = np.array([[1.0, 0.0], [0.0, 1.0]])
        k = np.array([[4.0, -6.0], [-2.0, 2.0]])
        scores = indexer_fp8.exact_scores(q, [2.0, -1.0], k, 0.5)
        self.assertEqual(scores.tolist(), [4.0, -1.0])

    def test_a_tie_is_not_a_miss_in_a_planted_strict_recall(self):
        # The defect: recall as membership in one exact top-k (ties broken by position) calls
        # the valid pick (0, 1, 4) 2/3.
        exact = np.array([3.0, 2.0, 0.0, 0.0, 0.0])
        strict = len(set([0, 1, 4]) & set(indexer_fp8.select_topk(exact, 3).tolist())) / 3
        self.assertAlmostEqual(strict, 2 / 3)
        self.assertEqual(indexer_fp8.recall_with_ties([0, 1, 4], exact, 3), 1.0)


class DumpChecks(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "example.h5")
        indexer_fp8.example_dump(self.path)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_clean_example(self):
        result = indexer_fp8.analyse(self.path)
        for layer in result["layers"].values():
            self.assertEqual(layer["integrity"], "ok")
            self.assertEqual(layer["stored_topk_disagreements"], 0)
            self.assertEqual(layer["rows_checked"], 4)
            self.assertEqual(layer["sparse_rows"], 4)  # 10 to 13 visible tokens, top-4

    def _damage(self, dataset, slot, value):
        import h5py

        with h5py.File(self.path, "a") as f:
            data = f[dataset][()]
            flat = data.reshape(-1, data.shape[-1])
            flat[slot, 0] = value
            f[dataset][()] = data

    def test_a_wrong_code_in_a_written_slot(self):
        # S000 writes slots 9, 10, 11 (positions 9..11, page size 4, pages 0..2).
        self._damage("steps/S000/L000/indexer/k_cache_after", 10, 0x7F)
        result = indexer_fp8.analyse(self.path)
        layer = result["layers"]["L000"]
        self.assertEqual(layer["integrity"], "failed")
        self.assertEqual([(b["step"], b["slot"]) for b in layer["bad_writes"]], [("S000", 10)])
        self.assertEqual(result["layers"]["L001"]["integrity"], "ok")

    def test_a_wrong_scale_in_a_written_slot(self):
        self._damage("steps/S001/L001/indexer/k_scales_after", 12, 0.75)
        layer = indexer_fp8.analyse(self.path)["layers"]["L001"]
        self.assertEqual([(b["step"], b["slot"], b["scales_differ"])
                          for b in layer["bad_writes"]], [("S001", 12, True)])

    def test_an_unwritten_slot_that_moved(self):
        # Slot 3 holds position 3, written before the first step; S001 writes only slot 12.
        self._damage("steps/S001/L000/indexer/k_cache_after", 3, 0x55)
        layer = indexer_fp8.analyse(self.path)["layers"]["L000"]
        self.assertEqual(layer["touched_slots"], [{"step": "S001", "slot": 3}])
        self.assertEqual(layer["bad_writes"], [])

    def test_planted_rule_without_hadamard_breaks_integrity(self):
        result = indexer_fp8.analyse(self.path, hadamard=False)
        self.assertEqual(result["layers"]["L000"]["integrity"], "failed")

    def test_command_exit_status(self):
        self.assertEqual(self._main([self.path]), 0)
        self._damage("steps/S000/L000/indexer/k_cache_after", 9, 0)
        self.assertEqual(self._main([self.path]), 1)

    def test_command_refuses_bad_input_with_one_line(self):
        import h5py

        with h5py.File(self.path, "a") as f:
            f.attrs["format_minor_version"] = np.int32(1)
        err = io.StringIO()
        self.assertEqual(self._main([self.path], err), 2)
        self.assertEqual(len(err.getvalue().strip().splitlines()), 1)
        self.assertIn(f"{self.path}:/: format_minor_version < 2", err.getvalue())
        not_hdf5 = os.path.join(self.dir, "text.h5")
        with open(not_hdf5, "w") as out:
            out.write("not hdf5\n")
        err = io.StringIO()
        self.assertEqual(self._main([not_hdf5], err), 2)
        self.assertIn(f"{not_hdf5}: not a readable HDF5 file", err.getvalue())

    @staticmethod
    def _main(argv, err=None):
        with redirect_stdout(io.StringIO()), redirect_stderr(err or io.StringIO()):
            return indexer_fp8.main(argv)


class DeclaredRule(unittest.TestCase):
    """The model quantizes with the rule each layer declares (index_rotation, index_block_size),
    and refuses one it does not know or a scales shape that disagrees with the block size."""

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "rule.h5")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def _set_attr(self, name, value):
        import h5py

        with h5py.File(self.path, "a") as f:
            for layer in ("L000", "L001"):
                f[f"layers/{layer}/indexer"].attrs[name] = value

    def _main(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            status = indexer_fp8.main(argv)
        return status, out.getvalue(), err.getvalue()

    def test_rotation_none_is_judged_without_the_rotation(self):
        # Keys and queries quantized without the rotation, declared "none": the model must
        # quantize the same way, every written slot then holds its bytes.
        indexer_fp8.example_dump(self.path, rotation="none")
        for name, layer in indexer_fp8.analyse(self.path)["layers"].items():
            self.assertEqual((name, layer["integrity"], layer["bad_writes"]), (name, "ok", []))
            self.assertEqual(layer["stored_topk_disagreements"], 0)
            self.assertEqual(layer["rotation"], "none")
        # The same bytes declared "hadamard": the model rotates, the written slots disagree.
        self._set_attr("index_rotation", "hadamard")
        for layer in indexer_fp8.analyse(self.path)["layers"].values():
            self.assertEqual(layer["integrity"], "failed")
            self.assertTrue(layer["bad_writes"])

    def test_block_32_at_width_64_is_judged_with_two_scales(self):
        # x = 64 ones. Hadamard row 0 sums to 64, every other row to 0; times 64^-0.5:
        # y = (8, 0, ..., 0), exact in bf16. Block 0 (y_0..y_31): amax 8, 8 / 448 = 0.01786
        # lies between 2^-6 and 2^-5: scale 2^-5; 8 / 2^-5 = 256 = 1.000 x 2^8, code 0 1111 000
        # = 120. Block 1: amax 0, floored at 1e-4: 2^-22 (as above); codes 0. One block of 64
        # would give the single scale 2^-5.
        codes, scales = indexer_fp8.deployed_quantize(np.ones(64, dtype=np.float32), block=32)
        self.assertEqual(scales.tolist(), [2.0 ** -5, 2.0 ** -22])
        self.assertEqual((int(codes[0]), np.count_nonzero(codes[1:])), (120, 0))
        # A dump with D = 64, index_block_size 32, whose position 9 (slot 9, written by S000)
        # holds that row in both layers.
        keys = np.random.default_rng(5).standard_normal((2, 13, 64)).astype(np.float32)
        keys[:, 9] = 1.0
        indexer_fp8.example_dump(self.path, head_dim=64, block=32, keys=keys)
        import h5py

        with h5py.File(self.path, "r") as f:
            after = f["steps/S000/L000/indexer/k_scales_after"][()].reshape(-1, 2)
            self.assertEqual(after[9].tolist(), [2.0 ** -5, 2.0 ** -22])
        for layer in indexer_fp8.analyse(self.path)["layers"].values():
            self.assertEqual((layer["integrity"], layer["bad_writes"]), ("ok", []))
            self.assertEqual(layer["block_size"], 32)

    def test_scales_that_disagree_with_the_block_size_are_refused(self):
        # Two scales per slot (20 slots in 5 pages of 4) declared as one block of 64: numpy
        # would broadcast the model's one scale over both columns; the command refuses instead,
        # one line naming the object.
        indexer_fp8.example_dump(self.path, head_dim=64, block=32)
        self._set_attr("index_block_size", np.int32(64))
        status, _, err = self._main([self.path])
        self.assertEqual(status, 2)
        self.assertEqual(len(err.strip().splitlines()), 1)
        self.assertIn(f"{self.path}:/layers/L000/indexer/k_scales: shape [5, 4, 2] disagrees "
                      "with index_block_size 64", err)

    def test_unknown_rotation_and_block_size_are_refused(self):
        indexer_fp8.example_dump(self.path)
        self._set_attr("index_rotation", "walsh")
        status, _, err = self._main([self.path])
        self.assertEqual((status, len(err.strip().splitlines())), (2, 1))
        self.assertIn(f"{self.path}:/layers/L000/indexer: index_rotation 'walsh' is unknown", err)
        self._set_attr("index_rotation", "hadamard")
        self._set_attr("index_block_size", np.int32(12))
        status, _, err = self._main([self.path])
        self.assertEqual((status, len(err.strip().splitlines())), (2, 1))
        self.assertIn(f"{self.path}:/layers/L000/indexer: index_block_size 12 does not divide",
                      err)


class StoredTopk(unittest.TestCase):
    """The server's stored topk_indices must be a valid top-k of the model's deployed scores
    (ties with the k-th may be broken either way); else integrity fails, rows named."""

    def test_tie_breaks_agree_other_choices_do_not(self):
        # deployed = (3, 2, 0, 0, 0), k = 3: 0 and 1, then any zero. (0, 1, 4) is a valid top-3;
        # (0, 2, 3) drops token 1 for a lower one; a repeated or missing pick is not a top-3.
        deployed = np.array([3.0, 2.0, 0.0, 0.0, 0.0])
        agrees = indexer_fp8._stored_topk_agrees
        self.assertTrue(agrees([0, 1, 4], deployed, 3))
        self.assertTrue(agrees([4, 1, 0, -1], deployed, 3))
        self.assertFalse(agrees([0, 2, 3], deployed, 3))
        self.assertFalse(agrees([0, 1, 1], deployed, 3))
        self.assertFalse(agrees([0, 1, -1], deployed, 3))
        self.assertFalse(agrees([0, 1, 5], deployed, 3))

    def test_a_changed_stored_row_fails_integrity(self):
        import h5py

        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        path = os.path.join(tmp, "example.h5")
        indexer_fp8.example_dump(path)
        # S001 (decode) row 0 of L001: position 12, 13 visible, top-4. Replace the stored pick
        # with the lowest deployed score by the visible token with the lowest deployed score
        # overall (checked strictly lower than the 4th: not a tie-break).
        with h5py.File(path, "a") as f:
            group = f["steps/S001/L001/indexer"]
            codes = group["k_cache_after"][()].reshape(-1, 32)[:13]
            scales = group["k_scales_after"][()].reshape(-1, 1)[:13]
            q_codes, q_scales = indexer_fp8.deployed_quantize(group["q"][0])
            deployed = indexer_fp8.deployed_scores(q_codes, q_scales, group["weights"][0],
                                                   codes, scales, 32 ** -0.5)
            topk = group["topk_indices"][()]
            row = topk[0].copy()
            weakest = row[np.argmin(deployed[row])]
            lowest = int(np.argmin(deployed))
            self.assertNotIn(lowest, row.tolist())
            self.assertLess(deployed[lowest], deployed[weakest])
            topk[0][row == weakest] = lowest
            group["topk_indices"][()] = topk
        result = indexer_fp8.analyse(path)
        layer = result["layers"]["L001"]
        self.assertEqual(layer["stored_topk_disagreements"], 1)
        self.assertEqual(layer["integrity"], "failed")
        self.assertEqual([(d["step"], d["row"], d["position"])
                          for d in layer["stored_topk_disagreeing_rows"]], [("S001", 0, 12)])
        self.assertEqual(result["layers"]["L000"]["integrity"], "ok")
        # The command: exit 1, the count in the table and the JSON, the row named.
        out_json = os.path.join(tmp, "report.json")
        out_md = os.path.join(tmp, "report.md")
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            status = indexer_fp8.main([path, "--json", out_json, "--markdown", out_md])
        self.assertEqual(status, 1)
        with open(out_md) as text:
            table = text.read().splitlines()
        self.assertIn("| stored top-k disagreements | integrity |", table[0])
        self.assertTrue(table[3].startswith("| L001 |") and table[3].endswith("| 1 | failed |"),
                        table[3])
        self.assertTrue(table[2].endswith("| 0 | ok |"), table[2])
        self.assertTrue(any(line.startswith("- L001 S001 row 0 (position 12): the stored top-k")
                            for line in table))
        import json

        with open(out_json) as text:
            self.assertEqual(json.load(text)["layers"]["L001"]["stored_topk_disagreements"], 1)


def _hf_missing():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        return f"needs torch and transformers: {error}"
    if not os.path.exists(_kvaudit()):
        return f"needs a kvaudit binary ({_kvaudit()}; set KVAUDIT_BINARY)"
    return None


def _kvaudit():
    return os.environ.get("KVAUDIT_BINARY") or os.path.join(ROOT, "build", "kvaudit")


class Capture(unittest.TestCase):
    """A tiny GLM-5 and a tiny DeepSeek-V3.2 module (index_topk 8 below 25..35 visible tokens: really sparse) captured
    with its indexer cache: kvaudit accepts and lists it, the stored cache and top-k are the
    deployed rule's, and the indexer query the hooks recorded reproduces the module's own
    full-precision selection."""

    def setUp(self):
        missing = _hf_missing()
        if missing and os.environ.get("KVAUDIT_REQUIRE_HF") == "1":
            self.fail(missing)
        if missing:
            self.skipTest(missing)
        self.dir = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_glm5_tiny(self):
        self._check_capture("glm5")

    def test_deepseek_v32_tiny(self):
        self._check_capture("deepseek-v32")

    def _check_capture(self, model):
        import h5py

        from kvdump import hf_capture

        path = os.path.join(self.dir, "capture.h5")
        hf_capture.capture(path, model=model, size="tiny", index_topk=8)
        info = subprocess.run([_kvaudit(), "info", path], capture_output=True, text=True)
        self.assertEqual(info.returncode, 0, info.stderr)
        self.assertIn("kvdump v1.2", info.stdout)
        self.assertIn("indexer: 2 heads x 32, top-8, e4m3 + power_of_two scale per 32, hadamard",
                      info.stdout)
        result = indexer_fp8.analyse(path)["layers"]["L000"]
        self.assertEqual(result["integrity"], "ok")
        self.assertEqual(result["stored_topk_disagreements"], 0)
        self.assertEqual(result["sparse_rows"], result["rows_checked"])
        # The module's own top-k (float32 scores of the unquantized values) against the exact
        # float64 selection of the recorded query, keys and weights: the hooks caught what the
        # module used. Ties aside, every module pick is an exact pick.
        with h5py.File(path, "r") as f:
            source = f["layers/L000/indexer/k_source"][()].reshape(-1, 32)
            for step in sorted(f["steps"]):
                group = f[f"steps/{step}/L000"]
                q, w = group["indexer/q"][()], group["indexer/weights"][()]
                module = group["topk_indices"][()]
                positions = f[f"steps/{step}/new_kv_slots"][()]  # page size 1: slot = position
                source[positions] = group["indexer/new_k"][()]
                for i, position in enumerate(positions):
                    exact = indexer_fp8.exact_scores(q[i], w[i], source[:position + 1],
                                                     32 ** -0.5)
                    picks = module[i][module[i] >= 0]
                    self.assertEqual(indexer_fp8.recall_with_ties(picks, exact, 8), 1.0)


if __name__ == "__main__":
    unittest.main()
