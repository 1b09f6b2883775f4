"""The flashmla-dense-fp8 adapter end to end on the CPU with torch, with a stand-in for the
extension (no GPU, no FlashMLA build here).

FakeDenseFp8 follows the contract of FlashMLA's dense FP8 binding (vllm-project/FlashMLA 46d64a8e,
csrc/extension/sm90/dense_fp8/pybind.cpp): fwd_kvcache_mla_fp8(q [B, s_q, H, 576] e4m3, kcache
[blocks, 64, 1, 576] e4m3, 512, seqlens int32 [B], block_table int32 [B, pages], sm_scale,
causal, tile metadata, num_splits, descale_q float32 [1], descale_k float32 [1]) -> out [B, s_q,
H, 512] bf16 and lse [B, H, s_q] natural log, token p of request b in slot
block_table[b, p // 64] * 64 + p % 64, a causal row j of s_q seeing positions <= seqlen - s_q + j,
real q = code * descale_q and real k = code * descale_k; it computes that in float64 (no P
rounding: the tests are of the plumbing, not of the kernel's numerics) and refuses what the
binding refuses (dtypes, page size, shapes).

A step with a prefill of 2 rows and 1 row (two launches: the kernel takes [B, s_q, ...]) and a
decode step go through run_step, for a pool of 64-token pages (read in place) and of 1-token
pages (re-paged). Checked against a float64 reference written here from kvdump's codec: the
pool's codes times kv_scale, q rounded to e4m3 after the scale of the caller (vLLM: fp32(q) *
fp32(1 / q_scale), clamped; SGLang: no scale) and multiplied back by the descale.

Skipped by name where torch is not importable.
"""

import argparse
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvdump  # noqa: E402
from kvdump import codec  # noqa: E402

try:
    import torch
    TORCH_MISSING = None
except ImportError:
    TORCH_MISSING = "torch is not importable"

H, DC, DR = 2, 512, 64
D = DC + DR
SM_SCALE = 0.0721
KV_SCALE = 0.125


