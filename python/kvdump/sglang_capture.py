"""Capture of SGLang's FlashInfer MLA attention into a kvdump v1 file (docs/sglang-capture.md).

Installed in SGLang's TP worker processes, it records, for the chosen layers of a DeepSeek-V3/R1
(DeepseekV3ForCausalLM) or GLM-4.7-Flash (Glm4MoeLiteForCausalLM, SGLang >= 0.5.12) model served
with `--attention-backend flashinfer`, one kvdump step per forward batch:

  kvdump object        where it comes from (per layer L; T tokens, H heads, Dc + Dr = D)
  -------------------  ---------------------------------------------------------------------------
  /layers/L/kv_cache   the pool's rows before the first step: MLATokenToKVPool.get_key_buffer(L)
                       [slots, 1, D] (e4m3fn codes, or bf16) as [num_pages = slots, page_size 1, D]
  new_kv [T, D]        the bf16 rows given to the pool's write, where it happens:
                       set_mla_kv_buffer(layer, loc, k_nope [T,1,Dc], k_rope [T,1,Dr]) or
                       set_kv_buffer(layer, loc, k [T,1,D], ...), for calls whose layer id is L
  new_kv_slots [T]     that write's loc (checked equal to forward_batch.out_cache_loc)
  q_nope [T, H, Dc]    absorbed path: attn_mqa's q (q_nope @ w_kc) with q_rope passed separately;
  q_pe [T, H, Dr]      MHA path (ragged prefill): attn_mha's q [T, H, dn + Dr] split, its nope
                       part absorbed here through w_kc in float32 (no kernel saw that q)
  out [T, H, Dc]       absorbed path only: attn_mqa's return value [T, H*Dc] (before w_vc)
  lse [T, H]           absorbed path only: the planned FlashInfer wrapper re-run with
                       return_lse=True on the same inputs; FlashInfer's base-2 lse times ln 2
  kv_indices ...       page size 1 (as FlashInfer's MLA plan in SGLang): request b's tokens are
                       req_to_token[req_pool_indices[b], 0:seq_lens[b]]; kv_last_page_len = 1;
                       qo_indptr from 1 row per request (decode) or extend_seq_lens (prefill)
  kv_scale             exactly 1.0: SGLang's MLA pool writes bf16.to(float8_e4m3fn) and the
                       backend reads pool.to(bf16); a checkpoint k_scale is ignored (warned)
  sm_scale             the planned wrapper's sm_scale (model_config.scaling), else attn_mqa.scaling

Supported SGLang releases: 0.4.6.post5, 0.5.4.post3, 0.5.12, 0.5.18, 0.5.23 (their source read;
the pool, ForwardBatch, RadixAttention and forward context of the last four also run under the
capture on the CPU in tests/test_sglang_capture_real.py; no release was run on a GPU). The pools
and the TP rank come from model_executor/forward_context.py and runtime_context.get_parallel()
where they exist (0.5.18 on), else from the ForwardBatch and the ModelRunner.

The capture never breaks the server: it refuses at install what it cannot record completely
(server flags, versions, models; logged once), and at run time stops at the first step it cannot
represent (speculative verify, padded DP-attention batches, CUDA graphs, foreign writers, any
exception), logging why and leaving the server running. Each step is checked, written whole and
flushed to disk, so a capture that stops early, or a worker killed while the model computes,
leaves a file that h5py and kvaudit read (a kill during a step's own HDF5 write is not covered).

numpy and h5py only; torch and SGLang are never imported here (tensors are read by duck typing).
"""

import importlib.abc
import importlib.machinery
import logging
import math
import os
import sys
import traceback

import numpy as np

from .writer import KvDumpWriter, to_numpy, validate_step_indices

LOG = logging.getLogger("kvdump.sglang_capture")

CHECKED_VERSIONS = ("0.4.6.post5", "0.5.4.post3", "0.5.12", "0.5.18", "0.5.23")

# Architectures whose attention is DeepseekV2AttentionMLA on a dense MLATokenToKVPool.
SERVED_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "DeepSeek-V3 / DeepSeek-R1",
    "DeepseekV2ForCausalLM": "DeepSeek-V2",
    "Glm4MoeLiteForCausalLM": "GLM-4.7-Flash (SGLang 0.5.12 on)",
}
REFUSED_ARCHITECTURES = {
    "GlmMoeDsaForCausalLM": "GLM-5 runs on SGLang's sparse-attention backend (nsa/dsa) with "
    "64-token pages and a 656-byte FP8 row (512 e4m3 codes, 4 float32 block scales, 64 bf16 "
    "rope values), not on the flashinfer MLA backend",
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2 runs on SGLang's sparse-attention backend (nsa/dsa), "
    "not on the flashinfer MLA backend",
}

_LN2 = math.log(2.0)
_POOL_CLASS = "MLATokenToKVPool"
_BACKEND_CLASS = "FlashInferMLAAttnBackend"
_ATTENTION_CLASS = "DeepseekV2AttentionMLA"
# Pool methods that change a layer's rows without set_mla_kv_buffer / set_kv_buffer (speculative
# decoding, CPU offload, HiCache and disaggregation transfers): a call while capturing ends it.
_FOREIGN_WRITERS = ("move_kv_cache", "load_cpu_copy", "transfer", "transfer_per_layer",
                    "load_from_host_per_layer")
# Backend methods that only run when CUDA graphs are captured or replayed: hooks do not run inside
# a replayed graph, so such a step would be missing from the dump.
_GRAPH_METHODS = ("init_forward_metadata_capture_cuda_graph",
                  "init_forward_metadata_replay_cuda_graph", "init_forward_metadata_out_graph",
                  "_apply_cuda_graph_metadata")
