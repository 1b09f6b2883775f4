"""The `flashmla-dense-fp8` adapter: FlashMLA's dense FP8 decode kernel (`fwd_kvcache_mla_fp8`,
FlashMLA PR 54 by @endurehero, kept in vllm-project/FlashMLA under csrc/extension/sm90/dense_fp8/
and used by vLLM's FLASHMLA backend and SGLang's flashmla backend with an FP8 KV cache).

The kernel (vllm-project/FlashMLA 46d64a8e, csrc/extension/sm90/dense_fp8/pybind.cpp and
flash_fwd_mla_kernel.h; read, not trusted from the brief):
  q        [B, s_q, H, 576] float8_e4m3fn (pybind.cpp:33 requires q in e4m3, :63 576), any H:
           a request's s_q * H query rows are cut into m-blocks of 64 (pybind.cpp:88-92)
  kcache   [blocks, 64, 1, 576] float8_e4m3fn: the 512 latent + 64 RoPE codes of a token, all
           FP8, no per-token scale (pybind.cpp:70 page_block_size must be 64, :95 the shape)
  seqlens  int32 [B], block_table int32 [B, max_pages]: page ids of 64 slots each
  descale_q, descale_k  float32 [1] each, required (pybind.cpp:74-84)
  returns  out [B, s_q, H, 512] bf16 and lse [B, H, s_q] float32, natural log
The math (flash_fwd_mla_kernel.h, softmax.h), per row of q codes qc and token codes kc:
  s      = (qc . kc) in e4m3 x e4m3 tensor cores with float32 accumulation, over 576 channels
  scale  = sm_scale * descale_q * descale_k, folded into the softmax (kernel.h:568-573)
  p      = exp2(s * scale * log2e - m * scale * log2e), m the running max up to this 64-token
           tile (softmax.h:112-119); the row sum takes p in float32; P is cast to e4m3 for the
           P.V product (kernel.h:385, kernel.h = flash_fwd_mla_kernel.h: convert_type_out to
           Element = e4m3) against the same running max: tiles of kBlockN = 64 tokens = one
           page (kernel.h:707)
  o      = sum(P_e4m3 . V codes) * descale_k / sum(p) (softmax.h:190-196, descale_v = descale_k)
  lse    = m * scale + log(sum(p)) (softmax.h:193), natural log; +inf for a row without tokens
  split-KV: get_mla_decoding_metadata_dense_fp8 cuts the batch's 64-token blocks over
           num_sm_parts = SMs / ceil(s_q * H / 64) parts (pybind.cpp:206-210, metadata.cu), each
           part's partial o (float32) and lse merged in float32 by the combine kernel
           (kernel.h:593-676)

How the deployed callers feed it (read in their sources, see docs/kernels.md):
  vllm    vllm/v1/attention/backends/mla/flashmla.py FlashMLAImpl._forward_decode:
          descale_q = layer._q_scale, descale_k = layer._k_scale, causal=True, softmax_scale =
          the model's scale; q made by _DecodeConcatQuantFP8 (mla_attention.py), i.e. QuantFP8
          static per-tensor: e4m3(clamp(fp32(q) * fp32(1 / q_scale), -448, 448)) of
          cat(ql_nope, q_pe); q_scale is 1.0 unless the checkpoint carries one
          (vLLM sets _q_scale = 1.0 by default). --q-scale sets it here.
  sglang  sglang/srt/layers/attention/flashmla_backend.py: q.to(float8_e4m3fn) (PyTorch's
          cast: no scale, no clamp, |q| >= 480 becomes NaN) and descale_q = descale_k = 1: the
          pool's kv_scale is not applied (right only for kv_scale = 1).
The pool: kvaudit's per_tensor FP8 pool (uint8 [slots, 576]) is the kernel's cache byte for
byte. A dump with 64-token pages is read in place; any other page size is re-paged each step:
every request's visible slots are copied (bytes unchanged) into 64-token pages of a scratch
cache, so the kernel reads the same codes. A step's requests are grouped by rows per request
(the kernel takes [B, s_q, ...]); a decode step has one row each; a prefill step runs through
the same causal multi-row path vLLM uses for uniform short prefills and speculative decoding
(--prefill refuse answers it `unsupported` instead).
"""

