"""The `sglang-triton-mla` adapter: SGLang's Triton decode kernel (its MLA path) on the FP8 pool,
in place.

Kernel: python/sglang/kernels/ops/attention/decode_attention.py of SGLang 0.5.23 (the release
wheel's file, sha256 7a3b66ce...; peer_kernels.SGLANG; in 0.5.23 it moved there from
srt/layers/attention/triton_ops/), called as SGLang's TritonAttnBackend.forward_decode
(python/sglang/srt/layers/attention/triton_backend.py, 2470-2497) calls it for an MLA model.
Line numbers below are the kernel file's in 0.5.23.

  decode_attention_fwd(q [Nq, H, 576] bf16, k_buffer [slots, 1, 576] float8_e4m3fn,
                       v_buffer = k_buffer[..., :512], o [Nq, H, 512] bf16,
                       kv_indptr int32 [Nq + 1], kv_indices int64 (token slots),
                       attn_logits float32 [Nq, H, S_max, 512], attn_lse float32 [Nq, H, S_max],
                       num_kv_splits int32 [Nq], S_max, sm_scale, k_scale, v_scale,
                       has_mla=True, page_size=P)                    (1191-1321)
      k_scale = v_scale = kv_scale as Python floats (forward_decode: layer.k_scale_float and
      layer.v_scale_float, 1.0 when the checkpoint has none); use_pdl left False (scheduling
      only).

What it does with FP8 (grouped path, _fwd_grouped_kernel_stage1, 530-793, on CUDA):
  - k_scale folded into the softmax scale: sm_scale * k_scale is computed by the wrapper in
    Python (double) and the kernel gets it as one float32 (1282, 1305); qk *= it after the dot
    (708).
  - q.K: q is cast to the KV dtype, q_k = q.to(float8e4nv) (656-661), with no scale (bf16 q
    rounded to e4m3, saturating or not as Triton's cast does), then tl.dot(q_k e4m3, k e4m3)
    (692): an FP8 tensor-core dot, float32 accumulation. The RoPE part: tl.dot(qpe bf16,
    kpe.to(bf16)) (707): bf16 dot, q_pe not cast.
  - V: v = tl.trans(k) (734): the raw e4m3 codes; P.V: tl.dot(p.to(e4m3), v) (762): P (in
    [0, 1], against the tile's running max: p = exp(qk - running max), natural exp) rounded to
    e4m3, FP8 dot, float32 accumulation.
  - v_scale applied once, in stage 2, to the merged output: out = acc / e_sum * v_scale
    (_fwd_kernel_stage2, 935-1018, store at 1016), rounded to bf16 on store.
  - Splits: entry of length L with s = num_kv_splits[entry] splits of
    cdiv(cdiv(L, s), 32) * 32 keys (MIN_BLOCK_KV 32, 632-636); tiles BLOCK_N 32 x BLOCK_H 16,
    BLOCK_DMODEL 512 + BLOCK_DPE 64, num_warps 4, num_stages 2 (818-850). Stage 1 stores
    acc / e_sum (float32 attn_logits) and e_max + log(e_sum) (natural log, float32 attn_lse);
    stage 2 merges in float32 with natural exp.
  - lse: stage 2 writes none. The adapter fills attn_lse with -inf, and merges the per-split
    values as SGLang's own DCP path does (torch.logsumexp over the splits, triton_backend.py
    2463-2468), in float64 (triton_layout.merge_split_lse).
  - num_kv_splits: SGLang's get_num_kv_splits_triton policy (triton_layout.
    sglang_num_kv_splits) with S_max = _mla_decode_kv_splits_cap(8, SMs, L_max);
    --num-kv-splits N sets every entry to N instead.
Expected diagnosis hypotheses: q cast to e4m3 without a scale (latent part only), P rounded to
e4m3 against the tile's running max, k_scale folded into sm_scale (one float32 rounding),
v_scale on the output; no TF32; lse in float32.

A prefill step's rows run as entries with their causal extents, so prefill steps are served too.
"""

import numpy as np

from .peer_kernels import SGLANG
from . import triton_layout as layout
from .triton_mla import DC, TritonMlaAdapter

BLOCK_N, BLOCK_H = 32, 16