_WRAPPERS = ("decode_wrapper", "prefill_wrapper_paged", "prefill_wrapper_verify")


class CaptureStopped(Exception):
    """Raised inside the capture when a step cannot be recorded; the message says why."""


# --- what this SGLang is, and where it keeps things ------------------------------------------


def sglang_version():
    """The running SGLang's version string, or None when it cannot be told."""
    module = sys.modules.get("sglang")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        from importlib import metadata

        return metadata.version("sglang")
    except Exception:  # no distribution metadata (a source checkout)
        return None


def _optional_module(name):
    try:
        return importlib.import_module(name)
    except Exception:  # absent in this SGLang version
        return None


class SglangApi:
    """Version-aware accessors (docs/sglang-capture.md, "Where SGLang keeps it").

    0.5.18 on: the pools hang off the attention backend published by ModelRunner._forward_raw
    (forward_context.get_token_to_kv_pool(), get_req_to_token_pool(), get_attn_backend()) and the
    TP rank is runtime_context.get_parallel().tp_rank. Before: ForwardBatch.token_to_kv_pool,
    req_to_token_pool and attn_backend, and ModelRunner.tp_rank.
    """

    def __init__(self, version, forward_context=None, runtime_context=None):
        self.version = version
        self.forward_context = forward_context
        self.runtime_context = runtime_context

    @classmethod
    def detect(cls):
        return cls(sglang_version(),
                   _optional_module("sglang.srt.model_executor.forward_context"),
                   _optional_module("sglang.srt.runtime_context"))

    def runtime(self, forward_batch):
        """(attention backend, token_to_kv_pool, req_to_token_pool) of the running forward."""
        context = self.forward_context
        if (context is not None and hasattr(context, "get_token_to_kv_pool")
                and context.has_forward_context()):
            return (context.get_attn_backend(), context.get_token_to_kv_pool(),
                    context.get_req_to_token_pool())
        backend = getattr(forward_batch, "attn_backend", None)
        pool = getattr(forward_batch, "token_to_kv_pool", None)
        requests = getattr(forward_batch, "req_to_token_pool", None)
        pool = pool if pool is not None else getattr(backend, "token_to_kv_pool", None)
        if requests is None:
            requests = getattr(backend, "req_to_token_pool", None)
        if backend is None or pool is None or requests is None:
            raise CaptureStopped("found neither an active forward context "
                                 "(model_executor/forward_context.py) nor the pools on the "
                                 "ForwardBatch: SGLang version not supported")
        return backend, pool, requests

    def tp_rank(self, model_runner):
        context = self.runtime_context
        if context is not None and hasattr(context, "get_parallel"):
            try:
                return int(context.get_parallel().tp_rank)
            except Exception:  # not published in this process
                pass
        return int(getattr(model_runner, "tp_rank", 0) or 0)


# --- refusals up front -----------------------------------------------------------------------


def version_problems(version, allow_unverified_version=False):
    if version in CHECKED_VERSIONS or allow_unverified_version:
        return []
    return [f"SGLang {version or '(unknown version)'} was not checked; the capture was read "
            f"against {', '.join(CHECKED_VERSIONS)} (allow_unverified_version=True to try)"]


def architecture_problems(architecture):
    if architecture in SERVED_ARCHITECTURES:
        return []
    if architecture in REFUSED_ARCHITECTURES:
        return [REFUSED_ARCHITECTURES[architecture]]
    served = ", ".join(f"{name} ({label})" for name, label in SERVED_ARCHITECTURES.items())
    return [f"model architecture {architecture} is not one this capture serves: {served}"]


def _name(value):
    return str(getattr(value, "value", value)).lower()


def _cuda_graph_problems(args):
    config = getattr(args, "cuda_graph_config", None)
    if config is not None:  # 0.5.18 on: one backend per phase, --disable-cuda-graph sets both
        bad = [f"{phase}={_name(getattr(getattr(config, phase, None), 'backend', None))}"
               for phase in ("decode", "prefill")
               if _name(getattr(getattr(config, phase, None), "backend", None)) != "disabled"]
        return [f"CUDA graphs are on ({', '.join(bad)}): pass --disable-cuda-graph"] if bad else []
    problems = []
    if not getattr(args, "disable_cuda_graph", False):
        problems.append("CUDA graphs are on: pass --disable-cuda-graph (hooks do not run in "
                        "replayed graphs)")
    if getattr(args, "enable_piecewise_cuda_graph", False):
        problems.append("--enable-piecewise-cuda-graph is set: drop it")
    if not getattr(args, "disable_piecewise_cuda_graph", True):
        problems.append("piecewise prefill CUDA graphs are on: pass --disable-piecewise-cuda-graph")
    if getattr(args, "enable_breakable_cuda_graph", False):
        problems.append("--enable-breakable-cuda-graph is set: drop it")
    return problems


