"""A recorded stand-in for the parts of SGLang that kvdump.sglang_capture touches, one shape per
release read (0.4.6.post5, 0.5.4.post3, 0.5.12, 0.5.18, 0.5.23), so that the capture's tests run
without torch, a GPU or SGLang. Tensors are numpy arrays: bf16 as uint16 bits, the e4m3fn pool as
uint8 codes (what kvdump.to_numpy makes of torch tensors). No tests here; test_sglang_capture.py
drives it.

What differs between releases (docs/sglang-capture.md has the file:line evidence):
  pools_on_batch   ForwardBatch.token_to_kv_pool, req_to_token_pool, attn_backend (<= 0.5.12);
                   from 0.5.18 the model reads forward_context.get_token_to_kv_pool() and the
                   attention backend holds the pools
  tp_on_runner     ModelRunner.tp_rank (<= 0.5.12); from 0.5.18 runtime_context.get_parallel()
  write_loc        what the backend passes as loc: the out_cache_loc tensor, or (0.5.23)
                   KVWriteLoc.for_batch(forward_batch); 0.5.23's writes take layer_id_override
  graph methods    the backend's CUDA-graph entry points of that release
  server args      the flags (or, 0.5.18 on, the resolved cuda_graph_config) of that release

The model code mirrors DeepseekV2AttentionMLA: the absorbed path calls
attn_mqa(q_nope_out, k_nope, k_nope, forward_batch, q_rope=q_pe, k_rope=k_pe), the backend writes
the pool with set_mla_kv_buffer(layer, loc, k, k_rope) and runs the planned MLA wrapper on the
pool cast to bf16; the MHA path writes set_mla_kv_buffer(attn_mha, loc, kv_a, k_pe) and calls
attn_mha(q, k, v, forward_batch, save_kv_cache=False). The wrapper computes exact attention in
float64 and returns FlashInfer's base-2 lse.
"""

import enum
import os
import sys
import types
from dataclasses import dataclass, field

import numpy as np

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PYTHON_DIR)

import kvdump  # noqa: E402

H, DC, DR, DN = 2, 16, 8, 12  # heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim
D = DC + DR
SM_SCALE = 0.1875


@dataclass
class VersionShape:
    version: str
    pools_on_batch: bool
    tp_on_runner: bool
    kv_write_loc: bool = False  # 0.5.23: KVWriteLoc.for_batch(forward_batch)
    layer_id_override: bool = False
    translator: bool = False  # 0.5.23: backend.kv_index_translator
    foreign_writers: tuple = ()
    graph_methods: tuple = ()
    server_flags: dict = field(default_factory=dict)
    graph_config: bool = False  # 0.5.18 on: server_args.cuda_graph_config


VERSIONS = {
    "0.4.6.post5": VersionShape(
        "0.4.6.post5", pools_on_batch=True, tp_on_runner=True,
        foreign_writers=("transfer", "transfer_per_layer"),
        graph_methods=("init_forward_metadata_capture_cuda_graph",
                       "init_forward_metadata_replay_cuda_graph"),
        server_flags=dict(disable_cuda_graph=False)),
    "0.5.4.post3": VersionShape(
        "0.5.4.post3", pools_on_batch=True, tp_on_runner=True, foreign_writers=("load_cpu_copy",),
        graph_methods=("init_forward_metadata_capture_cuda_graph",
                       "init_forward_metadata_replay_cuda_graph"),
        server_flags=dict(disable_cuda_graph=False, enable_piecewise_cuda_graph=False,
                          prefill_attention_backend=None, decode_attention_backend=None)),
    "0.5.12": VersionShape(
        "0.5.12", pools_on_batch=True, tp_on_runner=True, foreign_writers=("load_cpu_copy",),
        graph_methods=("init_forward_metadata_capture_cuda_graph",
                       "init_forward_metadata_replay_cuda_graph"),
        server_flags=dict(disable_cuda_graph=False, disable_piecewise_cuda_graph=False,
                          enable_breakable_cuda_graph=False, prefill_attention_backend=None,
                          decode_attention_backend=None)),
    "0.5.18": VersionShape(
        "0.5.18", pools_on_batch=False, tp_on_runner=False,
        foreign_writers=("move_kv_cache", "load_cpu_copy"),
        graph_methods=("init_forward_metadata_out_graph", "_apply_cuda_graph_metadata"),
        server_flags=dict(disable_cuda_graph=False, dcp_size=1, prefill_attention_backend=None,
                          decode_attention_backend=None),
        graph_config=True),
    "0.5.23": VersionShape(
        "0.5.23", pools_on_batch=False, tp_on_runner=False, kv_write_loc=True,
        layer_id_override=True, translator=True,
        foreign_writers=("move_kv_cache", "load_cpu_copy"),
        graph_methods=("init_forward_metadata_out_graph", "_apply_cuda_graph_metadata"),
        server_flags=dict(disable_cuda_graph=False, dcp_size=1, attn_dp_size=1,
                          prefill_attention_backend=None, decode_attention_backend=None),
        graph_config=True),
}

