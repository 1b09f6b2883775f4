"""Capture a kvdump from the model's own attention code: Hugging Face transformers' GLM-5
(`models/glm_moe_dsa`, GlmMoeDsaAttention with its DSA indexer) or DeepSeek-V3.2
(`models/deepseek_v32`, DeepseekV32Attention), built from a configuration with seeded weights (or
one layer's weights from a checkpoint's safetensors files), run in float64 through a prefill of a
prefix, one extend step and decode steps, and written as kvaudit replays it.

    python -m kvdump.hf_capture --model glm5 --config tiny --out glm5_hf.h5
    python -m kvdump.hf_capture --model glm5 --config real --layers 0,1 --out glm5_real.h5

What the module computes (expanded, non-absorbed MLA; H heads, Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim, Dc = kv_lora_rank; x the layer's input):
    c_t   = RMSNorm_eps=1e-6(kv_a_proj(x_t)[:Dc])                       [Dc]   the latent
    r_t   = RoPE(kv_a_proj(x_t)[Dc:])                                  [Dr]   de-interleaved
    k_t,h = W_UK[h] c_t (+) r_t,  v_t,h = W_UV[h] c_t                  kv_b_proj.weight viewed
            [H, Dn + Dv, Dc]: W_UK[h] = rows 0..Dn-1, W_UV[h] = rows Dn..Dn+Dv-1
    s     = module.scaling * (q_nope . k_nope + q_pe . r)              scaling = qk_head_dim^-0.5
                                                                       (x mscale^2 with YaRN's
                                                                       mscale_all_dim)
    o_i,h = sum_t softmax(s)_t v_t,h  over the indexer's top-k of the visible tokens
What the dump holds (kvaudit's absorbed form, docs/kvdump-v1.md "Semantics"):
    kv row   = (c_t, P r_t)      P: the interleave permutation, so the RoPE part is in the layout
                                 servers store (pairs (x0, x1), (x2, x3), ...); the module returns
                                 it de-interleaved (even elements, then odd). q_pe gets the same P:
                                 q_pe . r is unchanged.
    q_nope   = q_nope_module[h] @ W_UK[h]   [H, Dc], the absorbed query
    q_pe     = P q_pe_module                [H, Dr]
    sm_scale = module.scaling, read from the module
    topk_indices = the indexer's top-k per row, entries past the row's own position written -1
and beside it, in FILE.module.h5 (`module_side_file`), what kvaudit's latent output maps to:
    /layers/L###/w_uv [H, Dv, Dc] float64 (and w_uk, o_proj_weight when small)
    /steps/S###/L###/attn_output [Nq, H, Dv] float64: the module's attention output (o_proj's
                                 input), and layer_output [Nq, hidden]: o_proj's output
so that W_UV[h] @ (kvaudit's out[i, h, :]) must equal attn_output[i, h, :].

The kv rows and kv_source are stored as float32 (the writer's float32_inputs), q as bf16 (what a
server's kernel reads; a kernel check on float32 q would charge the kernel with rounding q) or,
with --q-dtype float32, as float32 (for the agreement with the module), the pool as
e4m3 codes by the kvdump write rule with a per-tensor kv_scale = fp32(amax / 448) per layer, page
size 1 (slot = position).

Latent statistics: random weights give a latent without the outlier channels a trained model's
has. The module is shaped so that FP8 costs what it costs there: the latent RMSNorm weight
(kv_a_layernorm.weight) is drawn in [0.5, 1.5) and `--outlier-channels N` of its channels are
multiplied by `--outlier-gain G` (defaults 8 and 16: a handful of channels 10-20x the others set
amax and so the per-tensor scale, as in DeepSeek-V3's and GLM-5's caches, and as
`kvaudit synth`'s value model assumes); the RoPE rows of kv_a_proj_with_mqa are multiplied by
`--rope-gain R` (default 2). With `--weights`, the checkpoint's own values are used unchanged.
"""

import argparse
import json
import math
import os
import sys

import numpy as np

from .codec import bf16_bits_from_float32, quantize_e4m3
from .writer import KvDumpWriter
from .cli_args import layer_list