class SglangTritonMlaAdapter(TritonMlaAdapter):
    name = "sglang-triton-mla"
    peer = SGLANG

    def math(self):
        return ("SGLang Triton decode (grouped stage 1 + stage 2), has_mla=True: sm_scale * "
                "k_scale folded into one float32; q latent part cast to e4m3 (no scale), "
                "FP8 q.K dot; RoPE part bf16 dot; P cast to e4m3, FP8 P.V dot on raw codes; "
                "fp32 accumulation; out = merged acc / e_sum * v_scale, rounded to bf16; lse: "
                "per-split float32 natural-log values merged by the adapter (float64)")

    def tiles(self):
        return {"BLOCK_N": BLOCK_N, "BLOCK_H": BLOCK_H, "BLOCK_DMODEL": 512, "BLOCK_DPE": 64,
                "MIN_BLOCK_KV": layout.SGLANG_MIN_BLOCK_KV, "num_warps": 4, "num_stages": 2,
                "num_kv_splits": self.options.num_kv_splits or
                "SGLang get_num_kv_splits_triton per entry, max_kv_splits = "
                "_mla_decode_kv_splits_cap(8, SMs, L_max)",
                "split_cut": "cdiv(cdiv(L, S), 32) * 32 keys per split"}

    def diagnose_tiles(self):
        """P goes to e4m3 per BLOCK_N-key tile against the split's running max; a split is
        cdiv(cdiv(L, S), 32) * 32 keys, the cut kvaudit's tile replay makes. With --num-kv-splits
        every entry has S splits and the replay is the kernel's cut. Otherwise S varies per entry
        (the server's policy, sglang_num_kv_splits, up to its cap) while the replay applies one
        S to every entry: S = 1, 2, 4 and 8 are offered and the diagnosis names the closest, an
        approximation for a step whose entries got different S (--num-kv-splits makes it exact)."""
        if self.options.num_kv_splits:
            return f"{BLOCK_N}x{self.options.num_kv_splits}"
        return ",".join(f"{BLOCK_N}x{s}" for s in (1, 2, 4, 8))

    def splits(self, seq_len, heads):
        if self.options.num_kv_splits:
            n = self.options.num_kv_splits
            return np.full(seq_len.size, n, dtype=np.int32), n
        longest = int(seq_len.max())
        cap = layout.sglang_max_kv_splits(longest, self.sm_count())
        return layout.sglang_num_kv_splits(seq_len, heads, cap, self.sm_count()), cap

    def prepare_launch(self, q, pool_tensor, entries, kv_indptr, kv_indices, page_size,
                       kv_scale, sm_scale):
        torch = self.torch
        request_of_row, seq_len, slots = entries
        nq, heads = q.shape[:2]
        per_entry, max_splits = self.splits(seq_len, heads)
        indptr, indices = layout.sglang_token_indices(request_of_row, seq_len, slots)
        k_buffer = pool_tensor.view(torch.float8_e4m3fn).view(-1, 1, DC + 64)
        return dict(
            q=q, k_buffer=k_buffer, v_buffer=k_buffer[..., :DC],
            o=torch.empty((nq, heads, DC), dtype=torch.bfloat16, device=self.device),
            kv_indptr=self.int_tensor(indptr, "int32"),
            kv_indices=self.int_tensor(indices, "int64"),
            attn_logits=torch.empty((nq, heads, max_splits, DC), dtype=torch.float32,
                                    device=self.device),
            attn_lse=torch.full((nq, heads, max_splits), float("-inf"), dtype=torch.float32,
                                device=self.device),
            num_kv_splits=self.int_tensor(per_entry, "int32"), max_kv_splits=max_splits,
            sm_scale=sm_scale, k_scale=float(kv_scale), v_scale=float(kv_scale),
            page_size=page_size)

    def run_prepared(self, p):
        self.kernel.decode_attention_fwd(
            p["q"], p["k_buffer"], p["v_buffer"], p["o"], p["kv_indptr"], p["kv_indices"],
            p["attn_logits"], p["attn_lse"], p["num_kv_splits"], p["max_kv_splits"],
            p["sm_scale"], p["k_scale"], p["v_scale"], has_mla=True,
            page_size=p["page_size"])
        return p["o"], p["attn_lse"]

    def launch(self, q, pool_tensor, entries, kv_indptr, kv_indices, page_size, kv_scale,
               sm_scale):
        prepared = self.prepare_launch(q, pool_tensor, entries, kv_indptr, kv_indices,
                                       page_size, kv_scale, sm_scale)
        out, split_lse = self.run_prepared(prepared)
        lse = layout.merge_split_lse(split_lse.cpu().numpy())
        return out, self.torch.from_numpy(lse).to(self.device)
