"""The Triton MLA adapters' argument mapping (kvdump/backends/triton_layout.py) and the peer file
loader's pure parts (peer_kernels.py), without a GPU, torch or triton.

Every expected value is written out here, worked by hand from the step's definition
(docs/kvdump-v1.md "Semantics": token p of request b lives in slot kv_indices[kv_indptr[b] +
p // P] * P + p % P; row j of n sees positions 0 .. kv_len - n + j) and from the servers'
split policies (vLLM triton_mla.py _compute_num_kv_splits; SGLang get_num_kv_splits_triton and
_mla_decode_kv_splits_cap).

Run: python3 -m unittest discover -s python/tests
"""

import math
import os
import sys
import tempfile
import unittest

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TESTS_DIR, ".."))

from kvdump.backends import peer_kernels, triton_layout as layout  # noqa: E402
from kvdump.backends.protocol import BackendError  # noqa: E402

# A step, page size 2: request 0 has pages [7, 2], 3 tokens (last page holds 1), one decode row;
# request 1 has pages [5, 0, 9], 5 tokens, two prefill rows; request 2 has a page, no rows.
PAGE = 2
QO_INDPTR = np.array([0, 1, 3, 3], dtype=np.int32)
KV_INDPTR = np.array([0, 2, 5, 6], dtype=np.int32)
KV_INDICES = np.array([7, 2, 5, 0, 9, 4], dtype=np.int32)
KV_LAST_PAGE_LEN = np.array([1, 1, 2], dtype=np.int32)


def entries():
    return layout.row_entries(QO_INDPTR, KV_INDPTR, KV_INDICES, KV_LAST_PAGE_LEN, PAGE)


class RowEntries(unittest.TestCase):
    def test_rows_become_entries_with_their_causal_extent(self):
        request_of_row, seq_len, slots = entries()
        self.assertEqual(request_of_row.tolist(), [0, 1, 1])
        # request 1: 5 tokens, 2 rows -> rows see 4 and 5 positions; the decode row sees all 3
        self.assertEqual(seq_len.tolist(), [3, 4, 5])
        self.assertEqual(sorted(slots), [0, 1])
        self.assertEqual(slots[0].tolist(), [14, 15, 4])
        self.assertEqual(slots[1].tolist(), [10, 11, 0, 1, 18])


class VllmBlockTable(unittest.TestCase):
    def test_each_row_gets_its_requests_pages_in_order_padded_with_zero(self):
        request_of_row, _, _ = entries()
        table = layout.vllm_block_table(request_of_row, KV_INDPTR, KV_INDICES)
        self.assertEqual(table.dtype, np.int32)
        self.assertEqual(table.tolist(), [[7, 2, 0], [5, 0, 9], [5, 0, 9]])


class SglangTokenIndices(unittest.TestCase):
    def test_each_row_reads_the_slots_of_its_visible_positions(self):
        indptr, indices = layout.sglang_token_indices(*entries())
        self.assertEqual(indptr.dtype, np.int32)
        self.assertEqual(indices.dtype, np.int64)
        self.assertEqual(indptr.tolist(), [0, 3, 7, 12])
        self.assertEqual(indices.tolist(), [14, 15, 4, 10, 11, 0, 1, 10, 11, 0, 1, 18])


class ConcatQ(unittest.TestCase):
    def test_q_nope_then_q_pe_on_the_last_axis(self):
        q_nope = np.array([[[1, 2, 3]], [[4, 5, 6]]], dtype=np.uint16)  # [2, 1, 3]
        q_pe = np.array([[[7]], [[8]]], dtype=np.uint16)  # [2, 1, 1]
        q = layout.concat_q(q_nope, q_pe)
        self.assertEqual(q.dtype, np.uint16)
        self.assertEqual(q.tolist(), [[[1, 2, 3, 7]], [[4, 5, 6, 8]]])

    def test_mismatched_rows_are_refused(self):
        with self.assertRaises(ValueError):
            layout.concat_q(np.zeros((2, 1, 3), np.uint16), np.zeros((3, 1, 1), np.uint16))