MODELS = ("glm5", "deepseek-v32")
E4M3_MAX = 448.0


class CaptureError(Exception):
    """Bad input: printed as one line, exit 2."""


# ---- configurations -----------------------------------------------------------------------------

def _yarn(factor=40.0, mscale_all_dim=1.0):
    # DeepSeek-V3 / V3.2's rope_scaling (config.json): YaRN, factor 40 over 4096 positions.
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "mscale": 1.0,
            "mscale_all_dim": mscale_all_dim, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0}


def model_config(model, size, num_layers, index_topk=None, rope=None):
    """The transformers config of `model` ("glm5" or "deepseek-v32"): `size` "real" (the model's
    own attention dimensions: GLM-5 64 heads, 192 + 64, v 256; DeepSeek-V3.2 128 heads,
    128 + 64, v 128, YaRN with mscale_all_dim 1) or "tiny" (the same structure, small widths,
    for CI). rope: a rope_parameters dict replacing the default."""
    transformers = _import_transformers()
    if size not in ("real", "tiny"):
        raise CaptureError(f"--config: '{size}' is not real or tiny")
    common = {"num_hidden_layers": num_layers, "indexer_types": ["full"] * num_layers}
    if size == "tiny":
        common.update(hidden_size=64, q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=48,
                      qk_rope_head_dim=16, v_head_dim=32, num_attention_heads=4,
                      num_key_value_heads=4, index_n_heads=2, index_head_dim=32, index_topk=8,
                      max_position_embeddings=163840)
    if model == "glm5":
        config_class = transformers.GlmMoeDsaConfig
    elif model == "deepseek-v32":
        config_class = transformers.DeepseekV32Config
        common.setdefault("rope_parameters", _yarn())
        common.setdefault("max_position_embeddings", 163840)
    else:
        raise CaptureError(f"--model: '{model}' is not one of {', '.join(MODELS)}")
    if index_topk is not None:
        common["index_topk"] = index_topk
    if rope is not None:
        common["rope_parameters"] = rope
    config = config_class(**common)
    # SDPA keeps float64 throughout; the eager path rounds the softmax to float32.
    config._attn_implementation = "sdpa"
    return config


def _import_transformers():
    try:
        import transformers
    except ImportError as error:
        raise CaptureError("needs transformers (pip install 'kvaudit-kvdump[hf]'): "
                           f"{error}") from error
    return transformers


def _modeling(model):
    if model == "glm5":
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as modeling
        return modeling, modeling.GlmMoeDsaAttention, modeling.GlmMoeDsaRotaryEmbedding
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling
    return modeling, modeling.DeepseekV32Attention, modeling.DeepseekV32RotaryEmbedding


# ---- the module ---------------------------------------------------------------------------------

def build_attention(model, config, layer_idx, seed, outlier_channels=8, outlier_gain=16.0,
                    rope_gain=2.0, weights=None, weight_prefix=None):
    """The attention module of layer `layer_idx` in float64: seeded weights shaped as the module
    docstring says, or the layer's weights from `weights` (safetensors files) under
    `weight_prefix` (default "model.layers.{layer}.self_attn.")."""
    import torch

    _, attention_class, _ = _modeling(model)
    torch.manual_seed(seed * 1000003 + layer_idx)
    attention = attention_class(config, layer_idx)
    if weights:
        _load_layer_weights(attention, weights, (weight_prefix or
                                                 "model.layers.{layer}.self_attn.").format(
                                                     layer=layer_idx))
    else:
        _shape_latent_statistics(attention, config, outlier_channels, outlier_gain, rope_gain)
    return attention.to(torch.float64).eval()


def _shape_latent_statistics(attention, config, outlier_channels, outlier_gain, rope_gain):
    import torch

    dc = config.kv_lora_rank
    with torch.no_grad():
        norm = attention.kv_a_layernorm.weight
        norm.copy_(0.5 + torch.rand(dc))
        if outlier_channels > 0:
            channels = torch.randperm(dc)[:min(outlier_channels, dc)]
            norm[channels] *= outlier_gain
        attention.kv_a_proj_with_mqa.weight[dc:] *= rope_gain


