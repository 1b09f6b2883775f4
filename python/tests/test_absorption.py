"""kvdump.absorption: which matrix an absorbed query was formed with, from the residual of q_nope
outside each candidate's row space. The planted queries are formed here from each hypothesis's
definition (q_h times W_UK[h], W_UV[h], the next heads' W_UK, W_UK[h]^T read as [Dn, Dc]) and
rounded to bf16 as a dump stores them; each must be explained by its own hypothesis alone. The
second class does the same through the Hugging Face module (kvdump.hf_capture), where torch and
transformers are installed.
"""

import os
import shutil
import sys
import tempfile
import unittest
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvdump import absorption  # noqa: E402
from kvdump.codec import bf16_bits_from_float32, float32_from_bf16_bits  # noqa: E402


def _bf16(x):
    return float32_from_bf16_bits(bf16_bits_from_float32(x.astype(np.float32))).astype(np.float64)


class PlantedAbsorption(unittest.TestCase):
    # DeepSeek-V3's proportions scaled down: Dn = Dv (so W_UV in place of W_UK exists), Dc = 4 Dn.
    HEADS, DN, DC, ROWS = 4, 16, 64, 5

    def setUp(self):
        rng = np.random.default_rng(11)
        self.w_uk = rng.standard_normal((self.HEADS, self.DN, self.DC))
        self.w_uv = rng.standard_normal((self.HEADS, self.DN, self.DC))
        self.q_pass = rng.standard_normal((self.ROWS, self.HEADS, self.DN))

    def _explaining(self, matrices):
        q = _bf16(np.einsum("shn,hnc->shc", self.q_pass, matrices))
        worst = absorption.layer_residuals([q], self.w_uk, self.w_uv)
        bound = 2.0 * absorption.UNIT_ROUNDOFF["bfloat16"]
        return sorted(absorption._name(k) for k, r in worst.items() if r <= bound), worst

    def test_each_absorption_is_named_alone(self):
        viewed = np.stack([self.w_uk[h].T.copy().reshape(self.DN, self.DC)
                           for h in range(self.HEADS)])
        cases = {
            "w-uk": self.w_uk,
            "w-uv": self.w_uv,
            "w-uk-other-head (h + 1)": np.roll(self.w_uk, -1, axis=0),
            "w-uk-other-head (h + 3)": np.roll(self.w_uk, -3, axis=0),
            "w-uk-viewed": viewed,
        }
        for expected, matrices in cases.items():
            with self.subTest(planted=expected):
                explaining, worst = self._explaining(matrices)
                self.assertEqual(explaining, [expected], worst)

    def test_wrong_subspaces_are_far_from_rounding(self):
        # A Dn-dimensional subspace of R^Dc that does not hold q leaves about sqrt(1 - Dn/Dc) =
        # 0.87 of it; rounding to bf16 leaves at most 2^-8.
        _, worst = self._explaining(self.w_uk)
        for key, r in worst.items():
            if key[0] is not absorption.Absorption.W_UK:
                self.assertGreater(r, 0.3, key)
        self.assertLessEqual(worst[(absorption.Absorption.W_UK, None)], 2.0 ** -8)

    def test_w_uv_is_not_tried_where_dn_differs_from_dv(self):
        keys = absorption.candidate_matrices(self.w_uk, self.w_uv[:, :8, :])
        self.assertNotIn((absorption.Absorption.W_UV, None), keys)


def _missing_hf():
    try:
        import h5py  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        return f"needs torch, transformers and h5py: {error}"
    return None


@unittest.skipIf(_missing_hf() is not None and os.environ.get("KVAUDIT_REQUIRE_HF") != "1",
                 _missing_hf() or "")
class ModuleAbsorption(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="absorption_")

    def tearDown(self):
        shutil.rmtree(self.work, ignore_errors=True)

    def _capture(self, name, absorb=None):
        from kvdump import hf_capture

        dump = os.path.join(self.work, name)
        patch = mock.patch.object(hf_capture, "absorb_query", absorb) if absorb else None
        if patch:
            patch.start()
        try:
            hf_capture.capture(dump, model="glm5", size="tiny", layers=[0], prefix_tokens=12,
                               extend_tokens=3, decode_steps=1, seed=5)
        finally:
            if patch:
                patch.stop()
        return dump

    def test_the_modules_capture_and_a_shifted_head_split(self):
        own = absorption.diagnose(self._capture("own.h5"))
        self.assertEqual([names for _, names, _, _ in own], [["w-uk"]])
        self.assertEqual(absorption.main([os.path.join(self.work, "own.h5")]), 0)

        def next_head(q_pass, w_uk):
            return np.einsum("shn,hnc->shc", q_pass, np.roll(w_uk, -1, axis=0))

        shifted = absorption.diagnose(self._capture("shifted.h5", next_head))
        self.assertEqual([names for _, names, _, _ in shifted], [["w-uk-other-head (h + 1)"]])
        self.assertEqual(absorption.main([os.path.join(self.work, "shifted.h5")]), 1)


if __name__ == "__main__":
    unittest.main()