ForwardMode = enum.Enum("ForwardMode", "EXTEND DECODE MIXED IDLE TARGET_VERIFY DRAFT_EXTEND")


def bf16(values):
    return kvdump.bf16_bits_from_float32(np.asarray(values, dtype=np.float32))


def f32(bits):
    return kvdump.float32_from_bf16_bits(bits)


# --- torch's module hook protocol ------------------------------------------------------------


class _Handle:
    def __init__(self, table, key):
        self.table, self.key = table, key

    def remove(self):
        self.table.pop(self.key, None)


class Module:
    """torch.nn.Module's hook protocol: pre-hooks (module, args, kwargs), forward hooks
    (module, args, kwargs, output), both with_kwargs=True, run around forward()."""

    _next = 0

    def __init__(self):
        self.pre_hooks, self.post_hooks = {}, {}

    def _add(self, table, hook, with_kwargs):
        assert with_kwargs, "the capture registers its hooks with_kwargs=True"
        Module._next += 1
        table[Module._next] = hook
        return _Handle(table, Module._next)

    def register_forward_pre_hook(self, hook, with_kwargs=False):
        return self._add(self.pre_hooks, hook, with_kwargs)

    def register_forward_hook(self, hook, with_kwargs=False):
        return self._add(self.post_hooks, hook, with_kwargs)

    def __call__(self, *args, **kwargs):
        for hook in tuple(self.pre_hooks.values()):
            changed = hook(self, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        output = self.forward(*args, **kwargs)
        for hook in tuple(self.post_hooks.values()):
            changed = hook(self, args, kwargs, output)
            if changed is not None:
                output = changed
        return output


# --- memory pools ----------------------------------------------------------------------------


class KVWriteLoc:
    def __init__(self, loc):
        self.loc = loc

    @classmethod
    def for_batch(cls, forward_batch):
        return cls(forward_batch.out_cache_loc)


class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)


class MLATokenToKVPool:
    """memory_pool.py: one [size + page_size, 1, D] buffer per layer; writes cast bf16 to e4m3fn
    without a scale (modelled with kvdump's satfinite rule: the fakes' values stay small)."""

    def __init__(self, shape, size, num_layers, dtype="torch.float8_e4m3fn"):
        self.shape = shape
        self.size, self.page_size, self.dtype = size, 1, dtype
        self.kv_lora_rank, self.qk_rope_head_dim = DC, DR
        store = np.uint8 if dtype == "torch.float8_e4m3fn" else np.uint16
        self.kv_buffer = [np.zeros((size + 1, 1, D), dtype=store) for _ in range(num_layers)]
        for name in shape.foreign_writers:
            setattr(self, name, self._foreign)

    def _foreign(self, *args, **kwargs):
        self.foreign_calls = getattr(self, "foreign_calls", 0) + 1

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]

    def values(self, layer_id):
        """The pool read back as the backend reads it (.to(bf16)): float32 [size + 1, D]."""
        rows = self.kv_buffer[layer_id][:, 0, :]
        return kvdump.decode_e4m3(rows) if rows.dtype == np.uint8 else f32(rows)

    def _store(self, layer_id, loc, bits):
        loc = np.asarray(getattr(loc, "loc", loc))
        if self.kv_buffer[layer_id].dtype == np.uint8:
            bits = kvdump.quantize_e4m3(f32(bits), 1.0)
        self.kv_buffer[layer_id][loc, 0, :] = bits

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope, layer_id_override=None):
        assert layer_id_override is None or self.shape.layer_id_override
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        rows = len(cache_k_nope)
        self._store(layer_id, loc, np.concatenate([cache_k_nope.reshape(rows, DC),
                                                   cache_k_rope.reshape(rows, DR)], axis=1))

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, layer_id_override=None):
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        self._store(layer_id, loc, cache_k.reshape(len(cache_k), D))


