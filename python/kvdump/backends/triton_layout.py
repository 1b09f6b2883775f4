"""The argument mapping of the Triton MLA decode kernels (vLLM's and SGLang's), in plain numpy, so
that it is testable without a GPU, torch or triton.

Both kernels launch one program per (batch entry, head block, KV split) and read a batch entry's
keys 0 .. seq_len - 1 from its own index list; they have no causal mask. kvaudit's step
(paged_layout.py) gives each request kv_len tokens and n_q rows, row j seeing positions
0 .. kv_len - n_q + j. So every query row becomes its own batch entry (Nq entries), with

    seq_len[r] = kv_len(b) - n_q(b) + j + 1          (a decode row: kv_len(b))

and its request's pages / slots, as vLLM's TritonMLAImpl.forward_mqa does for a causal
multi-token decode block (block_table.repeat_interleave, per-row seq_lens).

  vLLM   block_table int32 [Nq, max_pages]: request b's page ids, padded with 0 (never read: the
         kernel masks positions >= seq_len); page size P = the dump's page size.
  SGLang kv_indptr int32 [Nq + 1], kv_indices int64 [sum seq_len]: the slot of each position
         (page * P + offset), as SGLang's req_to_token gives them; the kernel splits a slot into
         (slot // P, slot % P) with the page stride P * 576.

Queries: both take q [Nq, H, 576] = concat(q_nope [Nq, H, 512], q_pe [Nq, H, 64]) on the last axis
(bf16). Splits: vLLM's TritonMLAImpl picks num_kv_splits = min(next_pow2(max(1, L_max // 512)),
2 * SMs); SGLang's get_num_kv_splits_triton picks per entry from the batch's longest and shortest
lengths and the SM count (sglang_num_kv_splits below). SGLang's stage 2 writes no lse: the
per-split lse_s (natural log, float32 [Nq, H, S], -inf where split s is empty) are merged as SGLang
itself does for DCP, lse = log(sum_s exp(lse_s)) (merge_split_lse, in float64).
"""

import numpy as np

from .paged_layout import requests_with_rows

VLLM_MIN_WORK_PER_SPLIT = 512  # vllm triton_mla.py _MIN_WORK_PER_SPLIT
VLLM_SPLIT_OCCUPANCY = 2  # vllm triton_mla.py _SPLIT_OCCUPANCY_MULTIPLIER
SGLANG_MIN_BLOCK_KV = 32  # sglang decode_attention.py _MIN_BLOCK_KV
SGLANG_BLOCK_H = 16  # sglang decode_attention.py _GROUPED_BLOCK_H
SGLANG_DEFAULT_MAX_KV_SPLITS = 8  # sglang server default triton_attention_num_kv_splits


def next_power_of_2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def row_entries(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size):
    """(request of each row int64 [Nq], seq_len of each row int32 [Nq], slots of each request)."""
    requests = requests_with_rows(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)
    nq = int(qo_indptr[-1])
    request_of_row = np.zeros(nq, dtype=np.int64)
    seq_len = np.zeros(nq, dtype=np.int32)
    slots = {}
    for rq in requests:
        rows = slice(rq.row_start, rq.row_start + rq.num_rows)
        request_of_row[rows] = rq.request
        seq_len[rows] = rq.kv_len - rq.num_rows + 1 + np.arange(rq.num_rows)
        slots[rq.request] = rq.slots
    return request_of_row, seq_len, slots


def vllm_block_table(request_of_row, kv_indptr, kv_indices):
    """int32 [Nq, max_pages]: row r's request's pages in position order, padded with 0."""
    pages = [kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])] for b in request_of_row]
    width = max([p.size for p in pages] + [1])
    table = np.zeros((len(pages), width), dtype=np.int32)
    for r, p in enumerate(pages):
        table[r, :p.size] = p
    return table


