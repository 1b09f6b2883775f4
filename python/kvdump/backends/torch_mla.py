"""The `torch` adapter: absorbed MLA in plain PyTorch, on the CPU or a GPU. The simplest peer of
kvaudit's kernels, and the one CI runs end to end.

For each request with rows (paged_layout.py), T = its kv_len tokens, n its rows, in float32:
  kv    = decode(pool[slots]) [T, D]: codes decoded exactly, ckv part * ckv_scale, kpe part *
          kpe_scale (both kv_scale unless a planted fault says otherwise), each product rounded
          to float32
  q     = [q_nope | q_pe] [n, H, D] (bf16 values widened exactly)
  s     = sm_scale * (q . kv^T)   [n, H, T]; positions a row does not see (causal) set to -inf
  lse   = logsumexp_t(s)          natural log
  p     = exp(s - lse)
  out   = p . kv[:, :Dc]          rounded to bf16 (nearest even)
A per_token_group pool (protocol version 2, grouped.py) decodes each slot as its latent codes times
their group's scale from the slot itself (float32 scales, or e8m0 bytes 2^(code - 127)), and its
RoPE part as bf16 values or codes * kpe_scale; the read faults change kv_scale, so with such a
pool they act on an e4m3 RoPE part only.
A NaN code in a token a row sees makes that row's scores, and so its lse and out, NaN; a NaN
code a row does not see is zeroed in the values it multiplies (p is 0 there, and 0 * NaN would
be NaN), so it never reaches an output. Matmuls run in float32 (TF32 off on CUDA).

Faults only this adapter plants: read-e5m2 (the FP8 bytes decoded as e5m2), p-e4m3 (p rounded to
e4m3 before P.V).
"""

import math

from .paged_layout import requests_with_rows
from .pooled_adapter import PooledAdapter
from .protocol import unsupported


class TorchAdapter(PooledAdapter):
    name = "torch"

    def prepare(self):
        torch = self.torch
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.read_dtype = (torch.float8_e5m2 if self.conventions.has("read-e5m2")
                           else torch.float8_e4m3fn)
        if self.model.kv_dtype == "bfloat16" and self.conventions.has("read-e5m2"):
            raise unsupported("fault read-e5m2 needs an FP8 pool; this dump's kv_dtype is bfloat16")

    def math(self):
        scale = ("latent codes times their slot's group scale, RoPE part as stored (bf16) or times "
                 "kv_scale" if self.model.grouped else "codes decoded exactly times kv_scale")
        return (f"float32: {scale}; s = sm_scale * q.k (fp32 matmul); "
                "lse = logsumexp(s) (natural log); out = softmax(s).ckv rounded to bf16")

    def capabilities(self):
        return ["check", "bench"] if self.device.type == "cuda" else ["check"]

    # -- check ---------------------------------------------------------------------------------

    def attend(self, step, pool):
        requests = requests_with_rows(step.qo_indptr, step.kv_indptr, step.kv_indices,
                                      step.kv_last_page_len, self.model.page_size)
        prepared = [self.prepare_request(r) for r in requests]
        q_nope, q_pe = self.tensor(step.q_nope), self.tensor(step.q_pe)
        return self.attention(q_nope, q_pe, pool.tensor, prepared, step.layer.kv_scale)

    def prepare_request(self, request):
        """(row_start, num_rows, slots, visible) with the index tensors on the device."""
        torch = self.torch
        slots = torch.from_numpy(request.slots).to(self.device)
        visible = torch.from_numpy(request.visible()).to(self.device)
        return request.row_start, request.num_rows, slots, visible

    def decode(self, rows, dc, ckv_scale, kpe_scale):
        """float32 [T, D] values of pool rows (uint8 e4m3fn codes, or int16 bf16 bits, or uint8
        per_token_group slots)."""
        torch = self.torch
        if rows.dtype == torch.int16:
            return rows.view(torch.bfloat16).float()
        if self.model.grouped:
            return self.decode_grouped(rows, kpe_scale)
        values = rows.view(self.read_dtype).float()
        scales = torch.full((values.shape[1],), kpe_scale, dtype=torch.float32, device=self.device)
        scales[:dc] = ckv_scale
        return values * scales

    def decode_grouped(self, slots, kpe_scale):
        """float32 [T, D] of per_token_group slots [T, slot_bytes] (uint8): latent code * its
        group's scale, RoPE bf16 value or code * kpe_scale, each product rounded to float32."""
        torch, m = self.torch, self.model
        codes = slots[:, :m.kv_lora_rank].contiguous().view(self.read_dtype).float()
        raw = slots[:, m.scales_offset:m.rope_offset].contiguous()
        if m.kv_scale_format == "e8m0":
            # 2^(code - 127) from its float32 bits: code << 23, code 0 the subnormal 2^-127.
            code = raw.to(torch.int32)
            bits = torch.where(code == 0, torch.full_like(code, 0x00400000), code << 23)
            scales = bits.view(torch.float32)
            scales = torch.where(code == 0xFF, torch.full_like(scales, float("nan")), scales)
        else:
            scales = raw.view(torch.float32)  # little-endian host
        latent = codes * scales.repeat_interleave(m.kv_scale_group_size, dim=1)
        rope = slots[:, m.rope_offset:].contiguous()
        if m.kv_rope_dtype == "bfloat16":
            rope = rope.view(torch.bfloat16).float()
        else:
            rope = rope.view(self.read_dtype).float() * kpe_scale
        return torch.cat([latent, rope], dim=1)

    def attention(self, q_nope, q_pe, pool_tensor, prepared, kv_scale):
        torch = self.torch
        nq, heads, dc = q_nope.shape
        ckv_scale, kpe_scale = self.conventions.read_scales(kv_scale)
        sm_scale = self.conventions.softmax_scale(self.model.sm_scale)
        out = torch.zeros((nq, heads, dc), dtype=torch.float32, device=self.device)
        lse = torch.zeros((nq, heads), dtype=torch.float32, device=self.device)
        q = torch.cat([q_nope.float(), q_pe.float()], dim=-1)
        for row_start, num_rows, slots, visible in prepared:
            kv = self.decode(pool_tensor[slots], dc, ckv_scale, kpe_scale)  # [T, D]
            rows = slice(row_start, row_start + num_rows)
            scores = torch.einsum("nhd,td->nht", q[rows], kv) * sm_scale
            scores = scores.masked_fill(~visible[:, None, :], -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)
            p = torch.exp(scores - row_lse[..., None])
            if self.conventions.has("p-e4m3"):
                p = p.to(torch.float8_e4m3fn).float()
            values = kv[:, :dc]
            values = torch.where(torch.isnan(values), torch.zeros_like(values), values)
            out[rows] = torch.einsum("nht,td->nhd", p, values)
            lse[rows] = row_lse
        return out.to(torch.bfloat16), lse

    # -- bench ---------------------------------------------------------------------------------

    def bench(self, case):
        if self.device.type != "cuda":
            raise unsupported("the torch adapter times kernels on a GPU only (--device cuda)")
        from .bench import case_data, time_on_gpu

        data = case_data(self.torch, case, self.device)
        prepared = [self.prepare_request(r) for r in data.requests]

        def launch():
            return self.attention(data.q_nope, data.q_pe, data.pool, prepared, data.kv_scale)

        return time_on_gpu(self.torch, launch, case, graph=True)