# --- FlashInfer's MLA wrapper and SGLang's backend -------------------------------------------


class BatchMLAPagedAttentionWrapper:
    """plan()/run() as SGLang calls them; run() computes exact attention (float64) on the bf16
    views it is given and returns out as bf16 bits and lse in base 2, as FlashInfer does."""

    def __init__(self):
        self.runs = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        self._qo_indptr, self._kv_indptr = np.asarray(qo_indptr), np.asarray(kv_indptr)
        self._kv_indices = np.asarray(kv_indices)
        self._page_size, self._causal, self._sm_scale = page_size, causal, sm_scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        self.runs += 1
        q = np.concatenate([f32(q_nope), f32(q_pe)], axis=-1).astype(np.float64)
        kv = np.concatenate([f32(ckv_cache), f32(kpe_cache)], axis=-1)[:, 0, :]
        result = np.zeros((q.shape[0], q.shape[1], DC), dtype=np.float64)
        lse2 = np.zeros(q.shape[:2], dtype=np.float64)
        for b in range(len(self._qo_indptr) - 1):
            pages = self._kv_indices[self._kv_indptr[b]:self._kv_indptr[b + 1]]
            tokens = kv[pages].astype(np.float64)
            first, last = self._qo_indptr[b], self._qo_indptr[b + 1]
            for j, i in enumerate(range(first, last)):
                visible = len(tokens) - (last - first) + j + 1 if self._causal else len(tokens)
                s = self._sm_scale * tokens[:visible] @ q[i].T  # [visible, H]
                peak = s.max(axis=0)
                weights = np.exp(s - peak)
                total = weights.sum(axis=0)
                result[i] = (weights / total).T @ tokens[:visible, :DC]
                lse2[i] = (peak + np.log(total)) / np.log(2.0)
        out_bits = bf16(result.astype(np.float32))
        return (out_bits, lse2.astype(np.float32)) if return_lse else out_bits


@dataclass
class DecodeMetadata:
    decode_wrapper: object


@dataclass
class PrefillMetadata:
    prefill_wrapper: object
    use_ragged: bool


class Translator:
    is_translating = False