import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .. import codec
from .paged_layout import requests_with_rows
from .pooled_adapter import PooledAdapter
from .protocol import unsupported

PAGE = 64  # page_block_size the kernel takes (pybind.cpp: TORCH_CHECK(page_block_size == 64))
TILE_TOKENS = 64  # kBlockN: the tokens over which P is rounded to e4m3 against one running max
CKV, KPE = 512, 64
SLOT_BYTES = CKV + KPE
E4M3_MAX = np.float32(448.0)
TORCH_E4M3_NAN_FROM = np.float32(480.0)  # PyTorch's float -> e4m3fn cast gives NaN at |x| >= 480
CALLERS = ("vllm", "sglang")
UPSTREAM_REPOSITORY = "vllm-project/FlashMLA"
UPSTREAM_COMMIT = "46d64a8ebef03fa50b4ae74937276a5c940e3f95"
UPSTREAM = (f"{UPSTREAM_REPOSITORY} {UPSTREAM_COMMIT}, csrc/extension/sm90/dense_fp8 "
            f"(FlashMLA PR 54)")


def dense_refusal(model):
    """Why the dense FP8 kernel cannot read this model, or None."""
    if model.grouped:
        return ("FlashMLA's dense FP8 kernel reads an all-FP8 576-byte slot with one per-tensor "
                "scale; this dump is per_token_group (flashmla-sparse reads those)")
    if model.kv_dtype != "float8_e4m3fn":
        return (f"FlashMLA's dense FP8 kernel reads an FP8 pool; this dump's kv_dtype is "
                f"{model.kv_dtype}")
    if (model.kv_lora_rank, model.qk_rope_head_dim) != (CKV, KPE):
        return (f"FlashMLA's dense FP8 kernel takes head_size 576 = 512 + 64 (pybind.cpp); this "
                f"dump has {model.kv_lora_rank} + {model.qk_rope_head_dim}")
    return None


# -- the query, as each deployed caller quantizes it ---------------------------------------------


def quantize_q(q_float32, q_scale):
    """vLLM's QuantFP8 (static, per tensor): e4m3 codes of clamp(fp32(q) * fp32(1 / q_scale),
    -448, 448), rounded to nearest even. q_float32: float32 [..., 576]. Returns uint8 codes."""
    reciprocal = np.float32(1.0) / np.float32(q_scale)
    scaled = np.asarray(q_float32, dtype=np.float32) * reciprocal
    return codec.encode_e4m3(np.clip(scaled, -E4M3_MAX, E4M3_MAX))


def cast_q(q_float32):
    """SGLang's q.to(torch.float8_e4m3fn): round to nearest even, no scale; PyTorch's cast gives
    NaN (0x7F, with the sign) at |q| >= 480 and 448 between 448 and 480."""
    q = np.asarray(q_float32, dtype=np.float32)
    codes = codec.encode_e4m3(q)
    nan = np.abs(q) >= TORCH_E4M3_NAN_FROM
    return np.where(nan, codes | np.uint8(codec.E4M3_NAN_CODE), codes).astype(np.uint8)


@dataclass(frozen=True)
class CallerRule:
    """What a deployed caller hands the kernel besides the pool: q's codes and the descales."""

    caller: str
    q_scale: float

    def q_codes(self, q_float32):
        if self.caller == "sglang":
            return cast_q(q_float32)
        return quantize_q(q_float32, self.q_scale)

    def descales(self, kv_scale):
        """(descale_q, descale_k) as float32."""
        if self.caller == "sglang":
            return np.float32(1.0), np.float32(1.0)
        return np.float32(self.q_scale), np.float32(kv_scale)

    def describe(self):
        if self.caller == "sglang":
            return ("SGLang flashmla_backend: q.to(float8_e4m3fn) (no scale; NaN at |q| >= 480), "
                    "descale_q = descale_k = 1 (kv_scale not applied)")
        return (f"vLLM FlashMLAImpl: q = e4m3(clamp(fp32(q) * fp32(1 / q_scale), +-448)) with "
                f"q_scale = {self.q_scale!r} (QuantFP8 static per tensor), descale_q = q_scale, "
                f"descale_k = kv_scale")


