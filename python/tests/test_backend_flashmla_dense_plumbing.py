"""The flashmla-dense-fp8 adapter's argument mapping without torch or a GPU
(kvdump/backends/flashmla_dense_fp8.py), and the FlashInfer version series of flashinfer_fp8.py.

Expected values are worked out by hand below: block tables from the page tables of small steps,
the re-paged gather for a page_size 1 pool, the grouping of a prefill step by rows per request,
and the e4m3 codes of q as vLLM's QuantFP8 (static per-tensor: fp32(q) * fp32(1 / q_scale),
clamped to +-448, rounded to nearest even) and SGLang's q.to(float8_e4m3fn) (no scale, NaN at
|q| >= 480) make them, with the descales each caller passes.

Run: python3 -m unittest discover -s python/tests
"""

import os
import sys
import unittest
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvdump.backends import flashinfer_fp8, flashmla_dense_fp8 as dense  # noqa: E402


def model(**changes):
    fields = dict(grouped=False, kv_dtype="float8_e4m3fn", kv_lora_rank=512, qk_rope_head_dim=64)
    fields.update(changes)
    return SimpleNamespace(**fields)


def step(qo_indptr, kv_indptr, kv_indices, kv_last_page_len):
    return SimpleNamespace(qo_indptr=np.array(qo_indptr, np.int32),
                           kv_indptr=np.array(kv_indptr, np.int32),
                           kv_indices=np.array(kv_indices, np.int32),
                           kv_last_page_len=np.array(kv_last_page_len, np.int32))


class DenseRefusalTests(unittest.TestCase):
    def test_takes_only_the_all_fp8_576_byte_slot(self):
        self.assertIsNone(dense.dense_refusal(model()))
        self.assertIn("per_token_group", dense.dense_refusal(model(grouped=True)))
        self.assertIn("bfloat16", dense.dense_refusal(model(kv_dtype="bfloat16")))
        self.assertIn("576", dense.dense_refusal(model(qk_rope_head_dim=32)))


class LaunchTests(unittest.TestCase):
    def test_page_64_pool_is_read_in_place(self):
        # Request 0: pages [5, 2], 64 + 6 = 70 tokens, row 0; request 1: page [3], no row;
        # request 2: page [7], 3 tokens, row 1.
        launches = dense.launches(step([0, 1, 1, 2], [0, 2, 3, 4], [5, 2, 3, 7], [6, 10, 3]), 64)
        self.assertEqual(len(launches), 1)
        launch = launches[0]
        self.assertEqual(launch.rows.tolist(), [[0], [1]])
        self.assertEqual(launch.seqlens.dtype, np.int32)
        self.assertEqual(launch.seqlens.tolist(), [70, 3])
        self.assertEqual(launch.block_table.dtype, np.int32)
        self.assertEqual(launch.block_table.tolist(), [[5, 2], [7, 0]])
        self.assertIsNone(launch.gather)

    def test_prefill_requests_are_grouped_by_rows(self):
        # Rows per request 3, 1, 3 (rows 0-2, 3, 4-6); one page each: [4], [1], [6] with 5, 2
        # and 3 tokens. The kernel takes [B, s_q, ...]: one launch for s_q 3 (requests 0, 2),
        # one for s_q 1 (request 1), in order of first appearance.
        launches = dense.launches(step([0, 3, 4, 7], [0, 1, 2, 3], [4, 1, 6], [5, 2, 3]), 64)
        self.assertEqual([launch.rows_per_request for launch in launches], [3, 1])
        self.assertEqual(launches[0].rows.tolist(), [[0, 1, 2], [4, 5, 6]])
        self.assertEqual(launches[0].seqlens.tolist(), [5, 3])
        self.assertEqual(launches[0].block_table.tolist(), [[4], [6]])
        self.assertEqual(launches[1].rows.tolist(), [[3]])
        self.assertEqual(launches[1].block_table.tolist(), [[1]])

    def test_other_page_sizes_are_repaged_into_64_token_pages(self):
        # page_size 1: request 0 holds slots 9, 4, 6 (3 tokens); request 1 holds slots 100..164
        # (65 tokens: two scratch pages). Scratch pages: 0 for request 0, 1 and 2 for request 1.
        slots_1 = list(range(100, 165))
        launches = dense.launches(
            step([0, 1, 2], [0, 3, 68], [9, 4, 6] + slots_1, [1, 1]), 1)
        launch = launches[0]
        self.assertEqual(launch.seqlens.tolist(), [3, 65])
        self.assertEqual(launch.block_table.tolist(), [[0, 0], [1, 2]])
        self.assertEqual(launch.gather.shape, (3 * 64,))
        self.assertEqual(launch.gather[:4].tolist(), [9, 4, 6, -1])
        self.assertTrue((launch.gather[3:64] == -1).all())
        self.assertEqual(launch.gather[64:64 + 65].tolist(), slots_1)
        self.assertTrue((launch.gather[64 + 65:] == -1).all())