class FlashInferMLAAttnBackend:
    """flashinfer_mla_backend.py: plans page size 1 (causal for extends, with model_config.scaling)
    and, in forward_*, writes the pool then runs the planned wrapper on pool.to(bf16)."""

    def __init__(self, shape, pool, requests):
        self.shape = shape
        self.decode_wrapper = BatchMLAPagedAttentionWrapper()
        self.prefill_wrapper_paged = BatchMLAPagedAttentionWrapper()
        self.prefill_wrapper_verify = BatchMLAPagedAttentionWrapper()
        if not shape.pools_on_batch:  # 0.5.18 on: pool refs captured at construction
            self.token_to_kv_pool, self.req_to_token_pool = pool, requests
        if shape.translator:
            self.kv_index_translator = Translator()
        self._pool, self._requests = pool, requests
        self.graph_calls = 0
        for name in shape.graph_methods:
            setattr(self, name, self._graph)

    def _graph(self, *args, **kwargs):
        self.graph_calls += 1

    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.name == "IDLE":
            return
        table = self._requests.req_to_token
        seq_lens = np.asarray(forward_batch.seq_lens)
        kv_indptr = np.concatenate([[0], np.cumsum(seq_lens)])
        kv_indices = np.concatenate([table[r, :n] for r, n in
                                     zip(forward_batch.req_pool_indices, seq_lens)])
        name = forward_batch.forward_mode.name
        if name == "DECODE":
            qo_indptr, wrapper, causal = np.arange(len(seq_lens) + 1), self.decode_wrapper, False
            self.forward_metadata = DecodeMetadata(wrapper)
        else:
            rows = forward_batch.extend_seq_lens if name != "TARGET_VERIFY" else \
                [forward_batch.draft_tokens] * len(seq_lens)
            qo_indptr = np.concatenate([[0], np.cumsum(rows)])
            wrapper = (self.prefill_wrapper_verify if name == "TARGET_VERIFY"
                       else self.prefill_wrapper_paged)
            causal = True
            self.forward_metadata = PrefillMetadata(wrapper, False)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens, H, DC, DR, 1, causal, SM_SCALE,
                     "bf16", "bf16")

    def pool(self, forward_batch):
        if self.shape.pools_on_batch:
            return forward_batch.token_to_kv_pool
        return self.token_to_kv_pool

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                k_rope=None):
        pool = self.pool(forward_batch)
        if save_kv_cache and k is not None:
            loc = (KVWriteLoc.for_batch(forward_batch) if self.shape.kv_write_loc
                   else forward_batch.out_cache_loc)
            pool.set_mla_kv_buffer(layer, loc, k, k_rope)
        k_buf = bf16(pool.values(layer.layer_id))[:, None, :]  # get_key_buffer(...).to(q.dtype)
        q_nope = q.reshape(-1, H, DC)
        metadata = self.forward_metadata
        wrapper = getattr(metadata, "decode_wrapper", None) or metadata.prefill_wrapper
        out = wrapper.run(q_nope, q_rope.reshape(-1, H, DR), k_buf[:, :, :DC], k_buf[:, :, DC:],
                          out=np.empty_like(q_nope))
        return out.reshape(-1, H * DC)


# --- the model -------------------------------------------------------------------------------


class RadixAttention(Module):
    def __init__(self, world, layer_id, head_dim, v_head_dim):
        super().__init__()
        self.world = world
        self.layer_id, self.tp_q_head_num = layer_id, H
        self.qk_head_dim, self.head_dim, self.v_head_dim = head_dim, head_dim, v_head_dim
        self.scaling, self.logit_cap, self.k_scale_float = SM_SCALE, 0.0, None

    def forward(self, q, k, v, forward_batch, save_kv_cache=True, **kwargs):
        backend = (forward_batch.attn_backend if self.world.shape.pools_on_batch
                   else self.world.context.get_attn_backend())
        if self.v_head_dim != DC:  # attn_mha: ragged MHA on the step's own bf16 k/v
            return np.zeros((q.shape[0], H * self.v_head_dim), dtype=np.uint16)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache, **kwargs)


class DeepseekV2AttentionMLA(Module):
    def __init__(self, world, layer_id, rng):
        super().__init__()
        self.world, self.layer_id = world, layer_id
        self.qk_nope_head_dim, self.use_deep_gemm_bmm = DN, False
        self.attn_mqa = RadixAttention(world, layer_id, D, DC)
        self.attn_mha = RadixAttention(world, layer_id, DN + DR, 10)
        self.w_kc = bf16(rng.standard_normal((H, DN, DC)) * 0.3)

    def pool(self, forward_batch):
        if self.world.shape.pools_on_batch:
            return forward_batch.token_to_kv_pool
        return self.world.context.get_token_to_kv_pool()

    def forward(self, positions, hidden_states, forward_batch, zero_allocator):
        inputs = hidden_states
        if forward_batch.forward_mode.name == "IDLE":
            return None
        if inputs["path"] == "mla":
            return self.attn_mqa(inputs["q_nope"], inputs["k_nope"], inputs["k_nope"],
                                 forward_batch, q_rope=inputs["q_pe"], k_rope=inputs["k_pe"])
        loc = (KVWriteLoc.for_batch(forward_batch) if self.world.shape.kv_write_loc
               else forward_batch.out_cache_loc)
        self.pool(forward_batch).set_mla_kv_buffer(self.attn_mha, loc, inputs["k_nope"],
                                                   inputs["k_pe"])
        return self.attn_mha(inputs["q_mha"], None, None, forward_batch, save_kv_cache=False)