def server_args_problems(args):
    """Why a server started with `args` cannot be captured completely; [] when it can."""
    default = getattr(args, "attention_backend", None)
    backends = {getattr(args, name, None) or default
                for name in ("prefill_attention_backend", "decode_attention_backend")}
    problems = []
    if backends != {"flashinfer"}:
        problems.append(f"attention backends {sorted(str(b) for b in backends)}: pass "
                        "--attention-backend flashinfer (not the default on Hopper)")
    if getattr(args, "speculative_algorithm", None) not in (None, "", "NONE"):
        problems.append("speculative decoding writes the pool in verify and draft steps: drop "
                        "--speculative-algorithm")
    flags = (("enable_hierarchical_cache", "HiCache loads pool rows from host memory: drop "
              "--enable-hierarchical-cache"),
             ("enable_dp_attention", "DP attention pads seq_lens and out_cache_loc: drop "
              "--enable-dp-attention"),
             ("enable_two_batch_overlap", "two-batch overlap splits steps: drop "
              "--enable-two-batch-overlap"),
             ("enable_torch_compile", "torch.compile bypasses module hooks: drop "
              "--enable-torch-compile"),
             ("enable_pdmux", "PD multiplexing runs two batches at once: drop --enable-pdmux"))
    problems += [message for name, message in flags if getattr(args, name, False)]
    if getattr(args, "disaggregation_mode", "null") not in (None, "null"):
        problems.append("a separate prefill server writes the pool: run without "
                        "--disaggregation-mode")
    for name in ("dcp_size", "attn_cp_size", "attn_dp_size"):
        if (getattr(args, name, None) or 1) > 1:
            problems.append(f"{name} = {getattr(args, name)}: context/DP-sharded pools are not "
                            "captured")
    return problems + _cuda_graph_problems(args)


# --- host copies and batch geometry ----------------------------------------------------------


def _host(tensor, what):
    """numpy view of a tensor: bf16 as uint16 bits, e4m3fn as uint8 codes (kvdump.to_numpy)."""
    return to_numpy(tensor, what)


def _host_copy(tensor, what):
    """Like _host, but never a view of the live tensor (a CPU tensor or numpy array would be)."""
    if hasattr(tensor, "detach"):  # torch: one fresh host copy, viewed
        return _host(tensor.detach().to("cpu", copy=True), what)
    return _host(np.array(tensor, copy=True), what)


def _host_ints(values, what):
    if isinstance(values, (list, tuple)):
        return np.asarray(values, dtype=np.int64)
    arr = _host(values, what)
    if arr.dtype.kind not in "iu":
        raise CaptureStopped(f"{what}: dtype {arr.dtype} is not an integer type")
    return arr.astype(np.int64).reshape(-1)


def _write_loc(loc):
    """The slot tensor of a pool write: 0.5.18 on may pass a KVWriteLoc (memory_pool.py)."""
    return getattr(loc, "loc", loc)


def step_kind(forward_batch):
    """"decode", "prefill" or None (an idle batch); CaptureStopped for every other mode."""
    mode = forward_batch.forward_mode
    name = getattr(mode, "name", str(mode))
    if name == "DECODE":
        return "decode"
    if name in ("EXTEND", "MIXED"):
        return "prefill"
    if name == "IDLE":
        return None
    raise CaptureStopped(f"forward mode {name}: speculative verify/draft, split-prefill and other "
                         "special steps have no kvdump form here")


def request_rows(kind, forward_batch, batch):
    """Query rows (new tokens) of each request of the batch."""
    if kind == "decode":
        return [1] * batch
    rows = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if rows is None and getattr(forward_batch, "extend_seq_lens", None) is not None:
        rows = _host_ints(forward_batch.extend_seq_lens, "extend_seq_lens").tolist()
    if rows is None:
        raise CaptureStopped("an extend step without extend_seq_lens (a speculative verify step?)")
    return [int(n) for n in rows]


def step_indices(kind, forward_batch, req_to_token):
    """qo_indptr, kv_indptr, kv_indices, kv_last_page_len (page size 1) and the batch's
    out_cache_loc, read as FlashInfer's MLA plan reads them (create_flashinfer_kv_indices)."""
    if getattr(forward_batch, "global_num_tokens_cpu", None) is not None:
        raise CaptureStopped("MLP-sync batch (DP attention, DeepEP): seq_lens and out_cache_loc "
                             "are padded")
    requests = _host_ints(forward_batch.req_pool_indices, "req_pool_indices")
    seq_lens = _host_ints(forward_batch.seq_lens, "seq_lens")
    if requests.size != seq_lens.size:
        raise CaptureStopped(f"{requests.size} request indices but {seq_lens.size} seq_lens")
    rows = request_rows(kind, forward_batch, requests.size)
    out_cache_loc = _host_ints(forward_batch.out_cache_loc, "out_cache_loc")
    if len(rows) != requests.size or sum(rows) != out_cache_loc.size:
        raise CaptureStopped(f"{out_cache_loc.size} out_cache_loc slots for {sum(rows)} new "
                             f"tokens of {requests.size} requests: a padded batch")
    longest = int(seq_lens.max()) if seq_lens.size else 0
    table = _host_ints(req_to_token[requests.tolist(), :longest], "req_to_token")
    table = table.reshape(requests.size, longest)
    kv_indices = np.concatenate([table[b, :n] for b, n in enumerate(seq_lens)] or [[]])
    return dict(qo_indptr=np.concatenate([[0], np.cumsum(rows)]),
                kv_indptr=np.concatenate([[0], np.cumsum(seq_lens)]),
                kv_indices=kv_indices.astype(np.int64),
                kv_last_page_len=(seq_lens > 0).astype(np.int64)), out_cache_loc


# --- tensors of one layer in one step --------------------------------------------------------


class LayerRecord:
    """What one layer showed during one step: its write, its attention call(s), its pool after."""

    def __init__(self):
        self.new_kv = None  # [T, D] bf16 bits
        self.slots = None  # [T] int64, the write's loc
        self.mqa = None  # (q_nope, q_pe, out, lse) of the absorbed call
        self.mha_q = None  # [T, H, dn + Dr] bf16 bits of the MHA (ragged) call
        self.pool_after = None


