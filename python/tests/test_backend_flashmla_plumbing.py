"""The flashmla-sparse adapter's plumbing without torch or a GPU (kvdump/backends/flashmla_sparse.py):
which kvdump v1.1 forms it takes, and the slot ids it hands FlashMLA for sparse and dense rows,
worked out by hand from the page tables below.

Run: python3 -m unittest discover -s python/tests
"""

import os
import sys
import unittest
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvdump.backends import flashmla_sparse  # noqa: E402


def model(**changes):
    fields = dict(grouped=True, kv_lora_rank=512, qk_rope_head_dim=64, kv_scale_group_size=128,
                  kv_scale_format="power_of_two", kv_rope_dtype="bfloat16", num_heads=64)
    fields.update(changes)
    return SimpleNamespace(**fields)


def step(topk=None):
    # Two requests, page size 2: request 0 pages [3, 0] with 3 tokens and 2 rows (positions 1, 2),
    # request 1 page [1] with 2 tokens and no row.
    return SimpleNamespace(
        qo_indptr=np.array([0, 2, 2], np.int32), kv_indptr=np.array([0, 2, 3], np.int32),
        kv_indices=np.array([3, 0, 1], np.int32), kv_last_page_len=np.array([1, 2], np.int32),
        num_rows=2, topk_indices=topk)


class FlashMlaPlumbingTests(unittest.TestCase):
    def test_takes_only_flashmla_slots(self):
        self.assertIsNone(flashmla_sparse.flashmla_refusal(model()))
        self.assertIsNone(flashmla_sparse.flashmla_refusal(model(kv_scale_format="float32")))
        self.assertIn("per_tensor", flashmla_sparse.flashmla_refusal(model(grouped=False)))
        self.assertIn("e8m0", flashmla_sparse.flashmla_refusal(model(kv_scale_format="e8m0")))
        self.assertIn("float8_e4m3fn",
                      flashmla_sparse.flashmla_refusal(model(kv_rope_dtype="float8_e4m3fn")))
        self.assertIn("16", flashmla_sparse.flashmla_refusal(model(num_heads=16)))

    def test_sparse_rows_become_slots_padded_to_64(self):
        # Positions: 0 -> slot 6, 1 -> slot 7, 2 -> slot 0 (page 3 holds positions 0, 1).
        topk = np.array([[1, -1, 0], [-1, 2, -1]], np.int32)
        indices = flashmla_sparse.row_slot_indices(step(topk), 2)
        self.assertEqual(indices.shape, (2, 64))
        self.assertEqual(indices.dtype, np.int32)
        self.assertEqual(list(indices[0, :2]), [7, 6])
        self.assertEqual(list(indices[1, :1]), [0])
        self.assertTrue((indices[0, 2:] == -1).all() and (indices[1, 1:] == -1).all())

    def test_dense_rows_list_what_each_row_sees(self):
        indices = flashmla_sparse.row_slot_indices(step(), 2)
        self.assertEqual(list(indices[0, :3]), [6, 7, -1])  # row 0 at position 1
        self.assertEqual(list(indices[1, :4]), [6, 7, 0, -1])  # row 1 at position 2

    def test_padding(self):
        self.assertEqual(flashmla_sparse.padded_topk(1), 64)
        self.assertEqual(flashmla_sparse.padded_topk(64), 64)
        self.assertEqual(flashmla_sparse.padded_topk(2048), 2048)
        self.assertEqual(flashmla_sparse.padded_topk(2049), 2112)


if __name__ == "__main__":
    unittest.main()