class Splits(unittest.TestCase):
    def test_vllm_policy(self):
        self.assertEqual(layout.vllm_num_kv_splits(100, 132), 1)  # 100 // 512 = 0 -> 1
        self.assertEqual(layout.vllm_num_kv_splits(1024, 132), 2)
        self.assertEqual(layout.vllm_num_kv_splits(5000, 132), 16)  # 9 -> next pow2 16
        self.assertEqual(layout.vllm_num_kv_splits(10**6, 132), 264)  # capped at 2 * SMs

    def test_sglang_cap(self):
        self.assertEqual(layout.sglang_max_kv_splits(68000, 132), 256)  # min(256, 4096)
        self.assertEqual(layout.sglang_max_kv_splits(100, 132), 8)  # max(8, min(256, 4))
        self.assertEqual(layout.sglang_max_kv_splits(100, 0), 8)

    def test_sglang_even_batch(self):
        # longest = shortest = 100: splits_1 = 1; ext cores 132 * max(log2(100 / 64), 1) = 132,
        # grid 2 entries x 1 head block -> splits_2 = min(66, 8) = 8, chunk 13 -> 8 splits
        self.assertEqual(layout.sglang_num_kv_splits([100, 100], 16, 8, 132).tolist(), [8, 8])

    def test_sglang_uneven_batch(self):
        # splits_1 = min(100, 16), chunk 63; ext cores int(132 * log2(15.625)) = 523, grid
        # 2 x 8 head blocks -> splits_2 = 16, chunk 63: cdiv(1000, 63) = 16, cdiv(10, 63) = 1
        self.assertEqual(layout.sglang_num_kv_splits([1000, 10], 128, 16, 132).tolist(),
                         [16, 1])

    def test_split_bounds(self):
        self.assertEqual(layout.split_bounds(100, 8, min_block=32),
                         [(0, 32), (32, 64), (64, 96), (96, 100)])
        self.assertEqual(layout.split_bounds(10, 4), [(0, 3), (3, 6), (6, 9), (9, 10)])


class MergeSplitLse(unittest.TestCase):
    def test_log_sum_exp_over_splits_ignoring_empty_ones(self):
        split_lse = np.array([[[0.0, math.log(3.0), -np.inf]],
                              [[-np.inf, -np.inf, -np.inf]]], dtype=np.float32)
        merged = layout.merge_split_lse(split_lse)
        self.assertEqual(merged.dtype, np.float32)
        self.assertAlmostEqual(float(merged[0, 0]), math.log(4.0), places=6)
        self.assertEqual(float(merged[1, 0]), -np.inf)

    def test_large_values_do_not_overflow(self):
        merged = layout.merge_split_lse(np.array([[1000.0, 1000.0]], dtype=np.float32))
        self.assertAlmostEqual(float(merged[0]), 1000.0 + math.log(2.0), places=3)