def new_kv_from_write(method, cache_a, cache_b, width):
    """[T, D] bf16 bits of a write: cat(k_nope, k_rope) or the concatenated cache_k."""
    parts = [cache_a, cache_b] if method == "set_mla_kv_buffer" else [cache_a]
    arrays = [_host(part, f"{method} input") for part in parts]
    for arr in arrays:
        if arr.dtype != np.uint16:
            raise CaptureStopped(f"{method} got {arr.dtype} values, not bfloat16: the unquantized "
                                 "rows are not available")
    rows = arrays[0].shape[0] if arrays[0].ndim else 0
    new_kv = np.concatenate([arr.reshape(rows, -1) for arr in arrays], axis=1)
    if new_kv.shape[1] != width:
        raise CaptureStopped(f"{method} wrote rows of {new_kv.shape[1]} values, not {width}")
    return new_kv


def queries_from_mqa(args, kwargs, heads, dc):
    """(q_nope [T,H,Dc], q_pe [T,H,Dr]) bf16 bits of an attn_mqa call (RadixAttention.forward)."""
    q = _host(args[0] if args else kwargs["q"], "attn_mqa q")
    q_rope = kwargs.get("q_rope")
    rows = q.shape[0]
    if q_rope is not None:  # flashinfer passes the rope part separately
        return q.reshape(rows, heads, dc), _host(q_rope, "attn_mqa q_rope").reshape(rows, heads, -1)
    full = q.reshape(rows, heads, -1)
    return full[..., :dc], full[..., dc:]


def absorb_mha_query(q_bits, self_attn, w_kc_host):
    """float32 absorbed q_nope [T, H, Dc] of an MHA-path query: q_nope @ w_kc per head."""
    dn = int(self_attn.qk_nope_head_dim)
    q_nope = _bf16_to_float32(q_bits[..., :dn])  # [T, H, dn]
    return np.einsum("thn,hnc->thc", q_nope, w_kc_host, optimize=True).astype(np.float32)


def _bf16_to_float32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def host_w_kc(self_attn):
    """w_kc [H, dn, Dc] as float32 on the host, scale applied; CaptureStopped when the layer's
    absorption weights are in a form this capture does not reproduce."""
    if getattr(self_attn, "use_deep_gemm_bmm", False):
        raise CaptureStopped("w_kc is block-scaled for DeepGEMM: MHA-path queries cannot be "
                             "absorbed here; pass --flashinfer-mla-disable-ragged")
    w_kc = getattr(self_attn, "w_kc", None)
    if w_kc is None:
        raise CaptureStopped("the layer has no w_kc")
    arr = _host(w_kc, "w_kc")
    if arr.dtype == np.uint16:
        return _bf16_to_float32(arr)
    if arr.dtype == np.uint8:  # float8_e4m3fn with a per-tensor scale
        from .codec import decode_e4m3

        scale = getattr(self_attn, "w_scale", None)
        scale = 1.0 if scale is None else float(np.asarray(_host(scale, "w_scale")).reshape(-1)[0])
        return (decode_e4m3(arr) * scale).astype(np.float32)
    if arr.dtype in (np.float16, np.float32):
        return arr.astype(np.float32)
    raise CaptureStopped(f"w_kc of dtype {arr.dtype} is not reproduced here; pass "
                         "--flashinfer-mla-disable-ragged")


def lse_by_rerun(call, out_bits, kind):
    """Natural-log lse [T, H] of the recorded wrapper.run call, re-run with return_lse=True.

    FlashInfer returns a base-2 lse (return_lse_base_on_e exists from 0.6.11 only); kvdump v1
    stores natural log, so lse_e = lse_2 * ln 2. Returns (lse, elements where the re-run's out
    differs from the server's)."""
    wrapper, args, kwargs = call
    page_size, causal = getattr(wrapper, "_page_size", 1), getattr(wrapper, "_causal", None)
    if page_size != 1 or (causal is not None and bool(causal) != (kind == "prefill")):
        raise CaptureStopped(f"the planned wrapper has page_size {page_size} and causal {causal}, "
                             f"not 1 and {kind == 'prefill'}")
    rerun = {k: v for k, v in kwargs.items()
             if k not in ("out", "lse", "return_lse", "return_lse_base_on_e")}
    out2, lse2 = wrapper.run(*args, return_lse=True, **rerun)
    out2_bits = _host(out2, "re-run out").reshape(out_bits.shape)
    lse2 = _host(lse2, "re-run lse")
    lse = (lse2.astype(np.float64) * _LN2).astype(np.float32)
    return lse.reshape(out_bits.shape[0], out_bits.shape[1]), int(np.sum(out2_bits != out_bits))


# --- the capture -----------------------------------------------------------------------------


def check_layer_shapes(path, tensors, writer, rows):
    """The shapes KvDumpWriter's StepWriter.add_layer requires, checked before the step's group is
    created so that a refusal never leaves a step without its layers in the file."""
    h, dc, dr = writer.num_heads, writer.kv_lora_rank, writer.qk_rope_head_dim
    expected = dict(q_nope=(rows, h, dc), q_pe=(rows, h, dr), new_kv=(rows, dc + dr),
                    out=(rows, h, dc), lse=(rows, h),
                    kv_cache_after=(writer.num_pages, writer.page_size, dc + dr))
    for name, value in tensors.items():
        if value is not None and tuple(value.shape) != expected[name]:
            raise CaptureStopped(f"{path}/{name}: shape {tuple(value.shape)} != {expected[name]}")


def _argument(args, kwargs, index, name):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _stream_capturing():
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing())
    except Exception:  # a build without CUDA
        return False


