"""The `flashinfer-fp8` adapter: FlashInfer's paged MLA kernel reading the FP8 pool in place.

flashinfer.mla.BatchMLAPagedAttentionWrapper (conventions read from FlashInfer 0.6.18's
docstrings and kernel sources, flashinfer/mla/_core.py, csrc/batch_mla_sm90_run.cu,
include/flashinfer/attention/mla_hopper.cuh):

  wrapper = BatchMLAPagedAttentionWrapper(workspace (128 MiB on the GPU), backend="fa3"|"fa2")
  wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, 512, 64, page_size,
               causal, sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
      kv_len_arr: each request's kv_len in tokens (kvdump-v1 "Semantics"); causal=True for a
      prefill step: row j of a request with n rows and kv_len T sees positions <= T - n + j (the
      kernel masks kv_idx + qo_len > kv_len + q_idx), kvdump's rule; decode steps plan non-causal.
      Requests without rows are left out of the plan (paged_layout.active).
  out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True,
                         ckv_scale=kv_scale, kpe_scale=kv_scale)
      ckv = pool.view(float8_e4m3fn).view(-1, page_size, 576)[..., :512], kpe = [..., 512:]: views
      of the one uint8 [slots, 576] pool, read in place with its strides (576 per token);
      real value = code * ckv_scale / kpe_scale; lse in natural log with return_lse_base_on_e
      (base 2 without it: the planted fault lse-base2 leaves it off, as a server that forgot it).

FP8 KV needs an SM90 GPU, q in bf16, head_dim_ckv 512 and head_dim_kpe 64: anything else is
refused at hello as unsupported. The first plan() of a kernel variant compiles it (about 20 s).
"""

import numpy as np

from .paged_layout import ActiveBatch, active
from .pooled_adapter import COMMON_FAULTS, PooledAdapter
from .protocol import unsupported

READ_FAULTS = ("scale-pow2", "scale-pow2-nearest", "scale-reciprocal", "scale-twice",
               "scale-missing", "scale-latent-only")
WORKSPACE_BYTES = 128 << 20
CKV, KPE = 512, 64


