"""kvdump.sglang_capture on SGLang's own classes, where an SGLang release and torch import on this
machine (skipped otherwise, as in CI, which installs neither).

The pool (MLATokenToKVPool, float8_e4m3fn, on the CPU), ReqToTokenPool, ForwardBatch,
ForwardMode, RadixAttention, the forward context (0.5.18 on) and get_parallel() are SGLang's; the
attention backend and the layer are stand-ins with the real class names, because FlashInfer and
the Triton write kernel need a GPU: the backend writes through the pool's CPU door,
set_kv_buffer(layer, loc, cat(k, k_rope), None), which is SGLang's own plain `.to(float8)` cast,
and runs exact attention in float64 as the planned wrapper. Two decode steps are captured; the
dump must hold the pool's codes before them, the written rows, slots and lse (base 2 converted),
and pass `kvaudit check --backend none` where a kvaudit binary is found.

Run with an SGLang wheel's contents on PYTHONPATH, e.g.
  PYTHONPATH=/path/to/sglang-0.5.23 python -m unittest python/tests/test_sglang_capture_real.py
"""

import contextlib
import importlib
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TESTS_DIR, ".."))

from kvdump import sglang_capture as capture  # noqa: E402

H, DC, DR = 2, 16, 8


def sglang_modules():
    """(torch, memory_pool, forward_batch_info, radix_attention, forward_context or None), or
    the reason they do not import."""
    try:
        import torch

        names = ("sglang.srt.mem_cache.memory_pool", "sglang.srt.model_executor.forward_batch_info",
                 "sglang.srt.layers.radix_attention")
        modules = [importlib.import_module(name) for name in names]
    except Exception as error:  # no SGLang, no torch, or a dependency of theirs
        return f"SGLang does not import here: {type(error).__name__}: {error}"
    context = capture._optional_module("sglang.srt.model_executor.forward_context")
    return (torch, *modules, context)


def make_wrapper(torch):
    class Wrapper:  # BatchMLAPagedAttentionWrapper's plan()/run() on the CPU, float64
        def plan(self, qo_indptr, kv_indptr, kv_indices, sm_scale):
            self._qo, self._kvp, self._kvi = qo_indptr, kv_indptr, kv_indices
            self._page_size, self._causal, self._sm_scale = 1, False, sm_scale

        def run(self, q_nope, q_pe, ckv, kpe, out=None, lse=None, return_lse=False):
            q = torch.cat([q_nope, q_pe], -1).double()
            kv = torch.cat([ckv, kpe], -1)[:, 0].double()
            result = torch.zeros(q.shape[0], H, DC, dtype=torch.float64)
            lse2 = torch.zeros(q.shape[0], H, dtype=torch.float64)
            for b in range(len(self._qo) - 1):
                tokens = kv[self._kvi[self._kvp[b]:self._kvp[b + 1]]]
                for i in range(self._qo[b], self._qo[b + 1]):
                    s = self._sm_scale * tokens @ q[i].T
                    result[i] = torch.softmax(s, 0).T @ tokens[:, :DC]
                    lse2[i] = torch.logsumexp(s, 0) / math.log(2.0)
            result = result.to(torch.bfloat16)
            return (result, lse2.float()) if return_lse else result

    return Wrapper


