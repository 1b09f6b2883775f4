"""The `vllm-triton-mla` adapter: vLLM's Triton MLA decode kernel on the FP8 pool, in place.

Kernel: vllm/v1/attention/ops/triton_decode_attention.py of vLLM 0.34.0 (commit 62d4bc3c7, the
release wheel's file, sha256 c7915ed5...; peer_kernels.VLLM), called as vLLM's TritonMLAImpl.
forward_mqa (vllm/v1/attention/backends/mla/triton_mla.py) calls it. Line numbers below are the
kernel file's in 0.34.0.

  decode_attention_fwd(q [Nq, H, 576] bf16, k_buffer, v_buffer, o [Nq, H, 512] bf16,
                       lse [Nq, H], block_table int32 [Nq, pages], seq_lens int32 [Nq],
                       attn_logits float32 [Nq, H, S, 513], S, sm_scale, P,
                       k_scale=t, v_scale=t, is_mla=True)          (lines 781-848)
      k_buffer = pool.view(float8_e4m3fn).view(pages, P, 1, 576) (forward_mqa's unsqueeze(2)),
      v_buffer = k_buffer[..., :512]; t = float32 tensor [kv_scale]: forward_mqa passes
      layer._k_scale as both k_scale and v_scale.

What it does with FP8 (H > 1 takes the grouped path, _fwd_grouped_kernel_stage1, 287-480):
  - K: each latent and RoPE element dequantized as bf16(float32(code) * k_scale) (406, 417): one
    float32 product rounded to bf16 (exact when k_scale is a power of two). q stays bf16, not
    cast to e4m3.
  - q.K: tl.dot(q bf16 [16, 512], k bf16 [512, 32]) + tl.dot(q_pe, k_pe) (407, 418): bf16 tensor
    core products, float32 accumulation (no TF32: the operands are bf16); then qk *= sm_scale
    (419); k_scale is not folded into sm_scale.
  - V: with is_mla, v = tl.trans(k) (445): the same bf16 dequantized latent (k_scale; v_scale is
    not used on this path); P.V: tl.dot(p.to(bf16), v) (451): P rounded to bf16 (not e4m3),
    against the tile's running max (p = exp(qk - running max), natural exp, 449).
  - Splits: S = num_kv_splits, each entry's keys cut into S chunks of cdiv(L, S) (366-368);
    tiles BLOCK_N 32 keys x BLOCK_H 16 heads, BLOCK_DMODEL 512 + BLOCK_DPE 64, num_warps 4,
    num_stages 2 (504-581); a split stores acc / e_sum and e_max + log(e_sum) (natural log) in
    float32 attn_logits; stage 2 (_fwd_kernel_stage2, 591-658) merges the splits with natural
    exp in float32 and stores acc / e_sum into o (bf16: rounded on store) and e_max + log(e_sum)
    into lse, whose dtype the caller picks: forward_mqa allocates it as q.dtype, bf16.
  - S: forward_mqa's policy min(next_pow2(max(1, L_max // 512)), 2 * SMs) (triton_mla.py
    _compute_num_kv_splits), L_max the step's longest entry; --num-kv-splits N overrides it.
Expected diagnosis hypotheses: K (and V) dequantized in bf16 (bf16(code * scale)); P in bf16;
lse in bf16 (with --lse-dtype bfloat16, vLLM's own); no q or P cast to e4m3; no TF32.

A prefill step's rows run as entries with their causal extents (forward_mqa's causal multi-token
decode does the same), so prefill steps are served too.
"""

from .peer_kernels import VLLM
from . import triton_layout as layout
from .triton_mla import DC, TritonMlaAdapter

BLOCK_N, BLOCK_H = 32, 16


class VllmTritonMlaAdapter(TritonMlaAdapter):
    name = "vllm-triton-mla"
    peer = VLLM

    def option_summary(self):
        return {**super().option_summary(), "lse_dtype": self.options.lse_dtype}

    def math(self):
        return ("vLLM Triton MLA decode (grouped stage 1 + stage 2), is_mla=True: K and V = "
                "bf16(fp32(code) * k_scale), k_scale = v_scale = kv_scale as a float32 tensor; "
                "q bf16; q.K and P.V bf16 tensor-core dots, fp32 accumulation; P rounded to bf16; "
                "qk *= sm_scale; splits merged in fp32, natural log; out bf16, lse "
                f"{self.options.lse_dtype}")

    def tiles(self):
        return {"BLOCK_N": BLOCK_N, "BLOCK_H": BLOCK_H, "BLOCK_DMODEL": 512, "BLOCK_DPE": 64,
                "num_warps": 4, "num_stages": 2,
                "num_kv_splits": self.options.num_kv_splits or
                "min(next_pow2(max(1, L_max // 512)), 2 * SMs) per step",
                "split_cut": "cdiv(L, S) keys per split"}

    def splits(self, seq_len):
        if self.options.num_kv_splits:
            return self.options.num_kv_splits
        return layout.vllm_num_kv_splits(int(seq_len.max()), self.sm_count())

    def prepare_launch(self, q, pool_tensor, entries, kv_indptr, kv_indices, page_size,
                       kv_scale, sm_scale):
        torch = self.torch
        request_of_row, seq_len, _ = entries
        nq, heads = q.shape[:2]
        splits = self.splits(seq_len)
        k_buffer = pool_tensor.view(torch.float8_e4m3fn).view(-1, page_size, 1, DC + 64)
        lse_dtype = getattr(torch, self.options.lse_dtype)
        return dict(
            q=q, k_buffer=k_buffer, v_buffer=k_buffer[..., :DC],
            o=torch.empty((nq, heads, DC), dtype=torch.bfloat16, device=self.device),
            lse=torch.empty((nq, heads), dtype=lse_dtype, device=self.device),
            req_to_token=self.int_tensor(layout.vllm_block_table(request_of_row, kv_indptr,
                                                                  kv_indices), "int32"),
            b_seq_len=self.int_tensor(seq_len, "int32"),
            attn_logits=torch.empty((nq, heads, splits, DC + 1), dtype=torch.float32,
                                    device=self.device),
            num_kv_splits=splits, sm_scale=sm_scale, page_size=page_size,
            k_scale=torch.tensor([kv_scale], dtype=torch.float32, device=self.device))

    def run_prepared(self, p):
        self.kernel.decode_attention_fwd(
            p["q"], p["k_buffer"], p["v_buffer"], p["o"], p["lse"], p["req_to_token"],
            p["b_seq_len"], p["attn_logits"], p["num_kv_splits"], p["sm_scale"],
            p["page_size"], k_scale=p["k_scale"], v_scale=p["k_scale"], is_mla=True)
        return p["o"], p["lse"]

    def launch(self, q, pool_tensor, entries, kv_indptr, kv_indices, page_size, kv_scale,
               sm_scale):
        prepared = self.prepare_launch(q, pool_tensor, entries, kv_indptr, kv_indices,
                                       page_size, kv_scale, sm_scale)
        out, lse = self.run_prepared(prepared)
        return out, lse.float()
