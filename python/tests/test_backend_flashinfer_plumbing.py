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

Per-token scales (protocol version 2, a per_token_group pool of 592-byte slots [512 e4m3 codes]
[4 float32 scales][64 e4m3 codes]; flashinfer_fp8.py): run() must get ckv_scale_arr, the slots'
float32 scales as a contiguous float32 [pages, page_size, 4] indexed by physical slot, and
kpe_scale = kv_scale (ckv_scale not passed: FlashInfer takes exactly one of the two), with
ckv [pages, page_size, 512] and kpe [pages, page_size, 64] float8_e4m3fn views of the pool in
place (592 bytes per token, kpe at byte 528); new rows are written by the v1.1 rule
(kvdump.codec.quantize_rows). The kernel's contract (FlashInfer 0.6.18 mla_hopper.cuh: a latent
element is bf16(float(code) * scale[slot, j / 128]), kpe bf16(code) * bf16(kpe_scale)) is computed
plainly by the stand-in wrappers. Forms FlashInfer cannot read (a bf16 RoPE part, e8m0 scales,
groups other than 128) are refused as unsupported, naming why.

PerTokenPlumbingTests need neither torch nor flashinfer: a numpy stand-in for the few torch
operations the path uses (FakeTorch: from_numpy, views of a dtype or shape, slices, contiguous)
carries the adapter's own run_step. FlashInferPlumbingTests (the per_tensor path, and the
per-token path again with real torch tensors) are skipped by name where torch (>= 2.1) is not
importable.
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
from kvdump.backends import grouped, protocol  # noqa: E402
from kvdump.backends.faults import Conventions  # noqa: E402
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
            return_lse_base_on_e=False, *, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
        plan = self.plans[-1]
        self.runs.append(dict(ckv=ckv_cache, kpe=kpe_cache, ckv_scale=ckv_scale,
                              ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale,
                              return_lse_base_on_e=return_lse_base_on_e))
        for tensor in (q_nope, q_pe):
            if tensor.dtype != plan["q_data_type"]:
                raise ValueError("q dtype does not match the planned q_data_type")
        for tensor in (ckv_cache, kpe_cache):
            if tensor.dtype != plan["kv_data_type"]:
                raise ValueError("kv dtype does not match the planned kv_data_type")
        fp8 = plan["kv_data_type"] == torch.float8_e4m3fn
        if fp8 and ((ckv_scale is None) == (ckv_scale_arr is None) or kpe_scale is None):
            raise ValueError("Exactly one of ckv_scale or ckv_scale_arr, and kpe_scale, are "
                             "required when kv_data_type is FP8")
        if not fp8 and (ckv_scale is not None or ckv_scale_arr is not None
                        or kpe_scale is not None):
            raise ValueError("ckv_scale / ckv_scale_arr / kpe_scale are only valid when "
                             "kv_data_type is FP8")
        if ckv_scale_arr is not None:
            expected = (*ckv_cache.shape[:-1], ckv_cache.shape[-1] // 128)
            if (tuple(ckv_scale_arr.shape) != expected or ckv_scale_arr.dtype != torch.float32
                    or not ckv_scale_arr.is_contiguous()):
                raise ValueError(f"ckv_scale_arr must be contiguous float32 {expected}")
            # bf16(float(code) * scale), the scale of the element's slot and 128 channels.
            ckv = (ckv_cache.float() * ckv_scale_arr.repeat_interleave(128, dim=-1)).to(
                torch.bfloat16).double()
            kpe = (kpe_cache.to(torch.bfloat16) * torch.tensor(kpe_scale).to(
                torch.bfloat16)).double()
        else:
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


def attend(step, latent, rope):
    """float64 attention of the step's rows over the pool's slots as values: latent [S, Dc] (K's
    first columns and V), rope [S, Dr]; returns out [rows, H, Dc] and natural-log lse [rows, H]."""
    rows = visible_slots(step["indices"])
    out, lse = np.zeros((len(rows), H, DC)), np.zeros((len(rows), H))
    for i, seen in enumerate(rows):
        s = SM_SCALE * (step["q_nope"][i] @ latent[seen].T + step["q_pe"][i] @ rope[seen].T)
        lse[i] = np.log(np.exp(s).sum(axis=1))
        out[i] = np.exp(s - lse[i][:, None]) @ latent[seen]
    return out, lse


def reference(pool, steps, ckv_scale=KV_SCALE, kpe_scale=KV_SCALE):
    """float64 replay with kvdump's write rule: per step (pool, out, lse)."""
    pool = pool.copy()
    results = []
    for step in steps:
        pool[step["indices"]["new_kv_slots"]] = kvdump.quantize_e4m3(step["new_kv"], KV_SCALE)
        values = kvdump.decode_e4m3(pool).astype(np.float64)
        out, lse = attend(step, values[:, :DC] * ckv_scale, values[:, DC:] * kpe_scale)
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


# ---------------------------------------------------------------------------------------------
# Per-token scales (protocol version 2)

GROUPED_MODEL = dict(num_heads=H, kv_lora_rank=DC, qk_rope_head_dim=DR, sm_scale=SM_SCALE,
                     page_size=PAGE, num_slots=SLOTS, kv_dtype="float8_e4m3fn",
                     kv_scale_kind="per_token_group", version=2, kv_scale_group_size=128,
                     kv_scale_format="float32", kv_rope_dtype="float8_e4m3fn")
SLOT = 592


def grouped_model(**changes):
    return protocol.ModelInfo(**dict(GROUPED_MODEL, **changes))


def make_grouped_case(model, seed=23, kv_scale=KV_SCALE):
    """The initial pool (592-byte slots; garbage bytes 0x7F / 0xFF, NaN codes and NaN or huge
    scales, where no token is cached) and each step's tensors; a cached token with an all-zero
    latent group (scale 1)."""
    rng = np.random.default_rng(seed)
    pool = np.where(rng.random((SLOTS, model.slot_bytes)) < 0.5, 0x7F, 0xFF).astype(np.uint8)
    cached = bf16_values(rng, len(CACHED), D, scale=6.0)
    cached[0, 128:256] = 0
    cached[:, :128] *= 40  # groups of different ranges: the scales differ within a slot
    pool[CACHED] = grouped.encode_rows(cached, model, kv_scale)
    _, steps = make_case(seed)
    return pool, steps


def grouped_reference(pool, steps, model, kv_scale=KV_SCALE, kpe_scale=None):
    """float64 replay with the v1.1 write rule: per step (pool bytes, out, lse). Values as
    FlashInfer's kernel dequantizes them: bf16(code * scale) for the latent part,
    bf16(bf16(code) * bf16(kpe_scale)) for the RoPE part."""
    pool = pool.copy()
    kpe_scale = kv_scale if kpe_scale is None else kpe_scale
    results = []
    for step in steps:
        slots = step["indices"]["new_kv_slots"]
        pool[slots] = grouped.encode_rows(step["new_kv"], model, kv_scale)
        codes, _, rope = grouped.split_slots(pool, model)
        scales = np.repeat(grouped.scale_values(pool, model), 128, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            latent = kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(
                kvdump.decode_e4m3(codes) * scales)).astype(np.float64)
            kpe_bf16 = kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(
                np.float32(kpe_scale)))
            kpe = kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(
                kvdump.decode_e4m3(rope) * kpe_bf16)).astype(np.float64)
        out, lse = attend(step, latent, kpe)
        results.append((pool.copy(), out, lse))
    return results


