"""The flashinfer-fp8 and flashinfer-cast-bf16 adapters' plumbing, on the CPU, with a stand-in for
FlashInfer (no GPU, no flashinfer here).

FakeMlaWrapper follows the contract of flashinfer.mla.BatchMLAPagedAttentionWrapper as FlashInfer
0.6.18 documents it (flashinfer/mla/_core.py) and its kernel implements it (mla_hopper.cuh):
plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
page_size, causal, sm_scale, q_data_type, kv_data_type); run(q_nope, q_pe, ckv_cache
[pages, page_size, 512], kpe_cache [pages, page_size, 64], return_lse, return_lse_base_on_e,
ckv_scale, kpe_scale), where kv_len_arr is tokens, token p of request b is page
kv_indices[kv_indptr[b] + p // page_size] offset p % page_size, a causal row q_idx of a request
with qo_len rows masks kv_idx + qo_len > kv_len + q_idx, real value = code * scale for an FP8 KV
(scales required; refused for bf16), lse base 2 unless return_lse_base_on_e. It refuses what
FlashInfer refuses (dtype mismatches, scales with a bf16 KV, 512/64 widths only) and requests
without rows (the adapter must leave them out of the plan).

The adapters are started as kvdump.backends starts them, except that the device checks are
skipped and flashinfer is the stand-in; then a paged case (H 2, Dc 512, Dr 64, page 2, requests
with and without rows, NaN codes in every slot without a token) goes through run_step. Checked
against a float64 reference: flashinfer-fp8 (and its lse-base2 and scale-latent-only faults, which
must reach run() as return_lse_base_on_e=False / kpe_scale=1), flashinfer-cast-bf16 reading the
pool without kv_scale (what SGLang's cast did) and with --cast-scale fold, the causal flag per step
kind, the pool views read in place (the same storage as the adapter's pool).

Skipped by name where torch (>= 2.1) is not importable.
"""

import argparse
import math
import os
import shutil
import sys
import tempfile
import types
import unittest
from unittest import mock

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TESTS_DIR, ".."))
sys.path.insert(0, TESTS_DIR)

import kvdump  # noqa: E402
from test_backend_torch import (  # noqa: E402
    CACHED, STEPS, TORCH_MISSING, bf16_values, visible_slots)

if not TORCH_MISSING:
    import torch

H, DC, DR, PAGE, SLOTS = 2, 512, 64, 2, 16
D = DC + DR
KV_SCALE = float(np.float32(0.0731))
SM_SCALE = 192 ** -0.5
LN2 = math.log(2.0)