class CallerRuleTests(unittest.TestCase):
    def test_vllm_quantizes_q_with_the_reciprocal_of_q_scale_and_clamps(self):
        rule = dense.CallerRule("vllm", 2.0)
        # x / 2: 0.5 -> 0x30, 1.5 -> 0x3C, -500 -> clamped -448 -> 0xFE, 0.15 -> 0.15625 (0x22,
        # nearer than 0.140625), 0 -> 0x00.
        q = np.array([1.0, 3.0, -1000.0, 0.3, 0.0], np.float32)
        self.assertEqual(rule.q_codes(q).tolist(), [0x30, 0x3C, 0xFE, 0x22, 0x00])
        descale_q, descale_k = rule.descales(0.125)
        self.assertEqual((descale_q, descale_k), (2.0, 0.125))
        self.assertEqual((descale_q.dtype, descale_k.dtype), (np.float32, np.float32))

    def test_vllm_default_q_scale_is_one(self):
        rule = dense.CallerRule("vllm", 1.0)
        # 1.0 -> 0x38, 450 -> clamped 448 -> 0x7E (not NaN), 0.0625 -> 0x18.
        q = np.array([1.0, 450.0, 0.0625], np.float32)
        self.assertEqual(rule.q_codes(q).tolist(), [0x38, 0x7E, 0x18])
        self.assertEqual(rule.descales(0.5), (1.0, 0.5))

    def test_sglang_casts_q_without_scale_and_ignores_kv_scale(self):
        rule = dense.CallerRule("sglang", 4.0)
        # No scale: 1.0 -> 0x38; 470 rounds to 448 (0x7E); PyTorch's cast gives NaN at |q| >= 480:
        # 480 -> 0x7F, -500 -> 0xFF.
        q = np.array([1.0, 470.0, 480.0, -500.0], np.float32)
        self.assertEqual(rule.q_codes(q).tolist(), [0x38, 0x7E, 0x7F, 0xFF])
        self.assertEqual(rule.descales(0.125), (1.0, 1.0))


class BenchLaunchTests(unittest.TestCase):
    """kvaudit bench --peer flashmla-dense-fp8: the case's pages and q as the kernel takes them."""

    @staticmethod
    def adapter(caller="vllm"):
        made = dense.FlashMlaDenseFp8Adapter.__new__(dense.FlashMlaDenseFp8Adapter)
        made.name = "flashmla-dense-fp8"
        made.rule = dense.CallerRule(caller, 1.0)
        return made

    def test_pages_rows_and_q_codes_of_a_decode_case(self):
        # Two requests of 74 and 128 tokens: pages [3, 1] (last page 10 tokens) and [0, 2].
        case = SimpleNamespace(page_size=64)
        data = SimpleNamespace(qo_indptr=np.array([0, 1, 2], np.int32),
                               kv_indptr=np.array([0, 2, 4], np.int32),
                               kv_indices=np.array([3, 1, 0, 2], np.int32),
                               kv_last_page_len=np.array([10, 64], np.int32))
        q = np.zeros((2, 1, 576), np.float32)
        q[0, 0, 0], q[1, 0, 575] = 1.0, -2.0  # e4m3 0x38 and 0xC0
        codes, launch = self.adapter().bench_launch(case, data, q)
        self.assertEqual(launch.block_table.tolist(), [[3, 1], [0, 2]])
        self.assertEqual(launch.seqlens.tolist(), [74, 128])
        self.assertEqual(launch.rows.tolist(), [[0], [1]])
        self.assertEqual(codes.shape, (2, 1, 1, 576))  # [B, s_q, H, 576]
        self.assertEqual((int(codes[0, 0, 0, 0]), int(codes[1, 0, 0, 575])), (0x38, 0xC0))

    def test_other_page_sizes_are_refused(self):
        case = SimpleNamespace(page_size=16)
        with self.assertRaises(Exception) as caught:
            self.adapter().bench_launch(case, None, None)
        self.assertIn("page_size 64", str(caught.exception))


class FlashInferSeriesTests(unittest.TestCase):
    def test_versions_map_to_their_series(self):
        self.assertEqual(flashinfer_fp8.flashinfer_series("0.7.4"), (0, 7))
        self.assertEqual(flashinfer_fp8.flashinfer_series("0.6.18+cu130"), (0, 6))
        self.assertEqual(flashinfer_fp8.flashinfer_series("0.7rc1"), (0, 7))
        self.assertIsNone(flashinfer_fp8.flashinfer_series("fake-0.6.18"))
        self.assertIsNone(flashinfer_fp8.flashinfer_series("unknown"))

    def test_describe_names_the_checked_release(self):
        self.assertIn("checked against 0.7.4", flashinfer_fp8.series_note("0.7.4"))
        self.assertIn("checked against 0.6.18", flashinfer_fp8.series_note("0.6.18"))
        self.assertIn("not a series", flashinfer_fp8.series_note("0.8.0"))


if __name__ == "__main__":
    unittest.main()
