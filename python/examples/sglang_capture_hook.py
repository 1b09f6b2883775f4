"""EXAMPLE (not run by the tests; needs torch, SGLang and a GPU): capture one layer's absorbed-MLA
attention in a running SGLang server into a kvdump v1 file with PyTorch forward hooks.

What it does. SGLang's DeepSeek-V2/V3 and GLM attention (DeepseekV2AttentionMLA) calls a
RadixAttention module, `self_attn.attn_mqa`, for the absorbed MLA path. A forward pre-hook copies
that layer's KV pool before the first captured call; a forward hook then records, per call, one
kvdump step: the page table of the batch, the queries, the new tokens' KV and the kernel's output.
Replaying the file with `kvaudit check` compares the kernel's `out` (and, with
capture_pool_after=True, the pool it left) with kvaudit's reference.

How tensors map (names as in SGLang 0.4/0.5; check them against your version):

  kvdump            SGLang
  ----------------  ----------------------------------------------------------------------------
  q_nope [Nq,H,Dc]  attn_mqa's `q` (q_nope_out = q_nope @ w_kc, already absorbed), when rope is
                    passed separately (`q_rope=` keyword); else q[..., :Dc] of the concatenated q
  q_pe   [Nq,H,Dr]  keyword `q_rope` (rope applied); else q[..., Dc:]
  new_kv [Nq,D]     cat(k_nope, k_rope) of the call: `k` [T,1,Dc] and keyword `k_rope` [T,1,Dr];
                    else the concatenated `k` [T,1,Dc+Dr]. bf16, before the pool's fp8 cast
  out    [Nq,H,Dc]  the call's return value [T, H*Dc], viewed [T, H, Dc] (before w_vc)
  lse    [Nq,H]     recorded only when the call returns (out, lse); the absorbed path does not
  kv_cache          forward_batch.token_to_kv_pool.get_key_buffer(layer_id): [size + page_size,
                    1, Dc+Dr], float8_e4m3fn (stored as uint8); reshaped [num_pages, page_size, D]
  new_kv_slots      forward_batch.out_cache_loc
  kv_indices        pages of each request: req_to_token[req_pool_indices[b], 0:seq_len:page_size]
                    // page_size  (req_to_token holds each token's slot)
  kv_indptr         cumulative page counts;  kv_last_page_len = (seq_len - 1) % page_size + 1
  qo_indptr         decode: one row per request; extend: cumulative extend_seq_lens
  kv_scale          the multiplier the kernel dequantizes with (attn_mqa.k_scale_float, or 1.0
                    where the pool is written by a plain .to(float8) cast, as
                    MLATokenToKVPool.set_kv_buffer does); pass it explicitly if unsure
  sm_scale          attn_mqa.scaling;  H = attn_mqa.tp_q_head_num;  Dc = attn_mqa.v_head_dim;
                    Dr = attn_mqa.qk_head_dim - Dc

Viewing torch tensors: kvdump accepts torch tensors directly and views torch.bfloat16 as uint16
bits and torch.float8_e4m3fn as uint8 codes (tensor.view(torch.int16) / view(torch.uint8), no
value conversion). By hand that is:
    bits  = t.detach().cpu().contiguous().view(torch.int16).numpy().view(numpy.uint16)
    codes = t.detach().cpu().contiguous().view(torch.uint8).numpy()

Caveats:
  * Run eagerly (--disable-cuda-graph, no torch.compile): hooks do not fire inside replayed graphs.
  * Every write into this layer's pool between the snapshot and the last captured step must be a
    captured call. Prefills that SGLang runs on the non-absorbed MHA path (attn_mha) write the pool
    without calling attn_mqa; start the capture after them, or use a configuration whose extend
    path is absorbed. Likewise a call with k=None (rope fused into the cache write) has no new_kv
    to record: disable that fusion while capturing.
  * Saturation: kvdump v1 (and kvaudit's replay) store an out-of-range quotient as +-448 (code
    0x7E / 0xFE). SGLang writes the pool with a plain cast to torch.float8_e4m3fn, and PyTorch's
    conversion (c10 fp8e4m3fn_from_fp32_value; the CUDA copy kernel uses it for bf16 sources) does
    not saturate: a magnitude above 464 becomes the NaN code 0x7F / 0xFF. A captured pool can thus
    hold NaN codes for outliers, and `kvaudit check` flags them as NaN codes against the satfinite
    rule. That is a true difference between the server and the format; capture the pool unchanged.
  * Tensor parallelism: each rank holds its own heads; write one file per rank (path_template
    takes {rank}).
  * Copying the pool to the host costs its size (GB for long contexts) once, and once per step
    with capture_pool_after=True.

Installing: the model lives in SGLang's scheduler (TP worker) processes, so install the hooks
there, e.g. by patching ModelRunner.load_model before the server starts (patch_model_runner below)
from a module that those processes import, such as a sitecustomize.py on PYTHONPATH.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvdump  # noqa: E402


def _argument(args, kwargs, index, name):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


class MlaLayerCapture:
    """Captures up to `max_steps` consecutive attn_mqa calls of one layer into one kvdump file."""

    def __init__(self, attn, path, *, model, producer, max_steps=8, kv_scale=None,
                 capture_pool_after=False):
        self.attn = attn
        self.path = path
        self.model = model
        self.producer = producer
        self.max_steps = max_steps
        self.kv_scale = kv_scale
        self.capture_pool_after = capture_pool_after
        self._writer = None
        self._pool_before = None
        self._steps = 0
        self._handles = []

    def install(self):
        self._handles = [
            self.attn.register_forward_pre_hook(self._before, with_kwargs=True),
            self.attn.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _pool(self, forward_batch):
        """This layer's pool as [num_pages, page_size, D] float8_e4m3fn, copied to the host."""
        kv_pool = forward_batch.token_to_kv_pool
        buffer = kv_pool.get_key_buffer(self.attn.layer_id)  # [size + page_size, 1, Dc + Dr]
        page_size = kv_pool.page_size
        return buffer.detach().to("cpu", copy=True).reshape(-1, page_size, buffer.shape[-1])

    def _before(self, module, args, kwargs):
        forward_batch = _argument(args, kwargs, 3, "forward_batch")
        if self._writer is None and self._pool_before is None:
            self._pool_before = self._pool(forward_batch)  # the pool before step 0
        return None

    def _after(self, module, args, kwargs, output):
        forward_batch = _argument(args, kwargs, 3, "forward_batch")
        if forward_batch.forward_mode.is_idle():
            return None
        attn = self.attn
        heads, dc = attn.tp_q_head_num, attn.v_head_dim
        q = _argument(args, kwargs, 0, "q")
        k = _argument(args, kwargs, 1, "k")
        q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
        if k is None or (q_rope is not None and k_rope is None):
            # Rope fused into the cache write: no new_kv to record. Stop rather than break the
            # server's forward pass; the file keeps the steps captured so far.
            print("sglang_capture_hook: attn_mqa called without k/k_rope; capture stopped",
                  file=sys.stderr)
            self.remove()
            return None
        rows = q.shape[0]
        if q_rope is not None:  # rope passed separately: q [T, H, Dc], k [T, 1, Dc]
            q_nope = q.reshape(rows, heads, dc)
            q_pe = q_rope.reshape(rows, heads, -1)
            new_kv = torch.cat([k.reshape(rows, dc), k_rope.reshape(rows, -1)], dim=-1)
        else:  # concatenated: q [T, H, Dc + Dr], k [T, 1, Dc + Dr]
            q_full = q.reshape(rows, heads, -1)
            q_nope, q_pe = q_full[..., :dc], q_full[..., dc:]
            new_kv = k.reshape(rows, -1)
        lse = None
        if isinstance(output, tuple):  # the variants that also return lse [T, H]
            output, lse = output[0], output[1].float().reshape(rows, heads)
        out = output.reshape(rows, heads, dc)

        page_size = forward_batch.token_to_kv_pool.page_size
        if self._writer is None:
            kv_scale = self.kv_scale
            if kv_scale is None:
                kv_scale = getattr(attn, "k_scale_float", None) or 1.0
            self._writer = kvdump.KvDumpWriter(
                self.path, model=self.model, producer=self.producer, num_heads=heads,
                kv_lora_rank=dc, qk_rope_head_dim=attn.qk_head_dim - dc, sm_scale=attn.scaling,
                page_size=page_size)
            self._writer.add_layer(attn.layer_id, kv_scale, self._pool_before)
            self._pool_before = None
        step = self._writer.add_step(*self._step_indices(forward_batch, page_size))
        after = self._pool(forward_batch) if self.capture_pool_after else None
        step.add_layer(attn.layer_id, q_nope, q_pe, new_kv, out=out, lse=lse,
                       kv_cache_after=after)

        self._steps += 1
        if self._steps >= self.max_steps:
            self.remove()
        return None

    @staticmethod
    def _step_indices(forward_batch, page_size):
        """kind, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, new_kv_slots of the batch."""
        seq_lens = forward_batch.seq_lens.tolist()  # tokens per request after this step's writes
        if forward_batch.forward_mode.is_decode():
            kind, rows = "decode", [1] * len(seq_lens)
        else:  # extend / prefill: the new tokens are the last extend_seq_lens of each request
            kind, rows = "prefill", forward_batch.extend_seq_lens.tolist()
        req_to_token = forward_batch.req_to_token_pool.req_to_token  # [requests, max_len] slots
        qo_indptr, kv_indptr, kv_indices, last_page_len = [0], [0], [], []
        for request, seq_len, n in zip(forward_batch.req_pool_indices.tolist(), seq_lens, rows):
            first_slots = req_to_token[request, 0:seq_len:page_size]  # first slot of each page
            kv_indices += (first_slots // page_size).tolist()
            kv_indptr.append(len(kv_indices))
            qo_indptr.append(qo_indptr[-1] + n)
            last_page_len.append((seq_len - 1) % page_size + 1 if seq_len else 0)
        new_kv_slots = forward_batch.out_cache_loc.tolist()
        return kind, qo_indptr, kv_indptr, kv_indices, last_page_len, new_kv_slots


def attach(model, layer_id, path, **options):
    """Hooks layer `layer_id` of a loaded SGLang DeepSeek/GLM model; returns the capture."""
    attn = model.model.layers[layer_id].self_attn.attn_mqa
    return MlaLayerCapture(attn, path, **options).install()


def patch_model_runner(layer_id, path_template, **options):
    """Installs the capture in every TP worker right after its model loads.

    path_template may use {rank}, e.g. "/tmp/glm5_L{layer}_rank{rank}.h5" ({layer} too).
    """
    from sglang.srt.model_executor.model_runner import ModelRunner

    load_model = ModelRunner.load_model

    def load_model_and_capture(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        path = path_template.format(rank=self.tp_rank, layer=layer_id)
        options.setdefault("model", str(self.model_config.model_path))
        options.setdefault("producer", f"sglang {self.server_args.attention_backend} "
                                       f"tp-rank {self.tp_rank} (sglang_capture_hook.py)")
        self.kvdump_capture = attach(self.model, layer_id, path, **options)
        return result

    ModelRunner.load_model = load_model_and_capture


if __name__ == "__main__":
    sys.exit("sglang_capture_hook.py is an example to import (see its docstring), not a script")