class PeerKernelFiles(unittest.TestCase):
    def test_missing_file_is_refused_naming_how_to_get_it(self):
        with tempfile.TemporaryDirectory() as empty:
            os.environ["KVAUDIT_PEER_KERNELS"] = empty
            here = os.getcwd()
            os.chdir(empty)  # build/peer-kernels is looked up relative to the working directory
            try:
                with self.assertRaises(BackendError) as caught:
                    peer_kernels.kernel_file(peer_kernels.VLLM, None)
            finally:
                os.chdir(here)
                del os.environ["KVAUDIT_PEER_KERNELS"]
        text = str(caught.exception)
        self.assertIn("scripts/fetch-peer-kernels.sh", text)
        self.assertIn("vllm-0.34.0/triton_decode_attention.py", text)

    def test_provenance_reports_a_sha256_that_differs_from_the_release(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "decode_attention.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write("x = 1\n")
            record = peer_kernels.provenance(peer_kernels.SGLANG, path)
        # sha256 of the 6 bytes "x = 1\n" (coreutils sha256sum)
        self.assertEqual(record["sha256"],
                         "9e26bf369911c45c243c684147b23fc9e1dcfcf257d299a1c632016a6fcd33f4")
        self.assertFalse(record["sha256_matches_release"])

    def test_release_tuple(self):
        self.assertEqual(peer_kernels.release_tuple("3.6.0+git1234"), (3, 6, 0))
        self.assertLess(peer_kernels.release_tuple("3.1.0"), peer_kernels.release_tuple("3.2.0"))


try:
    import torch
    TORCH_MISSING = None
except ImportError:
    TORCH_MISSING = "torch is not importable; the launch arguments are torch tensors"


def adapter(cls, **options):
    """An adapter of `cls` with no kernel loaded, on the CPU, for prepare_launch only."""
    import types

    made = cls.__new__(cls)
    made.options = types.SimpleNamespace(**{"num_kv_splits": 0, "lse_dtype": "bfloat16", **options})
    made.torch, made.device = torch, torch.device("cpu")
    return made


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class LaunchArguments(unittest.TestCase):
    """What each adapter hands its kernel for the step above: pool views, scales, index arrays."""

    def setUp(self):
        self.pool = torch.zeros((12, 576), dtype=torch.uint8)  # 6 pages of 2 slots
        self.q = torch.zeros((3, 16, 576), dtype=torch.bfloat16)

    def prepared(self, cls, **options):
        return adapter(cls, **options).prepare_launch(self.q, self.pool, entries(), KV_INDPTR,
                                                      KV_INDICES, PAGE, 0.25, 0.0625)

    def test_vllm(self):
        from kvdump.backends.vllm_triton_mla import VllmTritonMlaAdapter

        p = self.prepared(VllmTritonMlaAdapter)
        self.assertEqual(tuple(p["k_buffer"].shape), (6, 2, 1, 576))
        self.assertEqual(p["k_buffer"].dtype, torch.float8_e4m3fn)
        self.assertEqual(tuple(p["v_buffer"].shape), (6, 2, 1, 512))
        self.assertEqual(p["v_buffer"].stride(), (1152, 576, 576, 1))  # in place, not a copy
        self.assertEqual(p["v_buffer"].data_ptr(), self.pool.data_ptr())
        self.assertEqual(p["k_scale"].tolist(), [0.25])  # kv_scale once, as k and v scale
        self.assertEqual(p["sm_scale"], 0.0625)  # not folded with k_scale
        self.assertEqual(p["req_to_token"].tolist(), [[7, 2, 0], [5, 0, 9], [5, 0, 9]])
        self.assertEqual(p["b_seq_len"].tolist(), [3, 4, 5])
        self.assertEqual(p["num_kv_splits"], 1)
        self.assertEqual(tuple(p["attn_logits"].shape), (3, 16, 1, 513))
        self.assertEqual(p["lse"].dtype, torch.bfloat16)  # vLLM's forward_mqa: q.dtype
        self.assertEqual(self.prepared(VllmTritonMlaAdapter, lse_dtype="float32")["lse"].dtype,
                         torch.float32)

    def test_sglang(self):
        from kvdump.backends.sglang_triton_mla import SglangTritonMlaAdapter

        p = self.prepared(SglangTritonMlaAdapter, num_kv_splits=2)
        self.assertEqual(tuple(p["k_buffer"].shape), (12, 1, 576))
        self.assertEqual(tuple(p["v_buffer"].shape), (12, 1, 512))
        self.assertEqual(p["v_buffer"].data_ptr(), self.pool.data_ptr())
        # the kernel's wrapper folds k_scale into sm_scale itself: both go in unfolded, once
        self.assertEqual((p["sm_scale"], p["k_scale"], p["v_scale"]), (0.0625, 0.25, 0.25))
        self.assertEqual(p["kv_indptr"].tolist(), [0, 3, 7, 12])
        self.assertEqual(p["kv_indices"].tolist(), [14, 15, 4, 10, 11, 0, 1, 10, 11, 0, 1, 18])
        self.assertEqual(p["num_kv_splits"].tolist(), [2, 2, 2])
        self.assertEqual(p["max_kv_splits"], 2)
        self.assertEqual(tuple(p["attn_lse"].shape), (3, 16, 2))
        self.assertTrue(bool(torch.isneginf(p["attn_lse"]).all()))  # empty splits stay -inf


if __name__ == "__main__":
    unittest.main()


class DiagnoseTiles(unittest.TestCase):
    """The KV tiles each adapter declares for kvaudit's p-e4m3-tile replay (describe's
    "diagnose_tiles"): SGLang rounds P to e4m3 per 32-key tile of each split, vLLM to bf16."""

    @staticmethod
    def bare(cls, **options):
        import types

        made = cls.__new__(cls)
        made.options = types.SimpleNamespace(**{"num_kv_splits": 0, **options})
        return made

    def test_sglang_fixed_splits_is_one_shape(self):
        from kvdump.backends.sglang_triton_mla import SglangTritonMlaAdapter

        self.assertEqual(self.bare(SglangTritonMlaAdapter, num_kv_splits=4).diagnose_tiles(),
                         "32x4")

    def test_sglang_server_policy_offers_each_split_count(self):
        from kvdump.backends.sglang_triton_mla import SglangTritonMlaAdapter

        self.assertEqual(self.bare(SglangTritonMlaAdapter).diagnose_tiles(),
                         "32x1,32x2,32x4,32x8")

    def test_vllm_rounds_p_to_bf16_so_declares_none(self):
        from kvdump.backends.vllm_triton_mla import VllmTritonMlaAdapter

        self.assertIsNone(self.bare(VllmTritonMlaAdapter).diagnose_tiles())