# -- the step, as kernel launches -----------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One kernel launch: requests of a step with the same number of rows s_q.

    rows         int64 [B, s_q]: the step's row index of each q row, by request
    seqlens      int32 [B]: each request's kv_len
    block_table  int32 [B, max_pages]: pages of 64 slots (0 where a request has fewer pages)
    gather       int64 [pages * 64] or None: for a re-paged pool, the pool slot each scratch slot
                 copies (-1: a page's tail, left zero); None when the pool is read in place
    """

    rows: np.ndarray
    seqlens: np.ndarray
    block_table: np.ndarray
    gather: np.ndarray = None

    @property
    def rows_per_request(self):
        return int(self.rows.shape[1])


def pages_of(count):
    return -(-count // PAGE)


def block_table_in_place(requests, kv_indptr, kv_indices):
    """The kernel's block table of requests when the pool already has 64-token pages."""
    pages = [kv_indices[int(kv_indptr[r.request]):int(kv_indptr[r.request + 1])] for r in requests]
    table = np.zeros((len(requests), max(max(p.size for p in pages), 1)), dtype=np.int32)
    for i, p in enumerate(pages):
        table[i, :p.size] = p
    return table


def repaged(requests):
    """(block_table, gather) of a scratch cache holding each request's tokens in fresh 64-token
    pages, in request order: request i's tokens fill pages first_page(i) .. in position order."""
    counts = [pages_of(r.kv_len) for r in requests]
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    table = np.zeros((len(requests), max(max(counts), 1)), dtype=np.int32)
    gather = np.full(int(first[-1]) * PAGE, -1, dtype=np.int64)
    for i, r in enumerate(requests):
        table[i, :counts[i]] = np.arange(first[i], first[i] + counts[i])
        gather[first[i] * PAGE:first[i] * PAGE + r.kv_len] = r.slots
    return table, gather


def launches(step, page_size):
    """The kernel launches of a step: its requests with rows, grouped by rows per request (in
    order of first appearance), each group with its block table (in place for 64-token pages,
    re-paged otherwise)."""
    requests = requests_with_rows(step.qo_indptr, step.kv_indptr, step.kv_indices,
                                  step.kv_last_page_len, page_size)
    groups = {}
    for r in requests:
        groups.setdefault(r.num_rows, []).append(r)
    result = []
    for rows_each, group in groups.items():
        rows = np.array([np.arange(r.row_start, r.row_start + rows_each) for r in group],
                        dtype=np.int64)
        seqlens = np.array([r.kv_len for r in group], dtype=np.int32)
        if page_size == PAGE:
            table, gather = block_table_in_place(group, step.kv_indptr, step.kv_indices), None
        else:
            table, gather = repaged(group)
        result.append(Launch(rows=rows, seqlens=seqlens, block_table=table, gather=gather))
    return result


def load_extension(path):
    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise unsupported(f"--flashmla-module {path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for entry in ("fwd_kvcache_mla_fp8", "get_mla_decoding_metadata_dense_fp8"):
        if not hasattr(module, entry):
            raise unsupported(f"--flashmla-module {path}: has no {entry}")
    return module


class FlashMlaDenseFp8Adapter(PooledAdapter):
    name = "flashmla-dense-fp8"
    available_faults = ()
    default_device = "cuda"

    def import_libraries(self):
        path = getattr(self.options, "flashmla_module", None)
        if not path:
            raise unsupported("flashmla-dense-fp8 needs --flashmla-module FILE.so, an extension "
                              "built from vllm-project/FlashMLA's csrc/extension/sm90/dense_fp8 "
                              "(scripts/flashmla/build_dense_fp8.sh)")
        self.extension = load_extension(path)
        self.rule = CallerRule(self.options.flashmla_caller, float(self.options.q_scale))

    def describe(self):
        """The common describe plus the kernel's provenance and the caller's rule."""
        tiles = {"block_m_rows": 64, "block_n_tokens": TILE_TOKENS, "page_tokens": PAGE,
                 "p_rounding": f"e4m3 per {TILE_TOKENS}-token tile against the running max"}
        # P is rounded per 64-token block against the running max of the split that holds it;
        # FlashMLA's scheduler cuts splits by SM load, not by a per-entry count, so the replay
        # is offered the tile with one split (exact for an entry the scheduler does not split).
        return {**super().describe(), "tiles": tiles, "diagnose_tiles": f"{TILE_TOKENS}",
                "kernel": {
            "package": UPSTREAM_REPOSITORY, "upstream_commit": UPSTREAM_COMMIT,
            "module": self.options.flashmla_module, "upstream": UPSTREAM,
            "entry_point": "fwd_kvcache_mla_fp8 (get_mla_decoding_metadata_dense_fp8 for the "
                           "split-KV schedule)",
            "caller": self.rule.describe(), "tile_tokens": TILE_TOKENS, "page_tokens": PAGE,
            "pool": "in place" if self.model.page_size == PAGE else
                    f"re-paged from page_size {self.model.page_size} each step"}}

    def check_model(self, model):
        why = dense_refusal(model)
        if why:
            raise unsupported(f"{self.name}: {why}")
        if self.device.type != "cuda":
            raise unsupported(f"{self.name}: FlashMLA's dense FP8 kernel runs on an SM90 GPU; "
                              f"--device is {self.device}")
        major, minor = self.torch.cuda.get_device_capability(self.device)
        if (major, minor) != (9, 0):
            raise unsupported(f"{self.name}: the kernel checks for SM90 exactly "
                              f"(pybind.cpp); this GPU is SM{major}{minor}")

    def option_summary(self):
        return {**super().option_summary(), "caller": self.options.flashmla_caller,
                "q_scale": float(self.options.q_scale), "prefill": self.options.prefill}

    def math(self):
        pool = ("pool read in place (64-token pages)" if self.model.page_size == PAGE else
                f"pool re-paged from {self.model.page_size}-token pages into 64-token pages "
                f"each step (codes copied unchanged)")
        return (f"FlashMLA dense FP8 ({UPSTREAM}): q and P in e4m3, e4m3 tensor cores with "
                f"float32 accumulation; sm_scale * descale_q * descale_k folded into the "
                f"softmax; P rounded to e4m3 per {TILE_TOKENS}-token tile against the running "
                f"max, row sum of unrounded float32 p; o scaled by descale_k / sum at the end; "
                f"split-KV over SM parts merged in float32; lse natural log. Caller: "
                f"{self.rule.describe()}. {pool}")

    # -- the kernel ----------------------------------------------------------------------------

    def q_float32(self, array):
        """float32 of q_nope or q_pe (bf16 bits widen exactly)."""
        if array.dtype == np.uint16:
            return codec.float32_from_bf16_bits(array)
        return np.asarray(array, dtype=np.float32)

    def attend(self, step, pool):
        torch = self.torch
        heads = self.model.num_heads
        out = torch.zeros((step.num_rows, heads, CKV), dtype=torch.bfloat16, device=self.device)
        lse = torch.zeros((step.num_rows, heads), dtype=torch.float32, device=self.device)
        if step.num_rows == 0:
            return out, lse
        if step.kind == "prefill" and self.options.prefill == "refuse":
            raise unsupported(f"{self.name}: step {step.where} is a prefill step; --prefill "
                              f"refuse (vLLM sends prefills through its prefill path, not this "
                              f"decode kernel)")
        q = np.concatenate([self.q_float32(step.q_nope), self.q_float32(step.q_pe)], axis=-1)
        codes = self.rule.q_codes(q)  # uint8 [Nq, H, 576]
        descale_q, descale_k = self.rule.descales(step.layer.kv_scale)
        for launch in launches(step, self.model.page_size):
            o, l = self.launch(launch, codes, pool, float(descale_q), float(descale_k))
            index = torch.from_numpy(launch.rows.reshape(-1)).to(self.device)
            out[index] = o.reshape(-1, heads, CKV)
            lse[index] = l.transpose(1, 2).reshape(-1, heads)
        return out, lse

    def launch(self, launch, codes, pool, descale_q, descale_k):
        torch = self.torch
        q = torch.from_numpy(np.ascontiguousarray(codes[launch.rows])).to(self.device)
        q = q.view(torch.float8_e4m3fn)  # [B, s_q, H, 576]
        cache = self.kernel_cache(pool.tensor, launch.gather)
        seqlens = torch.from_numpy(launch.seqlens).to(self.device)
        table = torch.from_numpy(launch.block_table).to(self.device)
        heads = self.model.num_heads
        tiles, splits = self.extension.get_mla_decoding_metadata_dense_fp8(
            seqlens, launch.rows_per_request * heads, 1)
        scale = lambda v: torch.tensor([v], dtype=torch.float32, device=self.device)  # noqa: E731
        out, lse = self.extension.fwd_kvcache_mla_fp8(
            q, cache, CKV, seqlens, table, float(self.model.sm_scale), True, tiles, splits,
            scale(descale_q), scale(descale_k))
        return out, lse

    # -- bench ---------------------------------------------------------------------------------

    def capabilities(self):
        return ["check", "bench"] if self.device.type == "cuda" else ["check"]

    def bench_launch(self, case, data, q_float32):
        """(q codes uint8 [B, s_q, H, 576], Launch) of a bench case: its pool has 64-token pages
        (the kernel's; other page sizes are refused rather than re-paged, which would time a
        copy), every request q_len rows; q as the caller rule feeds it."""
        if case.page_size != PAGE:
            raise unsupported(f"{self.name}: bench needs page_size {PAGE} (the kernel's page); "
                              f"the case has {case.page_size}")
        step = SimpleNamespace(qo_indptr=data.qo_indptr, kv_indptr=data.kv_indptr,
                               kv_indices=data.kv_indices, kv_last_page_len=data.kv_last_page_len)
        (launch,) = launches(step, PAGE)  # every request has q_len rows: one group
        return self.rule.q_codes(q_float32)[launch.rows], launch

    def bench(self, case):
        """fwd_kvcache_mla_fp8 alone timed: q's cast, the block table and the split-KV schedule
        (get_mla_decoding_metadata_dense_fp8, once per batch in a server) are made before."""
        from .bench import case_data, time_on_gpu

        torch = self.torch
        data = case_data(torch, case, self.device)
        q_float32 = torch.cat([data.q_nope, data.q_pe], dim=-1).float().cpu().numpy()
        codes, launch = self.bench_launch(case, data, q_float32)
        q = torch.from_numpy(np.ascontiguousarray(codes)).to(self.device).view(torch.float8_e4m3fn)
        cache = self.kernel_cache(data.pool, None)
        seqlens = torch.from_numpy(launch.seqlens).to(self.device)
        table = torch.from_numpy(launch.block_table).to(self.device)
        tiles, splits = self.extension.get_mla_decoding_metadata_dense_fp8(
            seqlens, launch.rows_per_request * case.num_heads, 1)
        descale_q, descale_k = self.rule.descales(data.kv_scale)
        scale = lambda v: torch.tensor([float(v)], dtype=torch.float32, device=self.device)  # noqa: E731
        descale_q, descale_k = scale(descale_q), scale(descale_k)

        def run():
            return self.extension.fwd_kvcache_mla_fp8(
                q, cache, CKV, seqlens, table, float(self.model.sm_scale), True, tiles, splits,
                descale_q, descale_k)

        return time_on_gpu(torch, run, case, label="fwd_kvcache_mla_fp8 only (q cast, block "
                                                   "table and split schedule made before)")

    def kernel_cache(self, pool_tensor, gather):
        """[blocks, 64, 1, 576] float8_e4m3fn: the pool itself, or its re-paged copy."""
        torch = self.torch
        if gather is not None:
            index = torch.from_numpy(np.maximum(gather, 0)).to(self.device)
            copy = pool_tensor[index]
            copy[torch.from_numpy(gather < 0).to(self.device)] = 0
            pool_tensor = copy
        return pool_tensor.view(torch.float8_e4m3fn).view(-1, PAGE, 1, SLOT_BYTES)