def step_requests(steps, kv_scale=KV_SCALE):
    layer = protocol.LayerInfo("L000", 0, kv_scale)
    bits = kvdump.bf16_bits_from_float32
    return [protocol.StepRequest(
        index=index, group=f"S{index:03d}", kind=step["kind"], layer=layer, pool_reloaded=False,
        q_nope=bits(step["q_nope"]), q_pe=bits(step["q_pe"]), new_kv=bits(step["new_kv"]),
        **step["indices"]) for index, step in enumerate(steps)]


class FakeDtype:
    def __init__(self, name, storage):
        self.name, self.storage = name, np.dtype(storage)

    def __repr__(self):
        return f"fake_torch.{self.name}"


class FakeTensor:
    """A torch tensor's few operations the per-token path uses, over a numpy array (views stay
    views: a shape view that would need a copy raises, as torch's view() does)."""

    def __init__(self, array, dtype):
        assert array.dtype == dtype.storage, (array.dtype, dtype)
        self.array, self.dtype = array, dtype

    @property
    def shape(self):
        return tuple(self.array.shape)

    def view(self, *args):
        if len(args) == 1 and isinstance(args[0], FakeDtype):
            return FakeTensor(self.array.view(args[0].storage), args[0])
        shape = args[0] if len(args) == 1 and isinstance(args[0], tuple) else args
        view = self.array.view()
        view.shape = shape  # raises where torch's view() would
        return FakeTensor(view, self.dtype)

    def __getitem__(self, key):
        return FakeTensor(self.array[key], self.dtype)

    def contiguous(self):
        return FakeTensor(np.ascontiguousarray(self.array), self.dtype)

    def is_contiguous(self):
        return self.array.flags.c_contiguous

    def stride(self):
        return tuple(n // self.array.itemsize for n in self.array.strides)

    def data_ptr(self):
        return self.array.__array_interface__["data"][0]

    def to(self, device):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.array

    def float(self):
        assert self.dtype.name == "float32"
        return self


class FakeTorch:
    uint8 = FakeDtype("uint8", np.uint8)
    int16 = FakeDtype("int16", np.int16)
    int32 = FakeDtype("int32", np.int32)
    int64 = FakeDtype("int64", np.int64)
    float32 = FakeDtype("float32", np.float32)
    bfloat16 = FakeDtype("bfloat16", np.uint16)
    float8_e4m3fn = FakeDtype("float8_e4m3fn", np.uint8)

    @classmethod
    def from_numpy(cls, array):
        dtype = {np.dtype(np.uint8): cls.uint8, np.dtype(np.int16): cls.int16,
                 np.dtype(np.int32): cls.int32, np.dtype(np.int64): cls.int64,
                 np.dtype(np.float32): cls.float32}[array.dtype]
        return FakeTensor(array, dtype)


class FakePool:
    """pools.HostPool's interface over a numpy pool."""

    def __init__(self, array):
        self.tensor = FakeTensor(array, FakeTorch.uint8)
        self.writes = []

    def reload(self):
        pass

    def write_rows(self, slots, rows):
        assert rows.dtype is FakeTorch.uint8 and slots.dtype is FakeTorch.int64
        self.writes.append(rows.array.copy())
        self.tensor.array[slots.array] = rows.array

    def sync(self):
        pass


class NumpyMlaWrapper:
    """FakeMlaWrapper's contract (FlashInfer 0.6.18) over FakeTensors, computed in numpy."""

    def __init__(self):
        self.plans, self.runs = [], []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        assert (head_dim_ckv, head_dim_kpe) == (512, 64)
        assert kv_data_type is FakeTorch.float8_e4m3fn and q_data_type is FakeTorch.bfloat16
        self.plans.append(dict(qo=qo_indptr.array.tolist(), kv=kv_indptr.array.tolist(),
                               pages=kv_indices.array.tolist(), lens=kv_len_arr.array.tolist(),
                               page_size=page_size, causal=causal, sm_scale=sm_scale))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            return_lse_base_on_e=False, *, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
        self.runs.append(dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv_cache, kpe=kpe_cache,
                              ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr,
                              kpe_scale=kpe_scale, return_lse=return_lse,
                              return_lse_base_on_e=return_lse_base_on_e))
        for tensor in (ckv_cache, kpe_cache):
            if tensor.dtype is not FakeTorch.float8_e4m3fn:
                raise ValueError("kv dtype does not match the planned kv_data_type")
        if (ckv_scale is None) == (ckv_scale_arr is None) or kpe_scale is None:
            raise ValueError("Exactly one of ckv_scale or ckv_scale_arr is required when "
                             "kv_data_type is FP8.")
        expected = (*ckv_cache.shape[:-1], ckv_cache.shape[-1] // 128)
        if ckv_scale_arr is not None and (
                ckv_scale_arr.shape != expected or ckv_scale_arr.dtype is not FakeTorch.float32
                or not ckv_scale_arr.is_contiguous()):
            raise ValueError(f"ckv_scale_arr must be contiguous float32 {expected}")
        bf16 = kvdump.float32_from_bf16_bits
        with np.errstate(invalid="ignore", over="ignore"):
            scales = np.repeat(ckv_scale_arr.array, 128, axis=-1)
            ckv = bf16(kvdump.bf16_bits_from_float32(
                kvdump.decode_e4m3(ckv_cache.array) * scales)).astype(np.float64)
            kpe = bf16(kvdump.bf16_bits_from_float32(
                kvdump.decode_e4m3(kpe_cache.array)
                * bf16(kvdump.bf16_bits_from_float32(np.float32(kpe_scale))))).astype(np.float64)
        qn = bf16(q_nope.array.view(np.uint16)).astype(np.float64)
        qp = bf16(q_pe.array.view(np.uint16)).astype(np.float64)
        plan = self.plans[-1]
        nq, heads = qn.shape[:2]
        result, lse_out = np.zeros((nq, heads, 512)), np.zeros((nq, heads))
        qo, kv, pages, lens, page_size = (plan[k] for k in ("qo", "kv", "pages", "lens",
                                                             "page_size"))
        for b in range(len(lens)):
            qo_len, kv_len = qo[b + 1] - qo[b], lens[b]
            tokens = [(pages[kv[b] + p // page_size], p % page_size) for p in range(kv_len)]
            c = np.stack([ckv[page, off] for page, off in tokens])
            r = np.stack([kpe[page, off] for page, off in tokens])
            for q_idx in range(qo_len):
                row = qo[b] + q_idx
                s = plan["sm_scale"] * (qn[row] @ c.T + qp[row] @ r.T)
                if plan["causal"]:
                    s[:, np.arange(kv_len) + qo_len > kv_len + q_idx] = -np.inf
                top = s.max(axis=1, keepdims=True)
                row_lse = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
                result[row] = np.exp(s - row_lse[:, None]) @ np.nan_to_num(c)
                lse_out[row] = row_lse if return_lse_base_on_e else row_lse / LN2
        out_tensor = FakeTensor(kvdump.bf16_bits_from_float32(result.astype(np.float32)),
                                FakeTorch.bfloat16)
        return out_tensor, FakeTensor(lse_out.astype(np.float32), FakeTorch.float32)


class PerTokenPlumbingTests(unittest.TestCase):
    """flashinfer-fp8's per-token path, without torch, flashinfer or a GPU."""

    def adapter(self, *faults, model=None, name="flashinfer-fp8"):
        from kvdump.backends import adapter_class

        options = argparse.Namespace(device=None, write="server", fault=list(faults),
                                     flashinfer_backend="fa3", cast_scale="none")
        adapter = adapter_class(name)(options)
        adapter.torch, adapter.device = FakeTorch, "cuda"
        adapter.model = model or grouped_model()
        adapter.conventions = Conventions(tuple(faults))
        adapter.wrapper = NumpyMlaWrapper()
        return adapter

    def serve(self, *faults):
        model = grouped_model()
        pool, steps = make_grouped_case(model)
        adapter = self.adapter(*faults, model=model)
        adapter.pools["L000"] = FakePool(pool.copy())
        results = []
        for request in step_requests(steps):
            result = adapter.run_step(request)
            results.append((adapter.pools["L000"].tensor.array.copy(),
                            kvdump.float32_from_bf16_bits(result.out_bits), result.lse))
        return adapter, (pool, steps), results

    def test_run_gets_ckv_scale_arr_and_kpe_scale(self):
        adapter, (pool, steps), _ = self.serve()
        run = adapter.wrapper.runs[0]
        base = adapter.pools["L000"].tensor.data_ptr()
        pages = SLOTS // PAGE
        # ckv and kpe: float8_e4m3fn views of the pool in place, 592 bytes per token.
        self.assertIs(run["ckv"].dtype, FakeTorch.float8_e4m3fn)
        self.assertIs(run["kpe"].dtype, FakeTorch.float8_e4m3fn)
        self.assertEqual(run["ckv"].shape, (pages, PAGE, 512))
        self.assertEqual(run["kpe"].shape, (pages, PAGE, 64))
        self.assertEqual(run["ckv"].stride(), (PAGE * SLOT, SLOT, 1))
        self.assertEqual(run["kpe"].stride(), (PAGE * SLOT, SLOT, 1))
        self.assertEqual(run["ckv"].data_ptr(), base)
        self.assertEqual(run["kpe"].data_ptr(), base + 512 + 16)
        # ckv_scale_arr: a contiguous float32 copy [pages, page_size, 4] of the slots' scales.
        arr = run["ckv_scale_arr"]
        self.assertIs(arr.dtype, FakeTorch.float32)
        self.assertEqual(arr.shape, (pages, PAGE, 4))
        self.assertTrue(arr.is_contiguous())
        pool_after = pool.copy()
        pool_after[steps[0]["indices"]["new_kv_slots"]] = grouped.encode_rows(
            steps[0]["new_kv"], adapter.model, KV_SCALE)
        np.testing.assert_array_equal(arr.array.view(np.uint32),
                                      pool_after[:, 512:528].copy().view("<u4").reshape(
                                          pages, PAGE, 4))
        # kpe_scale: the layer's kv_scale, a float; no ckv_scale.
        self.assertIsNone(run["ckv_scale"])
        self.assertIsInstance(run["kpe_scale"], float)
        self.assertEqual(run["kpe_scale"], KV_SCALE)
        self.assertTrue(run["return_lse"] and run["return_lse_base_on_e"])
        self.assertEqual(run["q_nope"].dtype, FakeTorch.bfloat16)
        self.assertEqual([p["causal"] for p in adapter.wrapper.plans], [True, False])

    def test_new_rows_are_written_by_the_v1_1_rule(self):
        adapter, (pool, steps), results = self.serve()
        writes = adapter.pools["L000"].writes
        self.assertEqual(len(writes), len(steps))
        for step, written in zip(steps, writes):
            self.assertEqual(written.shape, (len(step["new_kv"]), SLOT))
            codes, rope, scales = kvdump.quantize_rows(step["new_kv"], DC, 128, "float32",
                                                       "float8_e4m3fn", kv_scale=KV_SCALE)
            np.testing.assert_array_equal(written[:, :512], codes)
            np.testing.assert_array_equal(written[:, 512:528].copy().view("<f4"), scales)
            np.testing.assert_array_equal(written[:, 528:], rope)
        expected = grouped_reference(pool, steps, adapter.model)
        for (after, out, lse), (ref_pool, ref_out, ref_lse) in zip(results, expected):
            np.testing.assert_array_equal(after, ref_pool)
            self.assertTrue(close(out, ref_out, 2.0**-8), np.abs(out - ref_out).max())
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)

    def test_the_reciprocal_convention_reaches_the_write(self):
        model = grouped_model(reciprocal_scale=True)
        adapter = self.adapter(model=model)
        pool, steps = make_grouped_case(model)
        adapter.pools["L000"] = FakePool(pool.copy())
        adapter.run_step(step_requests(steps)[0])
        np.testing.assert_array_equal(
            adapter.pools["L000"].writes[0],
            grouped.encode_rows(steps[0]["new_kv"], model, KV_SCALE, reciprocal=True))

    def test_fault_scale_latent_only_leaves_kpe_unscaled(self):
        adapter, (pool, steps), results = self.serve("scale-latent-only")
        self.assertEqual(adapter.wrapper.runs[0]["kpe_scale"], 1.0)
        expected = grouped_reference(pool, steps, adapter.model, kpe_scale=1.0)
        for (_, out, _), (_, ref_out, _) in zip(results, expected):
            self.assertTrue(close(out, ref_out, 2.0**-8))

    def test_fault_lse_base2(self):
        adapter, _, _ = self.serve("lse-base2")
        self.assertFalse(adapter.wrapper.runs[0]["return_lse_base_on_e"])

    def test_power_of_two_scales_take_the_same_path(self):
        model = grouped_model(kv_scale_format="power_of_two")
        adapter = self.adapter(model=model)
        pool, steps = make_grouped_case(model)
        adapter.pools["L000"] = FakePool(pool.copy())
        adapter.run_step(step_requests(steps)[0])
        scales = adapter.wrapper.runs[0]["ckv_scale_arr"].array
        written = steps[0]["indices"]["new_kv_slots"]
        values = scales.reshape(SLOTS, 4)[written]
        np.testing.assert_array_equal(values, np.exp2(np.round(np.log2(values))))

    def test_forms_flashinfer_cannot_read_are_refused(self):
        from kvdump.backends.flashinfer_fp8 import per_token_refusal

        self.assertIsNone(per_token_refusal(grouped_model()))
        self.assertIsNone(per_token_refusal(grouped_model(kv_scale_format="power_of_two")))
        cases = {
            "kv_rope_dtype is bfloat16": grouped_model(kv_rope_dtype="bfloat16"),
            "kv_scale_format is e8m0": grouped_model(kv_scale_format="e8m0"),
            "kv_scale_group_size is 64": grouped_model(kv_scale_group_size=64),
        }
        for text, model in cases.items():
            with self.subTest(text=text):
                with self.assertRaises(protocol.BackendError) as caught:
                    self.adapter(model=model).check_grouped(model)
                self.assertEqual(caught.exception.kind, "unsupported")
                self.assertIn(text, caught.exception.message)
                self.assertIn("flashinfer-fp8", caught.exception.message)
        rope = self.adapter().check_grouped
        with self.assertRaises(protocol.BackendError) as caught:
            rope(grouped_model(kv_rope_dtype="bfloat16", kv_scale_format="power_of_two"))
        self.assertIn("one kv_data_type", caught.exception.message)
        # The per_tensor path is untouched by the check.
        self.adapter().check_grouped(protocol.ModelInfo(**dict(
            GROUPED_MODEL, kv_scale_kind="per_tensor", version=1)))

    def test_the_cast_path_refuses_every_grouped_pool(self):
        adapter = self.adapter(name="flashinfer-cast-bf16")
        with self.assertRaises(protocol.BackendError) as caught:
            adapter.check_grouped(grouped_model())
        self.assertEqual(caught.exception.kind, "unsupported")
        self.assertIn("per_token_group", caught.exception.message)

    def test_describe_texts(self):
        adapter = self.adapter()
        self.assertIn("ckv_scale_arr", adapter.math())
        self.assertEqual(adapter.pool_summary()["slot_bytes"], SLOT)


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class PerTokenTorchPlumbingTests(unittest.TestCase):
    """The per-token path with real torch tensors (the pool file mapped by pools.HostPool) and
    FakeMlaWrapper, as kvdump.backends starts the adapter."""

    def serve(self, model_changes=None, *faults):
        from kvdump.backends import adapter_class

        cls = adapter_class("flashinfer-fp8")

        class OnCpu(cls):
            default_device = "cpu"

            def check_device(self, major, minor):
                pass

            def check_model(self, model):  # CUDA checks skipped; the widths and form are kept
                self.check_grouped(model)

        directory = tempfile.mkdtemp(prefix="kvdump-flashinfer-pt-test-")
        self.addCleanup(shutil.rmtree, directory)
        options = argparse.Namespace(device=None, write="server", fault=list(faults),
                                     flashinfer_backend="fa3", cast_scale="none")
        adapter = OnCpu(options)
        model = grouped_model(**(model_changes or {}))
        files = protocol.SessionFiles(directory)
        with mock.patch("kvdump.backends.environment.import_flashinfer", fake_flashinfer):
            describe = adapter.start(model, files)
        pool, steps = make_grouped_case(model)
        pool.tofile(os.path.join(directory, "pool.bin"))
        spec = files.spec({"file": "pool.bin", "dtype": "uint8", "shape": [SLOTS, SLOT]}, "pool")
        adapter.load_layer(protocol.LayerInfo("L000", 0, KV_SCALE), spec)
        results = []
        for request in step_requests(steps):
            result = adapter.run_step(request)
            results.append((np.fromfile(spec.path, np.uint8).reshape(SLOTS, SLOT),
                            kvdump.float32_from_bf16_bits(result.out_bits), result.lse))
        return adapter, describe, (pool, steps), results

    def test_per_token_run_matches_the_kernel_contract(self):
        adapter, describe, (pool, steps), results = self.serve()
        run = adapter.wrapper.runs[0]
        self.assertIsNone(run["ckv_scale"])
        self.assertEqual(run["kpe_scale"], KV_SCALE)
        arr = run["ckv_scale_arr"]
        self.assertEqual((arr.dtype, tuple(arr.shape)), (torch.float32, (SLOTS // PAGE, PAGE, 4)))
        self.assertTrue(arr.is_contiguous())
        tensor = adapter.pools["L000"].tensor
        self.assertEqual(run["ckv"].data_ptr(), tensor.data_ptr())
        self.assertEqual(run["kpe"].data_ptr(), tensor.data_ptr() + 528)
        self.assertEqual(tuple(run["ckv"].stride()), (PAGE * SLOT, SLOT, 1))
        self.assertIn("v1.1", describe["write_rule"])
        self.assertEqual(describe["pool"]["slot_bytes"], SLOT)
        expected = grouped_reference(pool, steps, adapter.model)
        for (after, out, lse), (ref_pool, ref_out, ref_lse) in zip(results, expected):
            np.testing.assert_array_equal(after, ref_pool)
            self.assertTrue(close(out, ref_out, 2.0**-8), np.abs(out - ref_out).max())
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)

    def test_bf16_rope_is_refused_at_hello(self):
        with self.assertRaises(protocol.BackendError) as caught:
            self.serve({"kv_rope_dtype": "bfloat16", "kv_scale_format": "power_of_two"})
        self.assertEqual(caught.exception.kind, "unsupported")
        self.assertIn("bfloat16", caught.exception.message)

    def test_round_toward_zero_is_refused_for_a_grouped_pool(self):
        with self.assertRaises(protocol.BackendError) as caught:
            self.serve(None, "round-toward-zero")
        self.assertIn("per_token_group", caught.exception.message)


if __name__ == "__main__":
    unittest.main()