class FakeDenseFp8:
    """Stand-in for the extension module: the binding's contract in float64; records calls."""

    def __init__(self):
        self.calls = []

    def get_mla_decoding_metadata_dense_fp8(self, seqlens, q_rows_per_head_k, num_heads_k):
        assert seqlens.dtype == torch.int32 and num_heads_k == 1
        self.metadata = (seqlens.tolist(), q_rows_per_head_k)
        return torch.zeros((4, 8), dtype=torch.int32), torch.zeros(len(seqlens) + 1,
                                                                     dtype=torch.int32)

    def fwd_kvcache_mla_fp8(self, q, kcache, d_v, seqlens, table, sm_scale, causal, tiles,
                            splits, descale_q, descale_k):
        assert q.dtype == torch.float8_e4m3fn and kcache.dtype == torch.float8_e4m3fn
        assert d_v == DC and q.shape[-1] == D and tuple(kcache.shape[1:]) == (64, 1, D)
        assert seqlens.dtype == torch.int32 and table.dtype == torch.int32
        assert descale_q.dtype == torch.float32 and tuple(descale_q.shape) == (1,)
        assert self.metadata == (seqlens.tolist(), q.shape[1] * q.shape[2])
        self.calls.append({"s_q": q.shape[1], "seqlens": seqlens.tolist(),
                           "table": table.tolist(), "causal": causal,
                           "descale_q": float(descale_q[0]), "descale_k": float(descale_k[0]),
                           "sm_scale": sm_scale})
        batch, s_q, heads, _ = q.shape
        qv = codec.decode_e4m3(q.view(torch.uint8).numpy()).astype(np.float64) * float(descale_q[0])
        cache = codec.decode_e4m3(kcache.view(torch.uint8).numpy().reshape(-1, D))
        cache = cache.astype(np.float64) * float(descale_k[0])
        out = np.zeros((batch, s_q, heads, DC))
        lse = np.zeros((batch, heads, s_q))
        for b in range(batch):
            n = int(seqlens[b])
            slots = np.array([int(table[b, p // 64]) * 64 + p % 64 for p in range(n)])
            for j in range(s_q):
                seen = slots[:n - s_q + j + 1] if (causal and s_q > 1) else slots
                s = sm_scale * (qv[b, j] @ cache[seen].T)
                row_lse = np.log(np.exp(s).sum(axis=1))
                out[b, j] = np.exp(s - row_lse[:, None]) @ cache[seen, :DC]
                lse[b, :, j] = row_lse
        return torch.from_numpy(out).to(torch.bfloat16), torch.from_numpy(lse).float()


def bf16_values(rng, *shape, scale):
    raw = (rng.standard_normal(shape) * scale).astype(np.float32)
    return kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(raw))


def make_case(page, seed=5):
    """Two requests: 70 cached tokens + 2 prefill rows, 3 cached + 1 prefill row; then one decode
    row each. Slots are scattered over the pool: request 0 pages / slots first, then request 1."""
    rng = np.random.default_rng(seed)
    slots_per_request = [np.arange(0, 73), np.arange(128, 133)]  # capacity for every step
    lens = [(70, 2), (3, 1)]
    pool_slots = 192
    pool = np.zeros((pool_slots, D), np.uint8)
    for slots, (cached, _) in zip(slots_per_request, lens):
        pool[slots[:cached]] = kvdump.quantize_e4m3(bf16_values(rng, cached, D, scale=4.0),
                                                    KV_SCALE)
    steps = []
    for kind, new in (("prefill", [2, 1]), ("decode", [1, 1])):
        kv_len = [c + n for (c, _), n in zip(lens, new)]
        new_slots = np.concatenate([s[c:c + n] for s, (c, _), n in zip(slots_per_request,
                                                                          lens, new)])
        pages = [np.unique(s[:k] // page) for s, k in zip(slots_per_request, kv_len)]
        step = {"kind": kind, "indices": {
            "qo_indptr": np.array([0, new[0], new[0] + new[1]], np.int32),
            "kv_indptr": np.array([0, len(pages[0]), len(pages[0]) + len(pages[1])], np.int32),
            "kv_indices": np.concatenate(pages).astype(np.int32),
            "kv_last_page_len": np.array([(k - 1) % page + 1 for k in kv_len], np.int32),
            "new_kv_slots": new_slots.astype(np.int32)},
            "q_nope": bf16_values(rng, sum(new), H, DC, scale=0.3),
            "q_pe": bf16_values(rng, sum(new), H, DR, scale=0.3),
            "new_kv": bf16_values(rng, sum(new), D, scale=4.0),
            "visible": [s[:k - n + j + 1] for s, k, n in zip(slots_per_request, kv_len, new)
                        for j in range(n)]}
        steps.append(step)
        lens = [(k, n) for k, n in zip(kv_len, new)]
    return pool, steps, pool_slots


def reference(pool, steps, q_codes, descale_q, descale_k):
    """float64 per step (out, lse) over the pool kvdump's write rule keeps."""
    pool = pool.copy()
    results = []
    for step in steps:
        pool[step["indices"]["new_kv_slots"]] = kvdump.quantize_e4m3(step["new_kv"], KV_SCALE)
        values = kvdump.decode_e4m3(pool).astype(np.float64) * descale_k
        q = np.concatenate([step["q_nope"], step["q_pe"]], axis=-1)
        qv = codec.decode_e4m3(q_codes(q)).astype(np.float64) * descale_q
        out, lse = np.zeros((len(q), H, DC)), np.zeros((len(q), H))
        for i, seen in enumerate(step["visible"]):
            s = SM_SCALE * (qv[i] @ values[seen].T)
            lse[i] = np.log(np.exp(s).sum(axis=1))
            out[i] = np.exp(s - lse[i][:, None]) @ values[seen, :DC]
        results.append((out, lse))
    return results


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class FlashMlaDenseTorchTests(unittest.TestCase):
    def serve(self, page, caller="vllm", q_scale=1.0):
        from kvdump.backends import adapter_class, protocol

        fake = FakeDenseFp8()

        class OnCpu(adapter_class("flashmla-dense-fp8")):
            default_device = "cpu"

            def import_libraries(self):
                from kvdump.backends.flashmla_dense_fp8 import CallerRule
                self.extension = fake
                self.rule = CallerRule(self.options.flashmla_caller, self.options.q_scale)

            def check_model(self, model):  # the SM90 / CUDA checks
                pass

        pool, steps, slots = make_case(page)
        directory = tempfile.mkdtemp(prefix="kvdump-flashmla-dense-test-")
        self.addCleanup(shutil.rmtree, directory)
        options = argparse.Namespace(device=None, write="kvdump", fault=[],
                                     flashmla_module="fake.so", flashmla_caller=caller,
                                     q_scale=q_scale, prefill="causal")
        adapter = OnCpu(options)
        model = protocol.ModelInfo(num_heads=H, kv_lora_rank=DC, qk_rope_head_dim=DR,
                                   sm_scale=SM_SCALE, page_size=page, num_slots=slots,
                                   kv_dtype="float8_e4m3fn", kv_scale_kind="per_tensor")
        files = protocol.SessionFiles(directory)
        describe = adapter.start(model, files)
        pool.tofile(os.path.join(directory, "pool.bin"))
        spec = files.spec({"file": "pool.bin", "dtype": "uint8", "shape": [slots, D]}, "pool")
        layer = protocol.LayerInfo("L000", 0, KV_SCALE)
        adapter.load_layer(layer, spec)
        results = []
        for index, step in enumerate(steps):
            bits = kvdump.bf16_bits_from_float32
            request = protocol.StepRequest(
                index=index, group=f"S{index:03d}", kind=step["kind"], layer=layer,
                pool_reloaded=False, q_nope=bits(step["q_nope"]), q_pe=bits(step["q_pe"]),
                new_kv=bits(step["new_kv"]), **step["indices"])
            result = adapter.run_step(request)
            results.append((kvdump.float32_from_bf16_bits(result.out_bits), result.lse))
        return fake, describe, results, pool, steps

    def assert_matches(self, results, expected):
        for (out, lse), (ref_out, ref_lse) in zip(results, expected):
            scale = np.abs(ref_out).max()
            np.testing.assert_allclose(out, ref_out, rtol=2.0**-8, atol=2.0**-8 * scale)
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)

    def test_page_64_pool_in_place_vllm_caller(self):
        fake, describe, results, pool, steps = self.serve(64, q_scale=0.5)
        # vLLM's q: e4m3(clamp(fp32(q) * 2, +-448)), descale_q 0.5, descale_k = kv_scale.
        codes = lambda q: codec.encode_e4m3(np.clip(q * np.float32(2.0), -448, 448))  # noqa: E731
        self.assert_matches(results, reference(pool, steps, codes, 0.5, KV_SCALE))
        # Prefill: s_q 2 for request 0, then s_q 1 for request 1; decode: both, s_q 1.
        self.assertEqual([(c["s_q"], c["seqlens"]) for c in fake.calls],
                         [(2, [72]), (1, [4]), (1, [73, 5])])
        self.assertEqual([c["table"] for c in fake.calls], [[[0, 1]], [[2]], [[0, 1], [2, 0]]])
        self.assertEqual({(c["descale_q"], c["descale_k"], c["causal"]) for c in fake.calls},
                         {(0.5, KV_SCALE, True)})
        self.assertEqual(describe["kernel"]["pool"], "in place")

    def test_page_1_pool_is_repaged(self):
        fake, describe, results, pool, steps = self.serve(1)
        codes = lambda q: codec.encode_e4m3(np.clip(q, -448, 448))  # noqa: E731
        self.assert_matches(results, reference(pool, steps, codes, 1.0, KV_SCALE))
        # Scratch pages in request order: request 0 pages 0-1 (72 tokens), request 1 page 0 of
        # its own launch in the prefill, page 2 in the decode.
        self.assertEqual([c["table"] for c in fake.calls], [[[0, 1]], [[0]], [[0, 1], [2, 0]]])
        self.assertIn("re-paged", describe["kernel"]["pool"])

    def test_sglang_caller_casts_q_and_drops_kv_scale(self):
        fake, _, results, pool, steps = self.serve(64, caller="sglang", q_scale=0.5)
        codes = lambda q: codec.encode_e4m3(q)  # noqa: E731  (|q| < 448 here)
        self.assert_matches(results, reference(pool, steps, codes, 1.0, 1.0))
        self.assertEqual({(c["descale_q"], c["descale_k"]) for c in fake.calls}, {(1.0, 1.0)})


if __name__ == "__main__":
    unittest.main()