class Model:
    def __init__(self, world, num_layers, rng):
        layers = [types.SimpleNamespace(self_attn=DeepseekV2AttentionMLA(world, i, rng))
                  for i in range(num_layers)]
        self.model = types.SimpleNamespace(layers=layers)


# --- the module objects the capture imports --------------------------------------------------


class ForwardContextModule(types.ModuleType):
    """model_executor/forward_context.py (0.5.18 on)."""

    def __init__(self):
        super().__init__("sglang.srt.model_executor.forward_context")
        self.current = None

    def has_forward_context(self):
        return self.current is not None

    def get_attn_backend(self):
        return self.current

    def get_token_to_kv_pool(self):
        return self.current.token_to_kv_pool

    def get_req_to_token_pool(self):
        return self.current.req_to_token_pool


class RuntimeContextModule(types.ModuleType):
    def __init__(self, tp_rank):
        super().__init__("sglang.srt.runtime_context")
        self._parallel = types.SimpleNamespace(tp_rank=tp_rank)

    def get_parallel(self):
        return self._parallel


@dataclass
class ForwardBatch:
    forward_mode: object
    batch_size: int
    req_pool_indices: np.ndarray
    seq_lens: np.ndarray
    out_cache_loc: np.ndarray
    extend_seq_lens: object = None
    extend_prefix_lens: object = None
    extend_seq_lens_cpu: object = None
    extend_prefix_lens_cpu: object = None
    global_num_tokens_cpu: object = None
    spec_info: object = None
    draft_tokens: int = 0


def server_args(shape, **changes):
    """The server args of a capture-ready launch of that release, changed by `changes`."""
    args = dict(attention_backend="flashinfer", speculative_algorithm=None,
                enable_hierarchical_cache=False, enable_dp_attention=False,
                enable_two_batch_overlap=False, enable_torch_compile=False,
                disaggregation_mode="null", flashinfer_mla_disable_ragged=True)
    args.update(shape.server_flags)
    args["disable_cuda_graph"] = True
    if "disable_piecewise_cuda_graph" in args:
        args["disable_piecewise_cuda_graph"] = True
    if shape.graph_config:
        phase = types.SimpleNamespace(backend="disabled")
        args["cuda_graph_config"] = types.SimpleNamespace(decode=phase, prefill=phase)
    args.update(changes)
    return types.SimpleNamespace(**args)


# --- a server --------------------------------------------------------------------------------


