"""The `flashinfer-cast-bf16` adapter: SGLang's FlashInfer MLA path before its FP8 fix.

SGLang's flashinfer_mla_backend (forward_decode and the paged forward_extend) did, every layer:

    k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
    o = wrapper.run(q_nope, q_rope, k_buffer[:, :, :512].view(-1, page_size, 512),
                    k_buffer[:, :, 512:].view(-1, page_size, 64), out=o)

with the wrapper planned for a bf16 KV. `.to(q.dtype)` is an elementwise cast of the WHOLE FP8
pool to bf16 (exact: every e4m3fn value, NaN included, is a bf16 value), with no kv_scale: the
pool is read as if its codes were the values. That is right for SGLang's MLA pool, which writes
`bf16.to(float8_e4m3fn)` without a scale (kv_scale 1), and wrong for any dump whose kv_scale is not
1: kvaudit then reports the kernel as failing, and its diagnosis should name the missing scale.
This adapter does exactly that by default (`--cast-scale none`).

`--cast-scale fold` (not what SGLang did) keeps the exact cast and applies kv_scale outside the
kernel, so that the cast path's own numerics can be judged on such dumps: the scores by
sm_scale * kv_scale in plan(), and out * kv_scale afterwards (fp32 product of the kernel's bf16
out, rounded to bf16 again). lse is then the lse of the scaled scores, as it should be.

The cast allocates a new [slots, 576] bf16 tensor each step (as SGLang did each layer); the FP8
pool itself is not changed, so the pool kvaudit reads back keeps its FP8 storage. Same limits as
flashinfer-fp8 (SM90 for fa3, widths 512 / 64, an FP8 pool to cast).
"""

from .flashinfer_fp8 import CKV, KPE, FlashInferFp8Adapter
from .pooled_adapter import COMMON_FAULTS
from .protocol import unsupported


class FlashInferCastBf16Adapter(FlashInferFp8Adapter):
    name = "flashinfer-cast-bf16"
    available_faults = COMMON_FAULTS

    def check_grouped(self, model):
        if model.grouped:
            raise unsupported(f"{self.name}: SGLang's cast path reads a per_tensor FP8 pool; this "
                              "dump's pool is per_token_group (use flashinfer-fp8, whose "
                              "ckv_scale_arr reads per-token scales)")

    def check_device(self, major, minor):
        if self.options.flashinfer_backend == "fa3" and major != 9:
            raise unsupported(f"{self.name}: FlashInfer's fa3 backend needs an SM90 GPU; this one "
                              f"is SM{major}{minor} (try --flashinfer-backend fa2)")

    def option_summary(self):
        return {**super().option_summary(), "cast_scale": self.options.cast_scale}

    def math(self):
        scale = ("no kv_scale (SGLang's cast)" if self.options.cast_scale == "none"
                 else "kv_scale folded into sm_scale and out")
        return (f"whole FP8 pool cast to bf16 each step (pool.to(torch.bfloat16)), then "
                f"flashinfer.mla.BatchMLAPagedAttentionWrapper backend "
                f"{self.options.flashinfer_backend}, kv_data_type bfloat16, {scale}, "
                "return_lse_base_on_e")

    def kv_data_type(self):
        return self.torch.bfloat16

    def kv_views(self, pool_tensor, page_size):
        cast = pool_tensor.view(self.torch.float8_e4m3fn).to(self.torch.bfloat16)
        paged = cast.view(-1, page_size, CKV + KPE)
        return paged[..., :CKV], paged[..., CKV:]

    def folded(self, kv_scale):
        return self.options.cast_scale == "fold" and kv_scale != 1.0

    def plan_sm_scale(self, sm_scale, kv_scale):
        return sm_scale * kv_scale if self.folded(kv_scale) else sm_scale

    def run_kernel(self, q_nope, q_pe, pool_tensor, page_size, kv_scale):
        ckv, kpe = self.kv_views(pool_tensor, page_size)
        try:
            out, lse = self.wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True,
                                        return_lse_base_on_e=not self.conventions.lse_base2)
        except ValueError as error:
            raise unsupported(f"flashinfer run(): {error}") from None
        if self.folded(kv_scale):
            out = (out.float() * kv_scale).to(self.torch.bfloat16)
        return out, lse

    def bench_label(self):
        return (f"whole-pool cast + {self.options.flashinfer_backend} bf16 kernel "
                "(plan excluded)")