class RealClasses(unittest.TestCase):
    def setUp(self):
        found = sglang_modules()
        if isinstance(found, str):
            self.skipTest(found)
        self.torch, self.mp, self.fbi, self.ra, self.context = found
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def parallel(self):
        """get_parallel() with the values an unpublished process lacks (0.5.18 on), if any."""
        runtime = capture._optional_module("sglang.srt.runtime_context")
        if runtime is None or not hasattr(runtime, "get_parallel"):
            return contextlib.nullcontext()
        for values in (dict(dcp_enabled=False, attn_dcp_size=1, tp_rank=2), dict(tp_rank=2)):
            try:
                override = runtime.get_parallel().override(**values)
                override.__enter__()
                override.__exit__(None, None, None)
                return runtime.get_parallel().override(**values)
            except Exception:  # a field this release does not have
                continue
        return contextlib.nullcontext()

    def make_server(self):
        """SGLang's pools with three cached tokens (slots 5-7 of request 0, value 1.0), a stand-in
        FlashInferMLAAttnBackend writing through the pool and a DeepseekV2AttentionMLA stand-in
        around SGLang's RadixAttention."""
        torch, mp, ra = self.torch, self.mp, self.ra
        pool = mp.MLATokenToKVPool(64, 1, torch.float8_e4m3fn, DC, DR, 1, "cpu", False)
        requests = mp.ReqToTokenPool(4, 32, "cpu", False)
        pool.kv_buffer[0].view(torch.uint8)[5:8] = 0x38
        requests.req_to_token[0, :3] = torch.tensor([5, 6, 7])
        Wrapper = make_wrapper(torch)

        class FlashInferMLAAttnBackend:
            def __init__(self):
                self.token_to_kv_pool, self.req_to_token_pool = pool, requests
                self.decode_wrapper = Wrapper()

            def forward(self, q, k, v, layer, batch, save_kv_cache=True, q_rope=None,
                        k_rope=None):
                loc = batch.out_cache_loc
                loc = mp.KVWriteLoc(loc) if hasattr(mp, "KVWriteLoc") else loc
                pool.set_kv_buffer(layer, loc, torch.cat([k, k_rope], -1), None)
                k_buf = pool.get_key_buffer(layer.layer_id).to(q.dtype)
                out = self.decode_wrapper.run(q.view(-1, H, DC), q_rope.view(-1, H, DR),
                                              k_buf[:, :, :DC], k_buf[:, :, DC:], out=q)
                return out.reshape(-1, H * DC)

        class DeepseekV2AttentionMLA(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.attn_mqa = ra.RadixAttention(H, DC + DR, 0.25, num_kv_heads=1, layer_id=0,
                                                  v_head_dim=DC)
                self.attn_mha = ra.RadixAttention(H, 12 + DR, 0.25, num_kv_heads=H, layer_id=0,
                                                  v_head_dim=10)
                self.qk_nope_head_dim = 12

            def forward(self, positions, hidden_states, forward_batch, zero_allocator=None):
                x = hidden_states
                return self.attn_mqa(x["q"], x["k"], x["k"], forward_batch, q_rope=x["q_pe"],
                                     k_rope=x["k_pe"])

        return pool, requests, FlashInferMLAAttnBackend(), DeepseekV2AttentionMLA()

    def decode(self, pool, requests, backend, layer, length, slot):
        """One decode step of request 0 to `length` tokens, its new token in `slot`."""
        torch, fbi = self.torch, self.fbi
        requests.req_to_token[0, length - 1] = slot
        batch = fbi.ForwardBatch(forward_mode=fbi.ForwardMode.DECODE, batch_size=1,
                                 input_ids=torch.zeros(1, dtype=torch.long),
                                 req_pool_indices=torch.tensor([0]),
                                 seq_lens=torch.tensor([length]),
                                 out_cache_loc=torch.tensor([slot]), seq_lens_sum=length)
        if self.context is None:  # <= 0.5.12: the pools travel on the ForwardBatch
            batch.token_to_kv_pool, batch.req_to_token_pool = pool, requests
            batch.attn_backend = backend
            forward = contextlib.nullcontext()
        else:
            forward = self.context.forward_context(self.context.ForwardContext(
                attn_backend=backend))
        backend.decode_wrapper.plan([0, 1], [0, length], requests.req_to_token[0, :length].long(),
                                    0.25)
        inputs = dict(q=torch.randn(1, H, DC).bfloat16(), k=torch.randn(1, 1, DC).bfloat16(),
                      q_pe=torch.randn(1, H, DR).bfloat16(), k_pe=torch.randn(1, 1, DR).bfloat16())
        with self.parallel(), forward:
            layer(None, inputs, batch)
        return inputs

    def test_two_decode_steps_on_sglang_classes(self):
        pool, requests, backend, layer = self.make_server()
        api = capture.SglangApi.detect()
        self.assertIn(api.version, capture.CHECKED_VERSIONS)
        path = os.path.join(self.tmp.name, "real.h5")
        cap = capture.MlaCapture({0: layer}, path, model="m", producer="real classes", api=api,
                                 max_steps=2).install()
        written = [self.decode(pool, requests, backend, layer, length, slot)
                   for length, slot in ((4, 8), (5, 9))]
        self.assertEqual((cap.state, cap.steps_written), ("finished", 2), cap.stop_reason)
        self.check_dump(path, written)

    def check_dump(self, path, written):
        import h5py

        torch = self.torch
        with h5py.File(path, "r") as f:
            before = f["layers/L000/kv_cache"][()]
            self.assertEqual(f["layers/L000"].attrs["kv_scale"], 1.0)
            self.assertTrue(np.all(before[5:8] == 0x38) and np.all(before[8:10] == 0))
            for index, inputs in enumerate(written):
                step = f[f"steps/S{index:03d}"]
                new_kv = torch.cat([inputs["k"], inputs["k_pe"]], -1).reshape(1, -1)
                np.testing.assert_array_equal(step["L000/new_kv"][()],
                                              new_kv.view(torch.int16).numpy().view(np.uint16))
                np.testing.assert_array_equal(step["new_kv_slots"][()], [8 + index])
                np.testing.assert_array_equal(step["kv_indices"][()], [5, 6, 7, 8, 9][:4 + index])
                self.assertEqual(step["L000/lse"].shape, (1, H))
        binary = os.environ.get("KVAUDIT_BINARY") or os.path.join(TESTS_DIR, "..", "..", "build",
                                                                  "kvaudit")
        if os.access(binary, os.X_OK):
            run = subprocess.run([binary, "check", path, "--backend", "none"],
                                 capture_output=True, text=True)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)

if __name__ == "__main__":
    unittest.main()
