"""The `flashmla-sparse` adapter: FlashMLA's sparse FP8 decode kernel (DeepSeek-V3.2 / GLM-5 DSA)
reading kvaudit's per-token-group pool in place.

FlashMLA's convention (deepseek-ai/FlashMLA, flash_mla/flash_mla_interface.py and
csrc/sm90/decode/sparse_fp8, read at 9241ae3):
  cache   [num_blocks, block_size, 1, 656] bytes per token: 512 e4m3 codes, 4 float32 scales (one
          per 128 channels), 64 bf16 RoPE values: exactly the memory form of a kvdump v1.1
          per_token_group slot with groups of 128, float32 or power-of-two scales and a bf16 RoPE
          part (protocol version 2), so the pool is handed over as it is, viewed
          [pages, page_size, 1, 656].
  q       [b, s_q, h_q, 576] bf16, h_q 64 or 128 only (no padding in the kernel).
  indices [b, s_q, topk] int32 global slot ids (block * block_size + offset), -1 skipped, topk a
          multiple of 64.
  returns out [b, s_q, h_q, 512] bf16 and lse [b, h_q, s_q] float32, natural log (+inf for a row
          with no index).
  math    each latent element dequantized in bf16 as bf16(code) * bf16(scale) (exact for
          power-of-two scales), P in bf16, bf16 tensor cores with float32 accumulation.
Each query row becomes its own batch entry (b = Nq, s_q = 1): its listed token positions
(topk_indices) become slots through its request's page table, padded with -1 to a multiple of 64;
a dense step lists every position a row sees (causal), so dense steps run too (slowly for long
contexts: the index list is the whole context).

New rows are written by the v1.1 rule (grouped.py, kvdump.codec.quantize_rows), as every adapter
writes grouped pools. The kernel comes from a FlashMLA build: the `flash_mla` package when it is
installed, else an extension module built from FlashMLA's sources holding `sparse_decode_fwd`
(--flashmla-module FILE.so). No fault of faults.py is planted here.
"""

import importlib.util
import os

import numpy as np

from .paged_layout import kv_lengths, token_slots
from .pooled_adapter import PooledAdapter
from .protocol import unsupported

SLOT_BYTES = 656
TOPK_MULTIPLE = 64
HEADS = (64, 128)
D_V = 512


def flashmla_refusal(model):
    """Why FlashMLA's sparse FP8 decode cannot read this model, or None when it can."""
    if not model.grouped:
        return ("FlashMLA's FP8 cache is per token and 128 channels (kvdump v1.1 per_token_group); "
                "this dump is per_tensor")
    if (model.kv_lora_rank, model.qk_rope_head_dim, model.kv_scale_group_size) != (512, 64, 128):
        return "FlashMLA's 656-byte slot is 512 + 64 with groups of 128"
    if model.kv_scale_format == "e8m0" or model.kv_rope_dtype != "bfloat16":
        return ("FlashMLA's slot holds float32 scales and a bf16 RoPE part; this dump has "
                f"{model.kv_scale_format} scales and a {model.kv_rope_dtype} RoPE part")
    if model.num_heads not in HEADS:
        return f"FlashMLA's sparse decode runs 64 or 128 heads; this dump has {model.num_heads}"
    return None


def padded_topk(k):
    return -(-k // TOPK_MULTIPLE) * TOPK_MULTIPLE


def row_slot_indices(step, page_size):
    """int32 [Nq, K'] slot ids each row attends to (-1 padded, K' a multiple of 64)."""
    kv_len = kv_lengths(step.kv_indptr, step.kv_last_page_len, page_size)
    rows = step.num_rows
    per_row = []
    for b in range(len(step.kv_last_page_len)):
        begin, end = int(step.qo_indptr[b]), int(step.qo_indptr[b + 1])
        if begin == end:
            continue
        slots = token_slots(step.kv_indptr, step.kv_indices, kv_len, page_size, b)
        for row in range(begin, end):
            if step.topk_indices is not None:
                positions = step.topk_indices[row]
                positions = positions[positions >= 0]
            else:
                positions = np.arange(int(kv_len[b]) - (end - row) + 1)
            per_row.append(slots[positions.astype(np.int64)])
    width = padded_topk(max((len(p) for p in per_row), default=1))
    indices = np.full((rows, width), -1, dtype=np.int32)
    for row, slots in enumerate(per_row):
        indices[row, :len(slots)] = slots
    return indices


def load_extension(path):
    # An extension's init function is named after its module: the file's name up to its first dot.
    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise unsupported(f"--flashmla-module {path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "sparse_decode_fwd"):
        raise unsupported(f"--flashmla-module {path}: has no sparse_decode_fwd")
    return module


class FlashMlaSparseAdapter(PooledAdapter):
    name = "flashmla-sparse"
    available_faults = ()
    default_device = "cuda"
    supports_sparse = True

    def import_libraries(self):
        path = getattr(self.options, "flashmla_module", None)
        if path:
            self.extension, self.package = load_extension(path), None
            return
        try:
            import flash_mla  # noqa: F401  (the installed package)
        except ImportError:
            raise unsupported("FlashMLA is not installed: pip install FlashMLA from its sources, "
                              "or give --flashmla-module FILE.so (an extension built from "
                              "them)") from None
        self.extension, self.package = None, flash_mla

    def library(self):
        return {"flashmla": getattr(self.options, "flashmla_module", None) or "flash_mla package"}

    def check_model(self, model):
        why = flashmla_refusal(model)
        if why:
            raise unsupported(why)
        if self.device.type != "cuda":
            raise unsupported("FlashMLA runs on an SM90 GPU only")

    def math(self):
        return ("FlashMLA sparse FP8 decode: latent bf16(code) * bf16(scale), RoPE bf16, "
                "P bf16, bf16 tensor cores with float32 accumulation; lse natural log")

    def attend(self, step, pool):
        torch = self.torch
        page = self.model.page_size
        indices = row_slot_indices(step, page)
        rows, heads = step.num_rows, self.model.num_heads
        q = torch.cat([self.tensor(step.q_nope), self.tensor(step.q_pe)], dim=-1)
        q = q.view(rows, 1, heads, 576).contiguous()
        cache = pool.tensor.view(-1, page, 1, SLOT_BYTES)
        index = torch.from_numpy(indices).to(self.device).view(rows, 1, -1)
        out, lse = self.sparse_decode(q, cache, index, float(self.model.sm_scale))
        return out.view(rows, heads, D_V), lse.reshape(rows, heads)

    def sparse_decode(self, q, cache, indices, sm_scale):
        if self.extension is not None:
            out, lse, _, _ = self.extension.sparse_decode_fwd(
                q, cache, indices, None, None, None, None, None, None, None, D_V, sm_scale)
        else:
            meta = self.package.get_mla_metadata()
            out, lse = self.package.flash_mla_with_kvcache(
                q, cache, None, None, D_V, meta, None, sm_scale, False, True, indices)
        # lse is [b, h_q, s_q]: to [b, s_q = 1, h_q].
        return out, lse.transpose(1, 2).contiguous()