def _flush_to_disk(writer):
    """Pushes the file's buffers to disk after a step (KvDumpWriter.flush), so the file read after
    an early stop or a killed worker holds every step written so far."""
    writer.flush()


class MlaCapture:
    """Records `layer_ids` of one model for up to `max_steps` forward steps into one kvdump file.

    modules: {layer_id: the layer's DeepseekV2AttentionMLA (self_attn)}. Steps: every non-idle
    forward batch after the first `skip_steps` (the server's warm-up request is one). The pool
    snapshot is taken when the first captured step reaches the first captured layer.
    """

    def __init__(self, modules, path, *, model, producer, api=None, max_steps=8, skip_steps=0,
                 capture_pool_after=False):
        self.modules = dict(sorted(modules.items()))
        self.layer_ids = list(self.modules)
        self.path = path
        self.model = model
        self.producer = producer
        self.api = api or SglangApi.detect()
        self.max_steps = int(max_steps)
        self.skip_steps = int(skip_steps)
        self.capture_pool_after = bool(capture_pool_after)
        self.state = "idle"  # idle -> active -> finished | stopped
        self.stop_reason = None
        self.steps_written = 0
        self.notes = []  # warnings logged once
        self.kv_dtype = None
        self._seen_steps = 0
        self._started = False  # the pool snapshot is taken: every later write must be seen
        self._planned_sm_scale = None
        self._writer_sm_scale = None
        self._pending = None  # {"kind", "forward_batch", "layers": {id: LayerRecord}, ...}
        self._runtime = None  # (backend, pool, req_to_token_pool) patched
        self._pool_before = None
        self._writer = None
        self._w_kc = {}
        self._run_call = None
        self._armed = False
        self._handles = []
        self._patches = []

    # lifecycle

    def install(self):
        for layer_id, self_attn in self.modules.items():
            mqa, mha = self_attn.attn_mqa, self_attn.attn_mha
            hooks = ((self_attn, "pre", self._attention_start),
                     (self_attn, "post", self._attention_end), (mqa, "pre", self._mqa_start),
                     (mqa, "post", self._mqa_end), (mha, "pre", self._mha_start))
            for module, when, handler in hooks:
                self._handles.append(self._register(module, when, layer_id, handler))
        self.state = "active"
        return self

    def _register(self, module, when, layer_id, handler):
        if when == "pre":
            def pre_hook(_module, args, kwargs):
                self._guarded(handler, layer_id, args, kwargs)
                return None

            return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def post_hook(_module, args, kwargs, output):
            self._guarded(handler, layer_id, args, kwargs, output)
            return None

        return module.register_forward_hook(post_hook, with_kwargs=True)

    def stop(self, reason, details=None):
        """Ends the capture: hooks and patches removed, the file closed; the server goes on."""
        if self.state in ("stopped", "finished"):
            return
        self.state = "stopped"
        self.stop_reason = reason
        LOG.warning("kvdump capture of layers %s stopped after %d step(s): %s%s", self.layer_ids,
                    self.steps_written, reason, f"\n{details}" if details else "")
        self._release()

    def finish(self):
        if self.state != "active":
            return
        self.state = "finished"
        LOG.warning("kvdump capture of layers %s finished: %d step(s) in %s", self.layer_ids,
                    self.steps_written, self.path)
        self._release()

    def _release(self):
        self._pending = None
        self._run_call = None
        self._armed = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for owner, name, had_own, previous in reversed(self._patches):
            if had_own:
                setattr(owner, name, previous)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        self._patches = []
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except Exception as error:  # the steps already flushed stay readable
                LOG.warning("kvdump capture: closing %s: %s", self.path, error)

    def _guarded(self, handler, *args):
        """Runs a hook body; any failure stops the capture instead of reaching the server."""
        if self.state != "active":
            return None
        try:
            return handler(*args)
        except CaptureStopped as stopped:
            self.stop(str(stopped))
        except Exception as error:
            self.stop(f"{type(error).__name__}: {error}", traceback.format_exc())
        return None

    def _note(self, message):
        if message not in self.notes:
            self.notes.append(message)
            LOG.warning("kvdump capture: %s", message)

    # patches on SGLang objects (instance attributes, removed on release)

    def _patch(self, owner, name, make):
        original = getattr(owner, name)
        had_own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, make(original))
        self._patches.append((owner, name, had_own, original))

    def _install_patches(self, backend, pool):
        for method in ("set_mla_kv_buffer", "set_kv_buffer"):
            self._patch(pool, method, lambda original, m=method: self._recording_write(m, original))
        for method in _FOREIGN_WRITERS:
            if hasattr(pool, method):
                self._patch(pool, method, lambda original, m=method: self._foreign(m, original))
        for method in _GRAPH_METHODS:
            if hasattr(backend, method):
                self._patch(backend, method, lambda original, m=method: self._foreign(m, original))
        for name in _WRAPPERS:
            wrapper = getattr(backend, name, None)
            if wrapper is not None and hasattr(wrapper, "run"):
                self._patch(wrapper, "run",
                            lambda original, w=wrapper: self._recording_run(w, original))

    def _recording_write(self, method, original):
        def write(*args, **kwargs):
            result = original(*args, **kwargs)
            self._guarded(self._on_write, method, args, kwargs)
            return result

        return write

    def _foreign(self, method, original):
        def call(*args, **kwargs):
            if self.state == "active" and self._started:
                self.stop(f"{method} ran while capturing: a pool write or a CUDA graph step "
                          "the hooks cannot see")
            return original(*args, **kwargs)

        return call

    def _recording_run(self, wrapper, original):
        def run(*args, **kwargs):
            result = original(*args, **kwargs)
            if self._armed:
                self._run_call = (wrapper, args, kwargs)
            return result

        return run

    # hooks

    def _attention_start(self, layer_id, args, kwargs):
        if _stream_capturing():
            raise CaptureStopped("a CUDA graph is being captured: start the server with "
                                 "--disable-cuda-graph")
        forward_batch = _argument(args, kwargs, 2, "forward_batch")
        kind = step_kind(forward_batch)
        if kind is None:
            return
        if layer_id == self.layer_ids[0]:
            self._begin_step(kind, forward_batch)
        pending = self._pending
        if pending is None:
            return  # a skipped step
        if pending["forward_batch"] is not forward_batch:
            raise CaptureStopped(f"layer {layer_id} ran a forward batch other than the step's")
        pending["layers"][layer_id] = LayerRecord()
        pending["active"] = layer_id

    def _begin_step(self, kind, forward_batch):
        if self._pending is not None:
            raise CaptureStopped(f"the previous step never reached layer {self.layer_ids[-1]}")
        self._seen_steps += 1
        if self._seen_steps <= self.skip_steps:
            return
        backend, pool, requests = self.api.runtime(forward_batch)
        if self._runtime is None:
            self._check_runtime(backend, pool)
            self._pool_before = {i: self._pool_rows(pool, i) for i in self.layer_ids}
            self._install_patches(backend, pool)
            self._started = True
            self._runtime = (backend, pool, requests)
        elif self._runtime[1] is not pool or self._runtime[0] is not backend:
            raise CaptureStopped("the step runs on another pool or attention backend")
        self._pending = {"kind": kind, "forward_batch": forward_batch, "layers": {},
                         "active": None, "requests": requests}

    def _check_runtime(self, backend, pool):
        if type(backend).__name__ != _BACKEND_CLASS:
            raise CaptureStopped(f"attention backend {type(backend).__name__} is not "
                                 f"{_BACKEND_CLASS} (--attention-backend flashinfer)")
        translator = getattr(backend, "kv_index_translator", None)
        if getattr(translator, "is_translating", False):
            raise CaptureStopped("req_to_token holds virtual ids (unified / page-interleaved pool)")
        if type(pool).__name__ != _POOL_CLASS:
            raise CaptureStopped(f"KV pool {type(pool).__name__} is not {_POOL_CLASS}")
        for flag in ("use_nsa", "use_dsa", "nsa_kv_cache_store_fp8", "dsa_kv_cache_store_fp8"):
            if getattr(pool, flag, False):
                raise CaptureStopped(f"the pool is a sparse-attention pool ({flag})")
        self.kv_dtype = {"torch.float8_e4m3fn": "float8_e4m3fn",
                         "torch.bfloat16": "bfloat16"}.get(str(pool.dtype))
        if self.kv_dtype is None:
            raise CaptureStopped(f"pool dtype {pool.dtype} is neither float8_e4m3fn nor bfloat16")

    def _pool_rows(self, pool, layer_id):
        rows = _host_copy(pool.get_key_buffer(layer_id), f"pool of layer {layer_id}")
        attn = self.modules[layer_id].attn_mqa
        width = int(attn.qk_head_dim)
        if rows.ndim != 3 or rows.shape[1] != 1 or rows.shape[2] != width:
            raise CaptureStopped(f"layer {layer_id}'s pool buffer has shape {rows.shape}, not "
                                 f"[slots, 1, {width}]")
        return rows

    def _record(self, layer_id):
        pending = self._pending
        if pending is None or pending["active"] != layer_id:
            return None
        return pending["layers"][layer_id]

    def _on_write(self, method, args, kwargs):
        layer = _argument(args, kwargs, 0, "layer")
        layer_id = kwargs.get("layer_id_override")
        layer_id = int(layer.layer_id if layer_id is None else layer_id)
        if layer_id not in self.modules or not self._started:
            return
        record = self._record(layer_id)
        if record is None:
            raise CaptureStopped(f"{method} wrote layer {layer_id} outside its attention forward")
        if record.new_kv is not None:
            raise CaptureStopped(f"layer {layer_id} was written twice in one step")
        loc = _argument(args, kwargs, 1, "loc")
        loc = loc if loc is not None else kwargs.get("loc_info")
        width = int(self.modules[layer_id].attn_mqa.qk_head_dim)
        record.new_kv = new_kv_from_write(method, _argument(args, kwargs, 2, "cache_k_nope" if
                                                            method == "set_mla_kv_buffer" else
                                                            "cache_k"),
                                          _argument(args, kwargs, 3, "cache_k_rope"), width)
        record.slots = _host_ints(_write_loc(loc), f"{method} loc")

    def _mqa_start(self, layer_id, args, kwargs):
        if self._record(layer_id) is not None:
            self._run_call = None
            self._armed = True

    def _mqa_end(self, layer_id, args, kwargs, output):
        self._armed = False
        record = self._record(layer_id)
        if record is None:
            return
        if record.mqa is not None:
            raise CaptureStopped(f"layer {layer_id} called attn_mqa twice in one step")
        attn = self.modules[layer_id].attn_mqa
        heads, dc = int(attn.tp_q_head_num), int(attn.v_head_dim)
        q_nope, q_pe = queries_from_mqa(args, kwargs, heads, dc)
        out = _host(output[0] if isinstance(output, tuple) else output, "attn_mqa output")
        out = out.reshape(q_nope.shape[0], heads, dc)
        if self._run_call is None:
            raise CaptureStopped("attn_mqa ran no planned FlashInfer MLA wrapper (ragged path)")
        lse, differing = lse_by_rerun(self._run_call, out, self._pending["kind"])
        if differing:
            self._note(f"the re-run for lse gave an out differing in {differing} element(s) from "
                       "the server's; the dump keeps the server's out")
        self._check_sm_scale(self._run_call[0])
        self._run_call = None
        record.mqa = (q_nope, q_pe, out, lse)

    def _mha_start(self, layer_id, args, kwargs):
        record = self._record(layer_id)
        if record is not None and record.mha_q is None:  # chunked prefix: same q every call
            record.mha_q = _host(_argument(args, kwargs, 0, "q"), "attn_mha q")

    def _attention_end(self, layer_id, args, kwargs, output):
        record = self._record(layer_id)
        if record is None:
            return
        if self.capture_pool_after:
            record.pool_after = self._pool_rows(self._runtime[1], layer_id)
        self._pending["active"] = None
        if layer_id == self.layer_ids[-1]:
            self._write_step()

    # one step to the file

    def _check_sm_scale(self, wrapper):
        planned = getattr(wrapper, "_sm_scale", None)
        if planned is None:
            return
        planned = float(planned)
        if self._planned_sm_scale is None:
            self._planned_sm_scale = planned
        written = self._writer_sm_scale
        if written is None or planned == written:
            return
        if abs(planned - written) > 1e-6 * abs(written):
            raise CaptureStopped(f"the planned sm_scale {planned} is not the file's {written}")
        self._note(f"the planned sm_scale {planned!r} differs from the file's {written!r} (taken "
                   "from attn_mqa.scaling before the first planned step) in the last bits")

    def _layer_tensors(self, layer_id, record, rows):
        if record.new_kv is None:
            raise CaptureStopped(f"layer {layer_id} wrote no KV rows in the step")
        if (record.mqa is None) == (record.mha_q is None):
            raise CaptureStopped(f"layer {layer_id}: {'no' if record.mqa is None else 'two'} "
                                 "attention paths seen in the step")
        if record.new_kv.shape[0] != rows:
            raise CaptureStopped(f"layer {layer_id} wrote {record.new_kv.shape[0]} rows, "
                                 f"not {rows}")
        if record.mqa is not None:
            q_nope, q_pe, out, lse = record.mqa
            return dict(q_nope=q_nope, q_pe=q_pe, new_kv=record.new_kv, out=out, lse=lse,
                        kv_cache_after=record.pool_after)
        self_attn = self.modules[layer_id]
        if layer_id not in self._w_kc:
            self._w_kc[layer_id] = host_w_kc(self_attn)
        self._note("MHA-path (ragged prefill) steps carry no kernel out/lse and a q_nope absorbed "
                   "here in float32; --flashinfer-mla-disable-ragged avoids them")
        q_nope = absorb_mha_query(record.mha_q, self_attn, self._w_kc[layer_id])
        q_pe = record.mha_q[..., int(self_attn.qk_nope_head_dim):]
        return dict(q_nope=q_nope, q_pe=q_pe, new_kv=record.new_kv,
                    kv_cache_after=record.pool_after)

    def _write_step(self):
        pending, self._pending = self._pending, None
        kind = pending["kind"]
        indices, out_cache_loc = step_indices(kind, pending["forward_batch"],
                                              pending["requests"].req_to_token)
        rows = int(indices["qo_indptr"][-1])
        tensors = {}
        for layer_id in self.layer_ids:
            record = pending["layers"].get(layer_id)
            if record is None:
                raise CaptureStopped(f"layer {layer_id} did not run in the step")
            if not np.array_equal(record.slots, out_cache_loc):
                raise CaptureStopped(f"layer {layer_id}'s write loc differs from out_cache_loc")
            tensors[layer_id] = self._layer_tensors(layer_id, record, rows)
        writer = self._open_writer()
        path = f"/steps/S{self.steps_written:03d}"
        checked = validate_step_indices(path, kind, new_kv_slots=out_cache_loc,
                                        num_pages=writer.num_pages, page_size=1, **indices)
        for layer_id, layer_tensors in tensors.items():  # nothing half-written: check first
            check_layer_shapes(f"{path}/L{layer_id:03d}", layer_tensors, writer, rows)
        step = writer.add_step(kind, **checked)
        for layer_id, layer_tensors in tensors.items():
            step.add_layer(layer_id, **layer_tensors)
        _flush_to_disk(writer)
        self.steps_written += 1
        if self.steps_written >= self.max_steps:
            self.finish()

    def _open_writer(self):
        if self._writer is not None:
            return self._writer
        first = self.modules[self.layer_ids[0]].attn_mqa
        dc, width = int(first.v_head_dim), int(first.qk_head_dim)
        sm_scale = self._planned_sm_scale
        sm_scale = float(first.scaling) if sm_scale is None else sm_scale
        self._warn_checkpoint_scale()
        writer = KvDumpWriter(self.path, model=self.model, producer=self.producer,
                              num_heads=int(first.tp_q_head_num), kv_lora_rank=dc,
                              qk_rope_head_dim=width - dc, sm_scale=sm_scale, page_size=1,
                              kv_dtype=self.kv_dtype, incremental=True)  # readable if it stops
        for layer_id in self.layer_ids:
            writer.add_layer(layer_id, 1.0, self._pool_before.pop(layer_id))
        self._writer, self._writer_sm_scale = writer, float(sm_scale)
        return writer

    def _warn_checkpoint_scale(self):
        for layer_id, self_attn in self.modules.items():
            scale = getattr(self_attn.attn_mqa, "k_scale_float", None)
            if scale is not None and float(scale) != 1.0:
                self._note(f"layer {layer_id}'s checkpoint carries k_scale {float(scale)}, which "
                           "SGLang's flashinfer MLA path does not apply (plain cast write, plain "
                           "upcast read): the dump's kv_scale is 1.0")