def sglang_token_indices(request_of_row, seq_len, slots):
    """(kv_indptr int32 [Nq + 1], kv_indices int64): row r reads slots[b][:seq_len[r]]."""
    indptr = np.concatenate([[0], np.cumsum(seq_len, dtype=np.int64)]).astype(np.int32)
    parts = [slots[int(b)][:int(n)] for b, n in zip(request_of_row, seq_len)]
    indices = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return indptr, indices


def concat_q(q_nope, q_pe):
    """q [Nq, H, Dc + Dr]: q_nope then q_pe on the last axis (bf16 bits or floats alike)."""
    if q_nope.shape[:2] != q_pe.shape[:2] or q_nope.dtype != q_pe.dtype:
        raise ValueError(f"q_nope {q_nope.shape} {q_nope.dtype} and q_pe {q_pe.shape} "
                         f"{q_pe.dtype} do not pair")
    return np.concatenate([q_nope, q_pe], axis=-1)


def vllm_num_kv_splits(max_seq_len, sm_count):
    """vLLM TritonMLAImpl's split count: a power of two, about 512 keys a split, capped."""
    ideal = next_power_of_2(max(1, int(max_seq_len) // VLLM_MIN_WORK_PER_SPLIT))
    return min(ideal, sm_count * VLLM_SPLIT_OCCUPANCY)


def sglang_max_kv_splits(max_context_len, sm_count, base=SGLANG_DEFAULT_MAX_KV_SPLITS):
    """SGLang's MLA cap (triton_backend.py _mla_decode_kv_splits_cap)."""
    if sm_count <= 0:
        return base
    ctx_cap = next_power_of_2(-(-int(max_context_len) // SGLANG_MIN_BLOCK_KV))
    return max(base, min(next_power_of_2(sm_count), ctx_cap))


def sglang_num_kv_splits(seq_len, num_heads, max_kv_splits, sm_count):
    """int32 [Nq]: the splits SGLang's get_num_kv_splits_triton gives each entry (one latent KV
    head, so head blocks of min(16, H)). An entry of length 0 gets 0 splits."""
    seq_len = np.asarray(seq_len, dtype=np.int64)
    if seq_len.size == 0:
        return np.zeros(0, dtype=np.int32)
    longest = int(seq_len.max())
    shortest = int(seq_len.min())
    if longest * 8 < shortest * 10:
        shortest = longest
    splits_1 = min(-(-longest // max(shortest, 1)), max_kv_splits)
    chunk_1 = -(-longest // splits_1)
    ext_len = np.float32(longest) / np.float32(64.0)
    log_term = max(float(np.log2(ext_len)) if ext_len > 0 else -np.inf, 1.0)
    ext_cores = int(np.float32(sm_count * log_term))
    head_blocks = -(-num_heads // min(SGLANG_BLOCK_H, num_heads))
    grid = seq_len.size * head_blocks
    splits_2 = min(-(-ext_cores // grid), max_kv_splits)
    chunk_2 = -(-longest // max(splits_2, 1))
    splits = np.maximum(-(-seq_len // chunk_1), -(-seq_len // max(chunk_2, 1)))
    return splits.astype(np.int32)


def split_bounds(seq_len, splits, min_block=1):
    """[(start, end)] of each split of one entry, as both kernels cut it: chunk = cdiv(L, S)
    (SGLang rounds the chunk up to a multiple of min_block = 32), empty splits skipped."""
    chunk = -(-int(seq_len) // int(splits))
    chunk = -(-chunk // min_block) * min_block
    bounds = []
    for s in range(int(splits)):
        start, end = s * chunk, min((s + 1) * chunk, int(seq_len))
        if end > start:
            bounds.append((start, end))
    return bounds


def merge_split_lse(split_lse):
    """float32 [...]: log(sum_s exp(lse_s)) over the last axis, -inf entries ignored (natural log
    in, natural log out; -inf where every split is empty)."""
    values = np.asarray(split_lse, dtype=np.float64)
    top = np.max(values, axis=-1, keepdims=True)
    finite_top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        total = np.log(np.sum(np.exp(values - finite_top), axis=-1))
    return (total + finite_top[..., 0]).astype(np.float32)