class FakeMlaWrapper:
    """FlashInfer's documented contract, computed plainly in float64 (see the module docstring)."""

    instances = []

    def __init__(self, workspace, backend="auto"):
        assert backend in ("fa2", "fa3"), backend
        self.backend = backend
        self.plans, self.runs = [], []
        FakeMlaWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        if kv_data_type == torch.float8_e4m3fn and (head_dim_ckv, head_dim_kpe) != (512, 64):
            raise ValueError("FP8 kv_data_type for MLA currently only supports head_dim_ckv=512")
        for array in (qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            assert array.dtype == torch.int32, array.dtype
        assert torch.all(torch.diff(qo_indptr) > 0), "a request without rows was planned"
        self.plans.append(dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                               kv_indices=kv_indices.tolist(), kv_len=kv_len_arr.tolist(),
                               num_heads=num_heads, page_size=page_size, causal=causal,
                               sm_scale=sm_scale, q_data_type=q_data_type,
                               kv_data_type=kv_data_type))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            return_lse_base_on_e=False, *, ckv_scale=None, kpe_scale=None):
        plan = self.plans[-1]
        self.runs.append(dict(ckv=ckv_cache, kpe=kpe_cache, ckv_scale=ckv_scale,
                              kpe_scale=kpe_scale, return_lse_base_on_e=return_lse_base_on_e))
        for tensor in (q_nope, q_pe):
            if tensor.dtype != plan["q_data_type"]:
                raise ValueError("q dtype does not match the planned q_data_type")
        for tensor in (ckv_cache, kpe_cache):
            if tensor.dtype != plan["kv_data_type"]:
                raise ValueError("kv dtype does not match the planned kv_data_type")
        fp8 = plan["kv_data_type"] == torch.float8_e4m3fn
        if fp8 and (ckv_scale is None or kpe_scale is None):
            raise ValueError("ckv_scale and kpe_scale are required when kv_data_type is FP8")
        if not fp8 and (ckv_scale is not None or kpe_scale is not None):
            raise ValueError("ckv_scale / kpe_scale are only valid when kv_data_type is FP8")
        ckv = ckv_cache.double() * (ckv_scale if fp8 else 1.0)
        kpe = kpe_cache.double() * (kpe_scale if fp8 else 1.0)
        nq, heads = q_nope.shape[:2]
        result = torch.zeros((nq, heads, ckv.shape[-1]), dtype=torch.float64)
        lse_out = torch.zeros((nq, heads), dtype=torch.float64)
        qo, kv, pages, lens = (plan[k] for k in ("qo_indptr", "kv_indptr", "kv_indices",
                                                  "kv_len"))
        page_size = plan["page_size"]
        for b in range(len(lens)):
            qo_len, kv_len = qo[b + 1] - qo[b], lens[b]
            tokens = [(pages[kv[b] + p // page_size], p % page_size) for p in range(kv_len)]
            c = torch.stack([ckv[page, off] for page, off in tokens])
            r = torch.stack([kpe[page, off] for page, off in tokens])
            for q_idx in range(qo_len):
                row = qo[b] + q_idx
                s = plan["sm_scale"] * (q_nope[row].double() @ c.T + q_pe[row].double() @ r.T)
                if plan["causal"]:
                    masked = torch.arange(kv_len) + qo_len > kv_len + q_idx
                    s = s.masked_fill(masked[None, :], -math.inf)
                row_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - row_lse[:, None])
                values = torch.where(torch.isnan(c), torch.zeros_like(c), c)
                result[row] = p @ values
                lse_out[row] = row_lse if return_lse_base_on_e else row_lse / LN2
        result = result.to(torch.bfloat16)
        return (result, lse_out.float()) if return_lse else result


def fake_flashinfer():
    module = types.ModuleType("flashinfer")
    module.__version__ = "fake-0.6.18"
    module.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMlaWrapper)
    return module


def make_case(seed=17):
    rng = np.random.default_rng(seed)
    pool = np.where(rng.random((SLOTS, D)) < 0.5, 0x7F, 0xFF).astype(np.uint8)
    pool[CACHED] = kvdump.quantize_e4m3(bf16_values(rng, len(CACHED), D, scale=6.0), KV_SCALE)
    steps = []
    for kind, indices in STEPS:
        nq = len(indices["new_kv_slots"])
        steps.append({"kind": kind, "indices": {k: np.array(v, np.int32)
                                                for k, v in indices.items()},
                      "q_nope": bf16_values(rng, nq, H, DC, scale=0.05),
                      "q_pe": bf16_values(rng, nq, H, DR, scale=0.05),
                      "new_kv": bf16_values(rng, nq, D, scale=6.0)})
    return pool, steps


def reference(pool, steps, ckv_scale=KV_SCALE, kpe_scale=KV_SCALE):
    """float64 replay with kvdump's write rule: per step (pool, out, lse)."""
    pool = pool.copy()
    results = []
    for step in steps:
        pool[step["indices"]["new_kv_slots"]] = kvdump.quantize_e4m3(step["new_kv"], KV_SCALE)
        values = kvdump.decode_e4m3(pool).astype(np.float64)
        c_all, r_all = values[:, :DC] * ckv_scale, values[:, DC:] * kpe_scale
        rows = visible_slots(step["indices"])
        out, lse = np.zeros((len(rows), H, DC)), np.zeros((len(rows), H))
        for i, seen in enumerate(rows):
            s = SM_SCALE * (step["q_nope"][i] @ c_all[seen].T + step["q_pe"][i] @ r_all[seen].T)
            lse[i] = np.log(np.exp(s).sum(axis=1))
            out[i] = np.exp(s - lse[i][:, None]) @ c_all[seen]
        results.append((pool.copy(), out, lse))
    return results


def close(out, ref, relative):
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    return np.all(np.abs(out - ref) <= relative * np.abs(ref) + 1e-5 * scale)


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class FlashInferPlumbingTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pool, cls.steps = make_case()
        cls.clean = reference(cls.pool, cls.steps)

    def serve(self, adapter_name, *faults, cast_scale="none"):
        """Runs the case through the adapter; returns (adapter, per step (pool, out, lse))."""
        from kvdump.backends import adapter_class, protocol

        cls = adapter_class(adapter_name)

        class OnCpu(cls):
            default_device = "cpu"

            def check_model(self, model):  # the SM90 / CUDA checks; widths are FakeMlaWrapper's
                pass

        directory = tempfile.mkdtemp(prefix="kvdump-flashinfer-test-")
        self.addCleanup(shutil.rmtree, directory)
        options = argparse.Namespace(device=None, write="kvdump", fault=list(faults),
                                     flashinfer_backend="fa2", cast_scale=cast_scale)
        adapter = OnCpu(options)
        model = protocol.ModelInfo(num_heads=H, kv_lora_rank=DC, qk_rope_head_dim=DR,
                                   sm_scale=SM_SCALE, page_size=PAGE, num_slots=SLOTS,
                                   kv_dtype="float8_e4m3fn", kv_scale_kind="per_tensor")
        files = protocol.SessionFiles(directory)
        with mock.patch("kvdump.backends.environment.import_flashinfer", fake_flashinfer):
            describe = adapter.start(model, files)
        self.assertEqual(describe["flashinfer"], "fake-0.6.18")
        self.pool.tofile(os.path.join(directory, "pool.bin"))
        spec = files.spec({"file": "pool.bin", "dtype": "uint8", "shape": [SLOTS, D]}, "pool")
        layer = protocol.LayerInfo("L000", 0, KV_SCALE)
        adapter.load_layer(layer, spec)
        results = []
        for index, step in enumerate(self.steps):
            bits = kvdump.bf16_bits_from_float32
            request = protocol.StepRequest(
                index=index, group=f"S{index:03d}", kind=step["kind"], layer=layer,
                pool_reloaded=False, q_nope=bits(step["q_nope"]), q_pe=bits(step["q_pe"]),
                new_kv=bits(step["new_kv"]), **step["indices"])
            result = adapter.run_step(request)
            results.append((np.fromfile(spec.path, np.uint8).reshape(SLOTS, D),
                            kvdump.float32_from_bf16_bits(result.out_bits), result.lse))
        return adapter, results

    def assert_matches(self, results, expected, relative=2.0**-8, lse_scale=1.0):
        for (pool, out, lse), (ref_pool, ref_out, ref_lse) in zip(results, expected):
            np.testing.assert_array_equal(pool, ref_pool)
            self.assertTrue(close(out, ref_out, relative), np.abs(out - ref_out).max())
            np.testing.assert_allclose(lse, ref_lse * lse_scale, rtol=1e-5, atol=1e-5)

    def test_fp8_plans_and_runs_as_flashinfer_documents(self):
        adapter, results = self.serve("flashinfer-fp8")
        self.assert_matches(results, self.clean)
        wrapper = adapter.wrapper
        self.assertEqual(wrapper.backend, "fa2")
        self.assertEqual([p["causal"] for p in wrapper.plans], [True, False])
        prefill = wrapper.plans[0]
        # Requests 1 and 2 have no rows in the prefill: left out, the rest renumbered.
        self.assertEqual(prefill["qo_indptr"], [0, 2, 5])
        self.assertEqual(prefill["kv_indices"], [5, 2, 6, 0, 3])
        self.assertEqual(prefill["kv_len"], [5, 3])
        self.assertEqual(prefill["kv_data_type"], torch.float8_e4m3fn)
        run = wrapper.runs[0]
        self.assertEqual((run["ckv_scale"], run["kpe_scale"], run["return_lse_base_on_e"]),
                         (KV_SCALE, KV_SCALE, True))
        # The views read the adapter's pool in place: same storage, FlashInfer's shapes.
        pool = adapter.pools["L000"].tensor
        self.assertEqual(run["ckv"].data_ptr(), pool.data_ptr())
        self.assertEqual(run["kpe"].data_ptr(), pool.data_ptr() + DC)
        self.assertEqual(tuple(run["ckv"].shape), (SLOTS // PAGE, PAGE, DC))
        self.assertEqual(tuple(run["kpe"].shape), (SLOTS // PAGE, PAGE, DR))

    def test_fp8_fault_lse_base2_leaves_return_lse_base_on_e_off(self):
        adapter, results = self.serve("flashinfer-fp8", "lse-base2")
        self.assertFalse(adapter.wrapper.runs[0]["return_lse_base_on_e"])
        self.assert_matches(results, self.clean, lse_scale=1 / LN2)

    def test_fp8_fault_scale_latent_only(self):
        adapter, results = self.serve("flashinfer-fp8", "scale-latent-only")
        self.assertEqual(adapter.wrapper.runs[0]["kpe_scale"], 1.0)
        self.assert_matches(results, reference(self.pool, self.steps, kpe_scale=1.0))

    def test_cast_reads_the_pool_without_kv_scale_as_sglang_did(self):
        adapter, results = self.serve("flashinfer-cast-bf16")
        run = adapter.wrapper.runs[0]
        self.assertEqual(run["ckv"].dtype, torch.bfloat16)
        self.assertIsNone(run["ckv_scale"])
        self.assertNotEqual(run["ckv"].data_ptr(), adapter.pools["L000"].tensor.data_ptr())
        self.assert_matches(results, reference(self.pool, self.steps, ckv_scale=1.0,
                                               kpe_scale=1.0))

    def test_cast_fold_keeps_kv_scale(self):
        adapter, results = self.serve("flashinfer-cast-bf16", cast_scale="fold")
        self.assertAlmostEqual(adapter.wrapper.plans[0]["sm_scale"], SM_SCALE * KV_SCALE)
        # out is rounded to bf16 twice (the kernel's out, then out * kv_scale).
        self.assert_matches(results, self.clean, relative=2.0**-7)

    def test_cast_refuses_read_faults(self):
        from kvdump.backends import protocol

        with self.assertRaises(protocol.BackendError) as caught:
            self.serve("flashinfer-cast-bf16", "scale-pow2")
        self.assertEqual(caught.exception.kind, "unsupported")


if __name__ == "__main__":
    unittest.main()