# --- installing it in a server ---------------------------------------------------------------


def attention_modules(model, layer_ids):
    """{layer_id: model.model.layers[layer_id].self_attn} for the layers on this rank."""
    layers = model.model.layers
    modules = {}
    for layer_id in layer_ids:
        self_attn = getattr(layers[layer_id], "self_attn", None)
        if self_attn is None:  # PPMissingLayer: on another pipeline rank
            continue
        if type(self_attn).__name__ != _ATTENTION_CLASS:
            raise CaptureStopped(f"layer {layer_id}'s attention is {type(self_attn).__name__}, "
                                 f"not {_ATTENTION_CLASS}")
        if getattr(self_attn.attn_mqa, "logit_cap", 0):
            raise CaptureStopped(f"layer {layer_id} uses a logit soft cap, which kvdump v1 lacks")
        modules[layer_id] = self_attn
    return modules


def _layer_list(layer_ids):
    if isinstance(layer_ids, int):
        return [layer_ids]
    return sorted({int(i) for i in layer_ids})


def capture_for_runner(model_runner, layer_ids, path_template, *, allow_unverified_version=False,
                       api=None, **options):
    """The MlaCapture of a loaded ModelRunner, installed; None (logged) where it is refused."""
    api = api or SglangApi.detect()
    layer_ids = _layer_list(layer_ids)
    if getattr(model_runner, "is_draft_worker", False):
        return None
    config = getattr(model_runner.model_config, "hf_config", None)
    architectures = getattr(config, "architectures", None) or [type(model_runner.model).__name__]
    architecture = architectures[0]
    problems = (version_problems(api.version, allow_unverified_version)
                + architecture_problems(architecture)
                + server_args_problems(model_runner.server_args))
    try:
        modules = attention_modules(model_runner.model, layer_ids) if not problems else {}
    except CaptureStopped as refused:
        problems.append(str(refused))
    if problems:
        LOG.warning("kvdump capture not installed:\n  %s", "\n  ".join(problems))
        return None
    if not modules:
        LOG.warning("kvdump capture: layers %s are not on this pipeline rank", layer_ids)
        return None
    rank = api.tp_rank(model_runner)
    path = path_template.format(layer="-".join(map(str, modules)), rank=rank, pid=os.getpid())
    options.setdefault("model", str(getattr(model_runner.model_config, "model_path", architecture)))
    options.setdefault("producer", f"sglang {api.version} flashinfer_mla tp-rank {rank} "
                                   "(kvdump.sglang_capture)")
    LOG.warning("kvdump capture of layers %s into %s", list(modules), path)
    return MlaCapture(modules, path, api=api, **options).install()