class World:
    """One TP worker of a given release: pools, backend, model, and a scheduler that allocates
    one slot per token (slot 0 is SGLang's dummy slot) and runs forward batches."""

    def __init__(self, version, num_layers=2, pool_dtype="torch.float8_e4m3fn", seed=0,
                 tp_rank=0):
        self.shape = VERSIONS[version]
        self.rng = np.random.default_rng(seed)
        self.context = ForwardContextModule() if not self.shape.pools_on_batch else None
        self.runtime_context = (RuntimeContextModule(tp_rank) if not self.shape.tp_on_runner
                                else None)
        self.requests = ReqToTokenPool(8, 64)
        self.pool = MLATokenToKVPool(self.shape, 200, num_layers, pool_dtype)
        self.backend = FlashInferMLAAttnBackend(self.shape, self.pool, self.requests)
        self.model = Model(self, num_layers, self.rng)
        self.num_layers = num_layers
        self.next_slot = 1
        self.lengths = {}  # request index -> tokens held
        self.tp_rank = tp_rank
        self.steps = []  # per step: {layer: inputs and outputs}
        self.batches = []
        self.server_args = server_args(self.shape)
        self.model_config = types.SimpleNamespace(
            model_path="fake/DeepSeek-V3", hf_config=types.SimpleNamespace(
                architectures=["DeepseekV3ForCausalLM"]))

    def api(self):
        from kvdump.sglang_capture import SglangApi

        return SglangApi(self.shape.version, self.context, self.runtime_context)

    def _allocate(self, request, count):
        start = self.lengths.get(request, 0)
        slots = np.arange(self.next_slot, self.next_slot + count)
        self.next_slot += count
        self.requests.req_to_token[request, start:start + count] = slots
        self.lengths[request] = start + count
        return slots

    def _inputs(self, rows, path):
        rng = self.rng
        q_pe = bf16(rng.standard_normal((rows, H, DR)))
        inputs = dict(path=path, q_pe=q_pe, k_nope=bf16(rng.standard_normal((rows, 1, DC))),
                      k_pe=bf16(rng.standard_normal((rows, 1, DR))))
        if path == "mla":
            inputs["q_nope"] = bf16(rng.standard_normal((rows, H, DC)))
        else:
            q_nope = bf16(rng.standard_normal((rows, H, DN)))
            inputs["q_mha"] = np.concatenate([q_nope, q_pe], axis=-1)
        return inputs

    def _batch(self, mode, requests, new_tokens):
        prefix = [self.lengths.get(r, 0) for r in requests]
        slots = np.concatenate([self._allocate(r, n) for r, n in zip(requests, new_tokens)])
        batch = ForwardBatch(ForwardMode[mode], len(requests), np.asarray(requests),
                             np.asarray([self.lengths[r] for r in requests]), slots)
        if mode != "DECODE":
            batch.extend_seq_lens = np.asarray(new_tokens)
            batch.extend_prefix_lens = np.asarray(prefix)
            batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu = list(new_tokens), prefix
        if self.shape.pools_on_batch:
            batch.token_to_kv_pool, batch.req_to_token_pool = self.pool, self.requests
            batch.attn_backend = self.backend
        return batch

    def run(self, batch, path="mla"):
        """Runs every layer on `batch` as ModelRunner.forward does; returns {layer: record}."""
        rows = len(batch.out_cache_loc)
        step = {}
        if self.context is not None:
            self.context.current = self.backend
        try:
            self.backend.init_forward_metadata(batch)
            for layer_id, layer in enumerate(self.model.model.layers):
                inputs = self._inputs(rows, path)
                out = layer.self_attn(positions=None, hidden_states=inputs, forward_batch=batch,
                                      zero_allocator=None)
                step[layer_id] = dict(inputs, out=out)
        finally:
            if self.context is not None:
                self.context.current = None
        self.steps.append(step)
        self.batches.append(batch)
        return step

    def prefill(self, lengths, path="mla"):
        requests = list(range(len(lengths))) if not self.lengths else \
            [max(self.lengths) + 1 + i for i in range(len(lengths))]
        return self.run(self._batch("EXTEND", requests, list(lengths)), path)

    def extend(self, requests, new_tokens, path="mla"):
        return self.run(self._batch("EXTEND", requests, new_tokens), path)

    def decode(self, requests):
        return self.run(self._batch("DECODE", requests, [1] * len(requests)))

    def verify(self, requests, draft_tokens=2):
        batch = self._batch("TARGET_VERIFY", requests, [draft_tokens] * len(requests))
        batch.extend_seq_lens = batch.extend_seq_lens_cpu = None  # as ForwardBatch.init_new does
        batch.draft_tokens = draft_tokens
        return self.run(batch)

    def idle(self):
        batch = ForwardBatch(ForwardMode.IDLE, 0, np.zeros(0, np.int64), np.zeros(0, np.int64),
                             np.zeros(0, np.int64))
        if self.shape.pools_on_batch:
            batch.token_to_kv_pool, batch.req_to_token_pool = self.pool, self.requests
            batch.attn_backend = self.backend
        return self.run(batch)

    def capture(self, path, layer_ids=(0, 1), **options):
        from kvdump.sglang_capture import MlaCapture

        modules = {i: self.model.model.layers[i].self_attn for i in layer_ids}
        return MlaCapture(modules, path, model="fake/DeepSeek-V3", producer="fakes", api=self.api(),
                          **options).install()


def reference_lse(world, batch_rows, q_nope_bits, q_pe_bits, layer_id, tokens):
    """Natural-log lse of one query row over `tokens` (slots), from the pool read back: the tests'
    own float64 computation, not the capture's."""
    kv = world.pool.values(layer_id)[tokens].astype(np.float64)
    q = np.concatenate([f32(q_nope_bits), f32(q_pe_bits)], axis=-1).astype(np.float64)
    s = SM_SCALE * kv @ q.T
    peak = s.max(axis=0)
    return peak + np.log(np.exp(s - peak).sum(axis=0))