def _load_layer_weights(attention, files, prefix):
    try:
        from safetensors.numpy import load_file
    except ImportError as error:
        raise CaptureError(f"--weights needs safetensors: {error}") from error
    import torch

    state = {}
    for path in files:
        if not os.path.exists(path):
            raise CaptureError(f"--weights {path}: no such file")
        for name, value in load_file(path).items():
            if name.startswith(prefix):
                state[name[len(prefix):]] = torch.from_numpy(np.array(value, dtype=np.float64))
    quantized = sorted(name for name in state if name.endswith("scale_inv"))
    if quantized:
        raise CaptureError(f"--weights: {quantized[0]} under {prefix}: FP8 block-quantized weights "
                           "are not dequantized here; give a bf16 checkpoint's files")
    missing = sorted(set(attention.state_dict()) - set(state))
    if missing:
        raise CaptureError(f"--weights: no {prefix}{missing[0]} in {', '.join(files)} "
                           f"({len(missing)} of the module's tensors missing)")
    attention.load_state_dict({k: v for k, v in state.items() if k in attention.state_dict()})


class _Recorder:
    """What one forward of the attention module computed: its query parts after RoPE, the
    indexer's top-k, o_proj's input and output. Hooks on the module's own submodules, and a
    wrapper around the RoPE function its forward calls (restored on close)."""

    def __init__(self, model, attention):
        self.modeling, _, _ = _modeling(model)
        self.attention = attention
        self.calls = {}
        self._original_rope = self.modeling.apply_rotary_pos_emb_interleave
        self.modeling.apply_rotary_pos_emb_interleave = self._rope
        # DeepSeek-V3.2's indexer rotates with the half-split RoPE, GLM-5's with the interleaved.
        self._original_half_rope = getattr(self.modeling, "apply_rotary_pos_emb", None)
        if self._original_half_rope is not None:
            self.modeling.apply_rotary_pos_emb = self._half_rope
        self._hooks = [
            attention.q_b_proj.register_forward_hook(self._keep("q_states")),
            attention.o_proj.register_forward_hook(self._keep_o_proj),
        ]
        indexer = getattr(attention, "indexer", None)
        if indexer is not None:
            self._hooks += [indexer.register_forward_hook(self._keep("topk")),
                            indexer.wq_b.register_forward_hook(self._keep("index_q")),
                            indexer.k_norm.register_forward_hook(self._keep("index_k")),
                            indexer.weights_proj.register_forward_hook(self._keep("index_w"))]

    def _rope(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q_embed, k_embed = self._original_rope(q, k, cos, sin, position_ids, unsqueeze_dim)
        if unsqueeze_dim == 1 and q.dim() == 4 and q.shape[1] == self.attention.num_heads:
            self.calls["q_rot"] = q_embed  # the attention's call, not the indexer's
        self._keep_indexer_rope(q_embed, k_embed, unsqueeze_dim)
        return q_embed, k_embed

    def _half_rope(self, *args, **kwargs):
        q_embed, k_embed = self._original_half_rope(*args, **kwargs)
        self._keep_indexer_rope(q_embed, k_embed, kwargs.get("unsqueeze_dim", 1))
        return q_embed, k_embed

    def _keep_indexer_rope(self, q_embed, k_embed, unsqueeze_dim):
        if unsqueeze_dim == 2:  # the indexer's call: [B, S, H_I, Dr] and [B, S, 1, Dr]
            self.calls["index_q_rot"], self.calls["index_k_rot"] = q_embed, k_embed

    def indexer_inputs(self):
        """The indexer's query [S, H_I, D_I], key rows [S, D_I] and head weights [S, H_I] as
        its forward forms them (RoPE part first; weights times H_I^-0.5), float64 numpy; None
        without an indexer call."""
        if "index_q" not in self.calls or "index_q_rot" not in self.calls:
            return None
        indexer = self.attention.indexer
        heads, dim, dr = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
        q = self.calls["index_q"][0].reshape(-1, heads, dim)
        q = np.concatenate([self.calls["index_q_rot"][0].numpy(), q[..., dr:].numpy()], axis=-1)
        k = self.calls["index_k"][0]
        k = np.concatenate([self.calls["index_k_rot"][0, :, 0].numpy(), k[:, dr:].numpy()],
                           axis=-1)
        weights = self.calls["index_w"][0].numpy() * heads ** -0.5
        return q.copy(), k.copy(), weights.copy()

    def _keep(self, name):
        def hook(module, inputs, output):
            self.calls[name] = output[0] if isinstance(output, tuple) else output
        return hook

    def _keep_o_proj(self, module, inputs, output):
        self.calls["attn_output"] = inputs[0]
        self.calls["layer_output"] = output

    def take(self):
        calls, self.calls = self.calls, {}
        return calls

    def close(self):
        self.modeling.apply_rotary_pos_emb_interleave = self._original_rope
        if self._original_half_rope is not None:
            self.modeling.apply_rotary_pos_emb = self._original_half_rope
        for hook in self._hooks:
            hook.remove()


def interleave_permutation(dr):
    """P with server[j] = module[P[j]]: the module returns (x0', x2', ..., x1', x3', ...)."""
    half = dr // 2
    permutation = np.empty(dr, dtype=np.int64)
    permutation[0::2] = np.arange(half)
    permutation[1::2] = half + np.arange(half)
    return permutation


def run_module(model, config, attention, hidden, chunks):
    """Runs `attention` over hidden [T, hidden] in the given chunks (lengths, summing to T) with
    one cache, as a server runs a prefill then extend and decode steps. Returns per chunk a dict of
    float64 numpy arrays: q_pass [S, H, Dn], q_rot [S, H, Dr] (module layout), topk [S, K] or
    None, attn_output [S, H, Dv], layer_output [S, hidden]; and the cached latent [T, Dc] and
    RoPE rows [T, Dr] (module layout) after the last chunk."""
    import torch
    from transformers import DynamicCache

    _, _, rotary_class = _modeling(model)
    rotary = rotary_class(config)
    cache = DynamicCache(config=config)
    recorder = _Recorder(model, attention)
    heads, dn, dv = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
    results, start = [], 0
    try:
        with torch.no_grad():
            for length in chunks:
                x = torch.as_tensor(hidden[None, start:start + length], dtype=torch.float64)
                positions = torch.arange(start, start + length)[None]
                cos, sin = rotary(x, positions)
                visible = torch.arange(start + length)[None, :] <= positions[0, :, None]
                mask = torch.zeros(1, 1, length, start + length, dtype=torch.float64)
                mask.masked_fill_(~visible[None], torch.finfo(torch.float64).min)
                attention(x, (cos, sin), mask, cache=cache, position_ids=positions)
                indexer_inputs = recorder.indexer_inputs()
                calls = recorder.take()
                q_states = calls["q_states"][0].view(length, heads, -1)
                topk = calls.get("topk")
                results.append({
                    "q_pass": q_states[..., :dn].numpy().copy(),
                    "q_rot": calls["q_rot"][0].transpose(0, 1).numpy().copy(),
                    "topk": None if topk is None else topk[0].numpy().astype(np.int64),
                    "attn_output": calls["attn_output"][0].view(length, heads, dv).numpy().copy(),
                    "layer_output": calls["layer_output"][0].numpy().copy(),
                    "indexer": indexer_inputs,
                })
                start += length
    finally:
        recorder.close()
    layer = cache.layers[attention.layer_idx]
    return results, layer.keys[0, 0].numpy().copy(), layer.values[0, 0].numpy().copy()


# ---- the dump -----------------------------------------------------------------------------------

def module_side_file(dump_path):
    """Where the capture writes what the module computed beyond the dump (W_UV, its outputs)."""
    return os.fspath(dump_path) + ".module.h5"


def absorb_query(q_pass, w_uk):
    """The absorbed query [S, H, Dc] = q_nope[s, h, :] @ W_UK[h] (W_UK [H, Dn, Dc]): q_nope .
    (W_UK c) = (q_nope W_UK) . c."""
    return np.einsum("shn,hnc->shc", q_pass, w_uk)


def _topk_rows(topk, positions, width):
    """[S, width] int32: each row's top-k with entries past its own position (tokens the causal
    mask hides; the indexer ranks them last when it must return more than the row sees) -1."""
    rows = np.full((len(positions), width), -1, dtype=np.int32)
    for i, position in enumerate(positions):
        picked = [int(p) for p in topk[i] if 0 <= p <= position]
        rows[i, :len(picked)] = picked
    return rows


def capture(out, model="glm5", size="tiny", layers=(0,), prefix_tokens=24, extend_tokens=8,
            decode_steps=3, seed=1, index_topk=None, rope=None, outlier_channels=8,
            outlier_gain=16.0, rope_gain=2.0, weights=None, weight_prefix=None, log=None,
            q_dtype="bfloat16"):
    """Builds, runs and writes (see the module docstring). Returns a summary dict.
    q_dtype: "bfloat16" stores q_nope and q_pe as a server hands them to its kernel (a kernel
    check judges the kernel on the bf16 q it must read); "float32" keeps them to 2^-24, for the
    agreement of kvaudit's reference with the module."""
    if q_dtype not in ("bfloat16", "float32"):
        raise CaptureError(f"--q-dtype: '{q_dtype}' is not bfloat16 or float32")
    import transformers

    num_layers = max(layers) + 1
    config = model_config(model, size, num_layers, index_topk, rope)
    total = prefix_tokens + extend_tokens + decode_steps
    chunks = [prefix_tokens, extend_tokens] + [1] * decode_steps
    if prefix_tokens < 1 or extend_tokens < 1 or decode_steps < 0:
        raise CaptureError("--prefix-tokens and --extend-tokens must be >= 1, --decode-steps >= 0")
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((total, config.hidden_size))
    per_layer = {}
    for layer in layers:
        attention = build_attention(model, config, layer, seed, outlier_channels, outlier_gain,
                                    rope_gain, weights, weight_prefix)
        results, latent, rope_rows = run_module(model, config, attention, hidden, chunks)
        per_layer[layer] = (_ModuleWeights(attention), results, latent, rope_rows)
        del attention  # a real-size layer is about 1.4 GB in float64
        if log:
            log(f"hf_capture: layer {layer}: module run over {total} tokens in {len(chunks)} calls")
    first = per_layer[layers[0]][0]
    attrs = _model_attributes(config)
    indexer_runs = {layer: [r["indexer"] for r in per_layer[layer][1]] for layer in layers}
    _write_dump(out, model, config, first, layers, per_layer, chunks, attrs,
                transformers.__version__, q_dtype)
    if all(run[0] is not None for run in indexer_runs.values()):
        _write_indexer_cache(out, config, layers, indexer_runs, chunks)
    return {"sm_scale": float(first.scaling), "layers": list(layers), "tokens": total,
            "steps": 1 + decode_steps, "side_file": module_side_file(out)}


class _ModuleWeights:
    """What the dump and the side file need of a module once it has run: its dimensions, its
    scaling, kv_b_proj's weight, and o_proj's weight when at most 2^24 elements."""

    def __init__(self, attention):
        self.name = type(attention).__name__
        self.num_heads = attention.num_heads
        self.qk_nope_head_dim = attention.qk_nope_head_dim
        self.v_head_dim = attention.v_head_dim
        self.scaling = float(attention.scaling)
        self.kv_b_weight = attention.kv_b_proj.weight.detach().numpy().copy()
        o_proj = attention.o_proj.weight
        self.o_proj_weight = o_proj.detach().numpy().copy() if o_proj.numel() <= 1 << 24 else None


def _model_attributes(config):
    rope = dict(config.rope_parameters or {})
    attrs = {"qk_nope_head_dim": int(config.qk_nope_head_dim),
             "v_head_dim": int(config.v_head_dim),
             "rope_type": str(rope.get("rope_type", "default")),
             "rope_theta": float(rope.get("rope_theta", 10000.0)),
             "kv_rope_layout": "interleaved"}
    for key in ("factor", "mscale", "mscale_all_dim", "original_max_position_embeddings"):
        if rope.get(key) is not None:
            attrs["rope_" + key] = float(rope[key])
    if getattr(config, "index_topk", None) is not None:
        attrs["index_topk"] = int(config.index_topk)
    return attrs


def _query_storage(q, q_dtype):
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    return q32 if q_dtype == "float32" else bf16_bits_from_float32(q32)


def _write_dump(out, model, config, attention, layers, per_layer, chunks, attrs, version, q_dtype):
    import h5py

    heads, dc, dr = attention.num_heads, config.kv_lora_rank, config.qk_rope_head_dim
    dn, dv = attention.qk_nope_head_dim, attention.v_head_dim
    permutation = interleave_permutation(dr)
    prefix, total = chunks[0], sum(chunks)
    name = {"glm5": "GLM-5", "deepseek-v32": "DeepSeek-V3.2"}[model]
    producer = (f"kvdump.hf_capture transformers {version} {attention.name} float64 sdpa, "
                f"{len(layers)} layers, {heads} heads, q {q_dtype}, kv rows float32")
    side = h5py.File(module_side_file(out) + ".tmp", "w")
    try:
        side.attrs["format"] = "kvdump-module-outputs"
        side.attrs["module"] = attention.name
        side.attrs["transformers"] = version
        side.attrs["sm_scale"] = float(attention.scaling)
        with KvDumpWriter(out, model=name, producer=producer, num_heads=heads, kv_lora_rank=dc,
                          qk_rope_head_dim=dr, sm_scale=float(attention.scaling), page_size=1,
                          float32_inputs=True, model_attributes=attrs) as dump:
            absorbed = {}
            for layer in layers:
                module, results, latent, rope_rows = per_layer[layer]
                w = module.kv_b_weight.reshape(heads, dn + dv, dc)
                absorbed[layer] = w[:, :dn, :]
                rows = np.concatenate([latent, rope_rows[:, permutation]], axis=1)
                rows32 = rows.astype(np.float32)
                kv_scale = np.float32(max(np.abs(rows32).max(), 1e-30) / E4M3_MAX)
                pool = np.zeros((total + 1, 1, dc + dr), dtype=np.float32)
                pool[:prefix, 0] = rows32[:prefix]
                dump.add_layer(layer, kv_scale=kv_scale, kv_cache=quantize_e4m3(pool, kv_scale),
                               kv_source=pool)
                group = side.create_group(f"layers/L{layer:03d}")
                group.create_dataset("w_uv", data=w[:, dn:, :])
                group.create_dataset("w_uk", data=w[:, :dn, :])
                if module.o_proj_weight is not None:
                    group.create_dataset("o_proj_weight", data=module.o_proj_weight)
                per_layer[layer] = (module, results, rows32)
            start = prefix
            for index, length in enumerate(chunks[1:]):
                kind = "prefill" if index == 0 else "decode"
                end = start + length
                step = dump.add_step(kind, [0, length], [0, end], np.arange(end), [1],
                                     np.arange(start, end))
                positions = np.arange(start, end)
                for layer in layers:
                    module, results, rows32 = per_layer[layer]
                    result = results[index + 1]
                    q_nope = absorb_query(result["q_pass"], absorbed[layer])
                    q_pe = result["q_rot"][..., permutation]
                    topk = None
                    if result["topk"] is not None:
                        topk = _topk_rows(result["topk"], positions, int(config.index_topk))
                    step.add_layer(layer, _query_storage(q_nope, q_dtype),
                                   _query_storage(q_pe, q_dtype),
                                   rows32[start:end], topk_indices=topk)
                    group = side.create_group(f"steps/S{index:03d}/L{layer:03d}")
                    group.create_dataset("attn_output", data=result["attn_output"])
                    group.create_dataset("layer_output", data=result["layer_output"])
                start = end
        side.close()
        os.replace(module_side_file(out) + ".tmp", module_side_file(out))
    finally:
        if side.id.valid:
            side.close()
        if os.path.exists(module_side_file(out) + ".tmp"):
            os.remove(module_side_file(out) + ".tmp")


def _write_indexer_cache(out, config, layers, indexer_runs, chunks):
    """The indexer's FP8 key cache as deployments keep it (kvdump v1.2, kvdump.indexer_fp8):
    per layer the cache before the first step (the prefix's rows by the deployed rule) and its
    source rows; per step the indexer query, head weights, new key rows, the deployed top-k and
    the cache after the step. Page size 1: slot = position."""
    import h5py

    from . import indexer_fp8

    with h5py.File(out, "a") as f:
        for layer in layers:
            runs = indexer_runs[layer]
            indexer_fp8.write_indexer_cache(
                f, f"L{layer:03d}", sum(chunks) + 1, 1, runs[0][1],
                [(q, k, weights) for q, k, weights in runs[1:]], int(config.index_n_heads),
                int(config.index_topk), float(config.index_head_dim) ** -0.5)


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m kvdump.hf_capture",
        description="Capture a kvdump from Hugging Face transformers' own GLM-5 (GlmMoeDsaAttention)"
                    " or DeepSeek-V3.2 attention, run in float64 with seeded weights (no "
                    "download) or a checkpoint layer's weights: the latent and RoPE rows it "
                    "caches (RoPE re-interleaved to the servers' layout), its absorbed query, "
                    "its own softmax scale, its indexer's top-k, the FP8 pool by the kvdump write "
                    "rule, and beside the dump (OUT.module.h5) W_UV and the module's attention "
                    "output, which kvaudit's reference on the source rows must reproduce. "
                    "Exit 0 written, 2 bad input.")
    parser.add_argument("--out", required=True, help="the dump to write (OUT.module.h5 beside it)")
    parser.add_argument("--model", choices=MODELS, default="glm5")
    parser.add_argument("--config", choices=("tiny", "real"), default="tiny",
                        help="real: the model's attention dimensions; tiny: small widths for CI")
    parser.add_argument("--layers", type=layer_list, default=[0],
                        help="layer ids (comma list), each its own module and seeded weights")
    parser.add_argument("--prefix-tokens", type=int, default=24,
                        help="tokens cached before the dump's first step (kv_source)")
    parser.add_argument("--extend-tokens", type=int, default=8, help="rows of the extend step S000")
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--index-topk", type=int, default=None,
                        help="the indexer's top-k (default: the config's; tiny 8, real 2048)")
    parser.add_argument("--rope-parameters", type=json.loads, default=None,
                        help="a JSON rope_parameters dict replacing the config's")
    parser.add_argument("--q-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="q_nope / q_pe storage: bfloat16 as a server's kernel reads them "
                             "(default), float32 to compare kvaudit's reference with the module "
                             "to 2^-24")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--outlier-channels", type=int, default=8)
    parser.add_argument("--outlier-gain", type=float, default=16.0)
    parser.add_argument("--rope-gain", type=float, default=2.0)
    parser.add_argument("--weights", nargs="+", default=None,
                        help="safetensors files holding the layers' attention weights (bf16/fp32)")
    parser.add_argument("--weight-prefix", default=None,
                        help="name prefix of a layer's tensors, {layer} for its id "
                             "(default model.layers.{layer}.self_attn.)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        summary = capture(args.out, args.model, args.config, args.layers, args.prefix_tokens,
                          args.extend_tokens, args.decode_steps, args.seed, args.index_topk,
                          args.rope_parameters, args.outlier_channels, args.outlier_gain,
                          args.rope_gain, args.weights, args.weight_prefix,
                          log=lambda line: print(line, file=sys.stderr), q_dtype=args.q_dtype)
    except (CaptureError, ValueError) as error:
        print(f"hf_capture: {error}", file=sys.stderr)
        return 2
    print(f"hf_capture: wrote {args.out} and {summary['side_file']}: sm_scale "
          f"{summary['sm_scale']!r} (read from the module), {summary['tokens']} tokens, "
          f"{summary['steps']} steps, layers {summary['layers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