def patch_model_runner(model_runner_class, layer_ids, path_template, **options):
    """Makes ModelRunner.load_model install the capture in every worker after the model loads."""
    load_model = model_runner_class.load_model

    def load_model_and_capture(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        if getattr(self, "kvdump_capture", None) is not None:  # a reload: keep the first capture
            LOG.warning("kvdump capture: the model was loaded again; the capture keeps the first")
            return result
        try:
            self.kvdump_capture = capture_for_runner(self, layer_ids, path_template, **options)
        except Exception:  # never stop the server from starting
            LOG.exception("kvdump capture not installed")
        return result

    model_runner_class.load_model = load_model_and_capture


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after the module `name` executes (a post-import hook)."""

    def __init__(self, name, callback):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        sys.meta_path.remove(self)
        spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader, callback):
        self.loader = loader
        self.callback = callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.callback(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self.loader, name)


MODEL_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
ENVIRONMENT = {
    "KVDUMP_SGLANG_LAYERS": "layer ids, comma-separated (required): 3 or 3,40",
    "KVDUMP_SGLANG_PATH": "file path template with {layer}, {rank}, {pid} (required)",
    "KVDUMP_SGLANG_STEPS": "steps to capture (default 8)",
    "KVDUMP_SGLANG_SKIP_STEPS": "forward steps to let pass first (default 0)",
    "KVDUMP_SGLANG_POOL_AFTER": "1: also store each step's pool (kv_cache_after)",
    "KVDUMP_SGLANG_ANY_VERSION": "1: try an SGLang version that was not checked",
}


def install_from_environment(environ=None):
    """Installs the capture as the KVDUMP_SGLANG_* variables say; for a sitecustomize.py that
    SGLang's worker processes import (docs/sglang-capture.md). Returns whether it did."""
    environ = os.environ if environ is None else environ
    if not environ.get("KVDUMP_SGLANG_LAYERS") or not environ.get("KVDUMP_SGLANG_PATH"):
        return False
    layer_ids = [int(part) for part in environ["KVDUMP_SGLANG_LAYERS"].split(",") if part.strip()]
    options = dict(max_steps=int(environ.get("KVDUMP_SGLANG_STEPS", "8")),
                   skip_steps=int(environ.get("KVDUMP_SGLANG_SKIP_STEPS", "0")),
                   capture_pool_after=environ.get("KVDUMP_SGLANG_POOL_AFTER", "0") == "1",
                   allow_unverified_version=environ.get("KVDUMP_SGLANG_ANY_VERSION", "0") == "1")

    def patch(module):
        patch_model_runner(module.ModelRunner, layer_ids, environ["KVDUMP_SGLANG_PATH"], **options)

    module = sys.modules.get(MODEL_RUNNER_MODULE)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _AfterImport(MODEL_RUNNER_MODULE, patch))
    return True
