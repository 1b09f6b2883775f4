"""External backends for kvaudit: adapters that serve a kernel over kvaudit's backend protocol
(docs/backend-protocol.md, version 1).

    python -m kvdump.backends NAME [options]      (python -m kvdump.backends --help lists them)

Adapters (one module each; torch and flashinfer are imported only when an adapter starts, and a
missing one is an `unsupported` error reply naming it):
  torch                 torch_mla.py             plain PyTorch on the CPU or a GPU
  flashinfer-fp8        flashinfer_fp8.py        FlashInfer's paged MLA on the FP8 pool, in place
  flashinfer-cast-bf16  flashinfer_cast_bf16.py  SGLang's old path: the whole pool cast to bf16
  flashmla-sparse       flashmla_sparse.py       FlashMLA's sparse FP8 decode (kvdump v1.1 dumps)
  flashmla-dense-fp8    flashmla_dense_fp8.py    FlashMLA's dense FP8 decode (PR 54; vLLM, SGLang)
  vllm-triton-mla       vllm_triton_mla.py       vLLM's Triton MLA decode (file from the wheel)
  sglang-triton-mla     sglang_triton_mla.py     SGLang's Triton decode, MLA path (wheel's file)
The rest: protocol.py (message loop, array files, errors), pooled_adapter.py (what adapters share),
triton_mla.py and triton_layout.py (what the two Triton adapters share; their argument mapping),
peer_kernels.py (loading a peer's kernel file), writes.py (servers' write rules), faults.py
(planted faults), paged_layout.py (which slots a row reads), pools.py (the pool on the host or
the GPU), bench.py (timing), environment.py (describe).
"""

import importlib

# name -> (module, class, one line for --help)
ADAPTERS = {
    "torch": ("torch_mla", "TorchAdapter",
              "plain PyTorch: gather, dequantize, q.k, softmax, p.v in float32 (CPU or GPU)"),
    "flashinfer-fp8": ("flashinfer_fp8", "FlashInferFp8Adapter",
                       "flashinfer.mla.BatchMLAPagedAttentionWrapper on the FP8 pool, in place "
                       "(SM90)"),
    "flashinfer-cast-bf16": ("flashinfer_cast_bf16", "FlashInferCastBf16Adapter",
                             "the whole FP8 pool cast to bf16 every step, then FlashInfer's bf16 "
                             "MLA (SGLang before its FP8 fix)"),
    "flashmla-sparse": ("flashmla_sparse", "FlashMlaSparseAdapter",
                        "FlashMLA's sparse FP8 decode (DSA) on the 656-byte per-token-group pool, "
                        "in place (SM90, 64 or 128 heads)"),
    "flashmla-dense-fp8": ("flashmla_dense_fp8", "FlashMlaDenseFp8Adapter",
                           "FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8, PR 54) on the "
                           "576-byte FP8 pool, q quantized as vLLM or SGLang does (SM90)"),
    "vllm-triton-mla": ("vllm_triton_mla", "VllmTritonMlaAdapter",
                        "vLLM 0.34.0's Triton MLA decode (triton_decode_attention.py) on the FP8 "
                        "pool, in place: K/V dequantized to bf16, bf16 dots"),
    "sglang-triton-mla": ("sglang_triton_mla", "SglangTritonMlaAdapter",
                          "SGLang 0.5.23's Triton decode (decode_attention.py, has_mla) on the FP8 "
                          "pool, in place: q and P cast to e4m3, FP8 dots"),
}


def adapter_class(name):
    module, cls, _ = ADAPTERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
