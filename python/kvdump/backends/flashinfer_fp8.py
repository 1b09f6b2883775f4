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

Per-token scales (protocol version 2, a kvdump v1.1 per_token_group dump; FlashInfer 0.6.18's
`ckv_scale_arr`, keyword-only in run(); plan() takes no scales):

  out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True,
                         ckv_scale_arr=scales, kpe_scale=kv_scale)
      the pool is uint8 [slots, 592]: each slot [512 e4m3 codes][4 float32 scales][64 e4m3 codes]
      (grouped.py); ckv = pool.view(float8_e4m3fn).view(-1, page_size, 592)[..., :512] and
      kpe = [..., 528:592], views read in place (592 bytes per token); scales = the slots' float32
      scales copied into a contiguous float32 [pages, page_size, 4] each step (FlashInfer indexes
      it by physical slot: kv_indices[page] * page_size + offset); ckv_scale is not passed (run()
      takes exactly one of ckv_scale, ckv_scale_arr). The kernel dequantizes latent element j of
      a token as bf16(float(code) * scale[slot, j / 128]) and the RoPE part as
      bf16(code) * bf16(kpe_scale), in bf16.
  New rows are written by the v1.1 rule (kvdump.codec.quantize_rows: fp32(amax / 448) or the
  power of two at or above it per 128 channels, e4m3 RoPE with kv_scale), whatever --write says.
  Only that form exists in FlashInfer: groups of 128, float32 or power_of_two scales (e8m0 bytes
  are not float32: refused), and an e4m3 RoPE part (ckv and kpe take one kv_data_type, so a bf16
  RoPE part, FlashMLA's slot, is refused). The read faults change kv_scale, i.e. kpe_scale.

FP8 KV needs an SM90 GPU, q in bf16, head_dim_ckv 512 and head_dim_kpe 64: anything else is
refused at hello as unsupported. The first plan() of a kernel variant compiles it (about 20 s).

FlashInfer 0.7.x (read in 0.7.4: flashinfer/mla/_batch_mla/_wrapper.py, _backends/_fa_common.py,
include/flashinfer/attention/mla_hopper.cuh) keeps these calls: plan() with the flat CSR arrays and
run() with q_nope, q_pe, ckv, kpe as arguments are deprecated there (each warns once, on stderr)
but served unchanged, the LSE chosen at run() as before; the SM90 FP8 path still dequantizes each
64-token tile to bf16 in shared memory (repack_fp8_kv_to_bf16) with the same roundings, and lse is
still base 2 unless return_lse_base_on_e. So the calls are the same for 0.6 and 0.7; the version
(flashinfer.__version__) and the series it falls in are recorded in describe.
"""

import re

import numpy as np

from .paged_layout import ActiveBatch, active
from .pooled_adapter import COMMON_FAULTS, PooledAdapter
from .protocol import unsupported

READ_FAULTS = ("scale-pow2", "scale-pow2-nearest", "scale-reciprocal", "scale-twice",
               "scale-missing", "scale-latent-only")
WORKSPACE_BYTES = 128 << 20
CKV, KPE = 512, 64
SCALE_GROUP = 128  # ckv_scale_arr: one scale per 128 latent channels
PER_TOKEN_SCALE_FORMATS = ("float32", "power_of_two")  # float32 values in the slot


# FlashInfer series whose MLA wrapper contract this adapter was checked against: series -> release
CHECKED_SERIES = {(0, 6): "0.6.18", (0, 7): "0.7.4"}


def flashinfer_series(version):
    """(major, minor) of a FlashInfer version string ('0.7.4', '0.6.18+cu130', '0.7.0rc1'), or
    None when it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else None


def series_note(version):
    """What describe says about the FlashInfer version's API: which checked release it matches."""
    series = flashinfer_series(version)
    if series in CHECKED_SERIES:
        return (f"{version}: the {series[0]}.{series[1]} series, calls checked against "
                f"{CHECKED_SERIES[series]}")
    checked = ", ".join(CHECKED_SERIES.values())
    return f"{version}: not a series this adapter was checked against ({checked})"


def per_token_refusal(model):
    """Why FlashInfer's per-token path (ckv_scale_arr) cannot read this per_token_group model,
    or None when it can."""
    if model.kv_rope_dtype != "float8_e4m3fn":
        return (f"FlashInfer's MLA reads ckv and kpe with one kv_data_type, so with per-token "
                f"float8_e4m3fn latent codes the RoPE part must be float8_e4m3fn too (dequantized "
                f"with kpe_scale); this dump's kv_rope_dtype is {model.kv_rope_dtype} "
                f"(FlashMLA's slot), which FlashInfer cannot read")
    if model.kv_scale_group_size != SCALE_GROUP:
        return (f"ckv_scale_arr holds one scale per {SCALE_GROUP} latent channels; this dump's "
                f"kv_scale_group_size is {model.kv_scale_group_size}")
    if model.kv_scale_format not in PER_TOKEN_SCALE_FORMATS:
        return (f"ckv_scale_arr is float32; this dump's kv_scale_format is "
                f"{model.kv_scale_format} (one byte per scale), which FlashInfer does not read")
    return None


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
        self.check_grouped(model)

    def check_grouped(self, model):
        """A per_token_group dump: only FlashInfer's per-token form (ckv_scale_arr) is read."""
        if model.grouped and (reason := per_token_refusal(model)) is not None:
            raise unsupported(f"{self.name}: {reason}")

    def check_device(self, major, minor):
        if major != 9:
            raise unsupported(f"{self.name}: FlashInfer's FP8 MLA (fa3 and fa2 alike) needs an "
                              f"SM90 GPU; this one is SM{major}{minor}")

    def prepare(self):
        version = getattr(self.flashinfer, "__version__", "unknown")
        if flashinfer_series(version) not in CHECKED_SERIES:
            self.warn_once("version", f"flashinfer {series_note(version)}")
        torch = self.torch
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = self.flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, backend=self.options.flashinfer_backend)

    def option_summary(self):
        return {**super().option_summary(), "flashinfer_backend": self.options.flashinfer_backend,
                "flashinfer_api": series_note(getattr(self.flashinfer, "__version__", "unknown"))}

    def math(self):
        scales = ("ckv_scale_arr = the slots' float32 scales [pages, page_size, 4], kpe_scale = "
                  "kv_scale" if self.model.grouped else "ckv_scale = kpe_scale = kv_scale")
        return (f"flashinfer.mla.BatchMLAPagedAttentionWrapper backend "
                f"{self.options.flashinfer_backend}, kv_data_type float8_e4m3fn, pool read in "
                f"place, {scales}, return_lse_base_on_e")

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
        """(ckv, kpe) [pages, page_size, 512 | 64] float8_e4m3fn views of the pool, in place
        (a per_token_group pool: the codes around each slot's scales)."""
        width = self.model.slot_bytes if self.model.grouped else CKV + KPE
        start = self.model.rope_offset if self.model.grouped else CKV
        paged = pool_tensor.view(self.torch.float8_e4m3fn).view(-1, page_size, width)
        return paged[..., :CKV], paged[..., start:start + KPE]

    def scale_array(self, pool_tensor, page_size):
        """ckv_scale_arr: the slots' float32 scales, contiguous float32 [pages, page_size, 4]
        (a copy: in the slot they are 16 bytes among 592)."""
        m = self.model
        scale_bytes = pool_tensor[:, m.scales_offset:m.rope_offset].contiguous()
        return scale_bytes.view(self.torch.float32).view(-1, page_size, m.num_scale_groups)

    def run_kernel(self, q_nope, q_pe, pool_tensor, page_size, kv_scale):
        ckv, kpe = self.kv_views(pool_tensor, page_size)
        ckv_scale, kpe_scale = self.conventions.read_scales(kv_scale)
        if self.model.grouped:
            scales = {"ckv_scale_arr": self.scale_array(pool_tensor, page_size),
                      "kpe_scale": kpe_scale}
        else:
            scales = {"ckv_scale": ckv_scale, "kpe_scale": kpe_scale}
        try:
            return self.wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True,
                                    return_lse_base_on_e=not self.conventions.lse_base2,
                                    **scales)
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