class FlashInferFp8Adapter(PooledAdapter):
    name = "flashinfer-fp8"
    available_faults = COMMON_FAULTS + READ_FAULTS
    default_device = "cuda"

    def library(self):
        return self.flashinfer

    def import_libraries(self):
        from .environment import import_flashinfer

        self.flashinfer = import_flashinfer()

    def check_model(self, model):
        if self.device.type != "cuda":
            raise unsupported(f"{self.name} runs on a CUDA GPU; --device is {self.device}")
        self.check_device(*self.torch.cuda.get_device_capability(self.device))
        if model.kv_lora_rank != CKV or model.qk_rope_head_dim != KPE:
            raise unsupported(f"{self.name}: FlashInfer's FP8 MLA takes head_dim_ckv 512 and "
                              f"head_dim_kpe 64; this dump has {model.kv_lora_rank} and "
                              f"{model.qk_rope_head_dim}")
        if model.kv_dtype != "float8_e4m3fn":
            raise unsupported(f"{self.name} reads an FP8 pool; this dump's kv_dtype is "
                              f"{model.kv_dtype}")

    def check_device(self, major, minor):
        if major != 9:
            raise unsupported(f"{self.name}: FlashInfer's FP8 MLA (fa3 and fa2 alike) needs an "
                              f"SM90 GPU; this one is SM{major}{minor}")

    def prepare(self):
        torch = self.torch
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = self.flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, backend=self.options.flashinfer_backend)

    def option_summary(self):
        return {**super().option_summary(), "flashinfer_backend": self.options.flashinfer_backend}

    def math(self):
        return (f"flashinfer.mla.BatchMLAPagedAttentionWrapper backend "
                f"{self.options.flashinfer_backend}, kv_data_type float8_e4m3fn, pool read in "
                "place, ckv_scale = kpe_scale = kv_scale, return_lse_base_on_e")

    def capabilities(self):
        return ["check", "bench"]

    def lse_fault_in_kernel(self):
        return True

    # -- the kernel ----------------------------------------------------------------------------

    def bf16(self, array_or_tensor, what):
        tensor = (self.tensor(array_or_tensor) if isinstance(array_or_tensor, np.ndarray)
                  else array_or_tensor)
        if tensor.dtype != self.torch.bfloat16:
            self.warn_once(what, f"{what} is not all bf16 values in this dump; rounding it to bf16 "
                                 "(FlashInfer's MLA takes bf16 queries)")
            tensor = tensor.to(self.torch.bfloat16)
        return tensor

    def plan(self, batch, page_size, causal, sm_scale, num_heads):
        """plan() for an ActiveBatch (requests with rows only)."""
        torch = self.torch
        try:
            self.wrapper.plan(torch.from_numpy(batch.qo_indptr), torch.from_numpy(batch.kv_indptr),
                              torch.from_numpy(batch.kv_indices), torch.from_numpy(batch.kv_len),
                              num_heads, CKV, KPE, page_size, causal, sm_scale, torch.bfloat16,
                              self.kv_data_type())
        except ValueError as error:  # FlashInfer's own refusal of a shape or type
            raise unsupported(f"flashinfer plan(): {error}") from None

    def kv_views(self, pool_tensor, page_size):
        """(ckv, kpe) [pages, page_size, 512 | 64] float8_e4m3fn views of the pool, in place."""
        paged = pool_tensor.view(self.torch.float8_e4m3fn).view(-1, page_size, CKV + KPE)
        return paged[..., :CKV], paged[..., CKV:]

    def run_kernel(self, q_nope, q_pe, pool_tensor, page_size, kv_scale):
        ckv, kpe = self.kv_views(pool_tensor, page_size)
        ckv_scale, kpe_scale = self.conventions.read_scales(kv_scale)
        try:
            return self.wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True,
                                    return_lse_base_on_e=not self.conventions.lse_base2,
                                    ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        except ValueError as error:
            raise unsupported(f"flashinfer run(): {error}") from None

    def kv_data_type(self):
        return self.torch.float8_e4m3fn

    def plan_sm_scale(self, sm_scale, kv_scale):
        """The softmax scale plan() gets (the FP8 kernel applies kv_scale itself)."""
        return sm_scale

    def attend(self, step, pool):
        torch = self.torch
        nq, heads = step.q_nope.shape[:2]
        if nq == 0:
            return (torch.zeros((0, heads, CKV), dtype=torch.bfloat16, device=self.device),
                    torch.zeros((0, heads), dtype=torch.float32, device=self.device))
        page_size = self.model.page_size
        batch = active(step.qo_indptr, step.kv_indptr, step.kv_indices, step.kv_last_page_len,
                       page_size)
        sm_scale = self.conventions.softmax_scale(self.model.sm_scale)
        self.plan(batch, page_size, step.kind == "prefill",
                  self.plan_sm_scale(sm_scale, step.layer.kv_scale), heads)
        return self.run_kernel(self.bf16(step.q_nope, "q_nope"), self.bf16(step.q_pe, "q_pe"),
                               pool.tensor, self.model.page_size, step.layer.kv_scale)

    # -- bench ---------------------------------------------------------------------------------

    def bench(self, case):
        from .bench import case_data, time_on_gpu

        data = case_data(self.torch, case, self.device)
        batch = ActiveBatch(data.qo_indptr, data.kv_indptr, data.kv_indices, data.kv_len)
        self.plan(batch, case.page_size, case.kind == "prefill",
                  self.plan_sm_scale(self.model.sm_scale, data.kv_scale), case.num_heads)

        def launch():
            return self.run_kernel(data.q_nope, data.q_pe, data.pool, case.page_size,
                                   data.kv_scale)

        return time_on_gpu(self.torch, launch, case, label=self.bench_label())

    def bench_label(self):
        return f"{self.options.flashinfer_backend} kernel only (plan excluded)"

