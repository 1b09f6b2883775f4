"""The DSA indexer under FP8, as deployments run it (docs/indexer-fp8.md): the deployed key cache
and query quantization, the scores and top-k they give, the exact scores and top-k, the recall of
the deployed selection, the attention error of the tokens that changed, and the integrity of the
indexer cache's writes in a kvdump v1.2 file (docs/kvdump-v1.md "Version 1.2").

    python -m kvdump.indexer_fp8 DUMP [--json OUT.json] [--markdown OUT.md]

The math (D = index_head_dim, H = index_n_heads, B = the quantization block, G = D/B;
k_t [D] a source key row, q_h [D] one head of a query row, w_h the head weight, sm = D^-0.5):

  exact     score(t) = sum_h w_h * relu(sm * q_h . k_t)             float64 of the module values
  deployed  (DeepSeek-V3.2-Exp inference/model.py + kernel.py, scale_fmt "ue8m0"):
            y     = bf16(fp32(Had_D bf16(x)) * D^-0.5)                x = k_t [D] or q_h [D]
            a_g   = max(max_{j in block g} |y_j|, 1e-4)               one per block of B values
            s_g   = 2^ceil(log2(fp32(a_g * fp32(1/448))))             power_of_two ("ue8m0");
                    fp32(a_g * fp32(1/448))                           with scale format float32
            c_j   = e4m3_rne(clamp(y_j / s_g, -448, 448))             uint8 codes
            score(t) = sum_h w_h * sm * relu(sum_g s^q_hg s^k_tg (c^q_hg . c^k_tg))
                     = sum_h w_h * sm * relu(deq(q_h) . deq(k_t))     (scales > 0)
  top-k     the min(K, visible) largest scores over the row's visible positions 0..pos(i),
            ties broken towards the lower position (a stable sort)
  rule      per layer as the dump declares it: index_rotation "none" skips Had_D (y = bf16(x)),
            B = index_block_size (deployed: min(128, D)), index_scale_format
  recall    of the modelled top-k (not the stored one): v = the k-th largest exact score of the
            row; a deployed pick scoring above v is a hit, and picks scoring exactly v (ties with
            the k-th, exact zeros after the ReLU included) are hits up to the k - #{exact > v}
            places the ties share:
            recall = (#{picks > v} + min(#{picks = v}, k - #{exact > v})) / k.
  stored    each stored top-k row must be a top-k of the modelled deployed scores (the recall's
            tie rule on the deployed scores gives 1), else an integrity failure.
  attention error: MLA attention (absorbed: s = sm_attn (q_nope . c_t + q_pe . r_t), out =
            softmax(s) . c_t, [H, Dc]) over the deployed set vs the exact set, both on the same
            unquantized rows (kv_source / new_kv), float64: ||o_dep - o_exact|| / ||o_exact||.

Scores are computed in float64 here; the deployed kernel accumulates the e4m3 products in fp32
(each product exact, the sums within D * 2^-24 relative), far below the FP8 effect measured.
Hadamard: Sylvester's construction, H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] (the order
fast_hadamard_transform uses); scipy.linalg.hadamard builds the same matrix, but scipy is not a
dependency of kvdump for three lines.
"""

import argparse
import json
import math
import sys

import numpy as np

from .codec import bf16_bits_from_float32, decode_e4m3, encode_e4m3, float32_from_bf16_bits

E4M3_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)  # the deployed act_quant's floor on a block's amax
DEPLOYED_BLOCK = 128
SCALE_FORMATS = ("power_of_two", "float32")
ROTATIONS = ("hadamard", "none")  # index_rotation: the deployed rotation, or none
INDEXER_MINOR_VERSION = 2


class IndexerError(Exception):
    """Bad input: printed as one line naming the file and object, exit 2."""


# ---- the deployed quantizer ---------------------------------------------------------------------

def block_size_for(head_dim):
    """The quantization block: 128 (deployed), or the whole row for a narrower (tiny) indexer."""
    return min(DEPLOYED_BLOCK, int(head_dim))


def hadamard_matrix(n):
    """Sylvester's Hadamard matrix [n, n] of +-1 (n a power of two), float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: {n} is not a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def to_bf16(x):
    """float32 values of x rounded to bfloat16 (nearest even)."""
    return float32_from_bf16_bits(bf16_bits_from_float32(np.asarray(x, dtype=np.float32)))


def rotate(x, hadamard=True):
    """The deployed rotation of rows x [..., D]: bf16(fp32(Had_D bf16(x)) * D^-0.5), float32.
    hadamard=False gives bf16(x) (the rotation skipped: a planted defect for the tests)."""
    x16 = to_bf16(x).astype(np.float64)
    if not hadamard:
        return x16.astype(np.float32)
    d = x16.shape[-1]
    # +-1 sums of bf16 values are exact in float64 (8-bit significands), so the only rounding is
    # fp32's of the scaled sum, then bf16's.
    rotated = (x16 @ hadamard_matrix(d).T).astype(np.float32) * np.float32(d ** -0.5)
    return to_bf16(rotated)


def _ceil_log2_power(x):
    """2^ceil(log2 x) for float32 x > 0, exactly (frexp: x = m 2^e, m in [0.5, 1))."""
    mantissa, exponent = np.frexp(x.astype(np.float32))
    k = np.where(mantissa == np.float32(0.5), exponent - 1, exponent)
    return np.ldexp(np.float32(1), k.astype(np.int32)).astype(np.float32)


def block_scales(y, block, scale_format="power_of_two"):
    """Scales [..., D/block] float32 of rotated rows y [..., D]: a = max(amax, 1e-4),
    s = fp32(a * fp32(1/448)), rounded up to a power of two with "power_of_two"."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale format '{scale_format}' is not one of {', '.join(SCALE_FORMATS)}")
    blocks = np.abs(y.astype(np.float32)).reshape(*y.shape[:-1], y.shape[-1] // block, block)
    amax = np.maximum(blocks.max(axis=-1), AMAX_FLOOR).astype(np.float32)
    raw = (amax * (np.float32(1) / E4M3_MAX)).astype(np.float32)
    return _ceil_log2_power(raw) if scale_format == "power_of_two" else raw


def quantize_blocks(y, block, scale_format="power_of_two"):
    """(codes uint8 [..., D], scales float32 [..., D/block]) of rotated rows y [..., D]."""
    y = np.asarray(y, dtype=np.float32)
    scales = block_scales(y, block, scale_format)
    blocks = y.reshape(*y.shape[:-1], y.shape[-1] // block, block)
    quotient = np.clip(blocks / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return encode_e4m3(quotient).reshape(y.shape), scales


def deployed_quantize(rows, scale_format="power_of_two", hadamard=True, block=None):
    """The deployed write rule for key rows [..., D] (or query heads [..., H, D]): rotate (unless
    hadamard is False: a dump's index_rotation "none"), then one scale per block of `block` values
    (default block_size_for(D); a dump's index_block_size). Returns (codes uint8 [..., D],
    scales float32 [..., D/block])."""
    rows = np.asarray(rows, dtype=np.float32)
    block = block_size_for(rows.shape[-1]) if block is None else int(block)
    if block < 1 or rows.shape[-1] % block:
        raise ValueError(f"block size {block} does not divide the row width {rows.shape[-1]}")
    return quantize_blocks(rotate(rows, hadamard), block, scale_format)


def dequantize(codes, scales):
    """float64 values [..., D] of codes [..., D] with scales [..., G]."""
    values = decode_e4m3(codes).astype(np.float64)
    g = scales.shape[-1]
    blocks = values.reshape(*values.shape[:-1], g, values.shape[-1] // g)
    return (blocks * scales[..., None].astype(np.float64)).reshape(values.shape)


# ---- scores, selection, recall ------------------------------------------------------------------

def head_scores(q, w, k, softmax_scale):
    """sum_h w_h relu(sm q_h . k_t) for q [H, D], w [H], k [T, D] (float64): [T]."""
    logits = softmax_scale * (np.asarray(k, np.float64) @ np.asarray(q, np.float64).T)  # [T, H]
    return np.maximum(logits, 0.0) @ np.asarray(w, np.float64)


def exact_scores(q, w, k, softmax_scale):
    """The exact indexer scores [T] of one query row (the module's unquantized values)."""
    return head_scores(q, w, k, softmax_scale)


def deployed_scores(q_codes, q_scales, w, k_codes, k_scales, softmax_scale):
    """The deployed scores [T] from the FP8 query [H, D] (+ [H, G]) and key cache [T, D]
    (+ [T, G])."""
    return head_scores(dequantize(q_codes, q_scales), w, dequantize(k_codes, k_scales),
                       softmax_scale)


def select_topk(scores, k):
    """The k largest of scores [T] (positions), ties towards the lower position."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return np.sort(order[:min(int(k), len(order))])


def recall_with_ties(picked, exact, k):
    """Hits / k. With v the k-th largest exact score, every token scoring above v belongs to
    any exact top-k, and any of the tokens scoring exactly v may fill the rest: hits = picks
    above v + min(picks equal to v, k - tokens above v)."""
    exact = np.asarray(exact, dtype=np.float64)
    k = min(int(k), len(exact))
    if k == 0:
        return 1.0
    threshold = np.sort(exact)[::-1][k - 1]
    chosen = exact[np.asarray(picked, dtype=np.int64)]
    above = int(np.count_nonzero(exact > threshold))
    hits = int(np.count_nonzero(chosen > threshold))
    hits += min(int(np.count_nonzero(chosen == threshold)), k - above)
    return hits / k


def attention_output(q_nope, q_pe, rows, dc, sm_scale):
    """Absorbed MLA attention [H, Dc] over the KV rows [T, Dc + Dr] (float64)."""
    latent, rope = rows[:, :dc], rows[:, dc:]
    s = sm_scale * (q_nope @ latent.T + q_pe @ rope.T)  # [H, T]
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return p @ latent


def relative_l2(a, b):
    norm = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / norm if norm > 0 else float(np.linalg.norm(a))


# ---- the dump (docs/kvdump-v1.md "Version 1.2: the indexer's FP8 key cache") ---------------------

def write_layer(h5file, layer_name, k_source, k_codes, k_scales, n_heads, topk, softmax_scale,
                scale_format="power_of_two", block=None, rotation="hadamard"):
    """/layers/L###/indexer of an open h5py file: the key cache before the first step (codes
    [num_pages, P, D] uint8 e4m3fn, scales [num_pages, P, G] float32) and the source rows
    [num_pages, P, D] float32. Marks the file format_minor_version = 2."""
    group = h5file[f"layers/{layer_name}"].create_group("indexer")
    d = int(k_source.shape[-1])
    group.attrs["index_n_heads"] = np.int32(n_heads)
    group.attrs["index_head_dim"] = np.int32(d)
    group.attrs["index_topk"] = np.int32(topk)
    group.attrs["index_block_size"] = np.int32(block_size_for(d) if block is None else block)
    group.attrs["index_scale_format"] = scale_format
    group.attrs["index_rotation"] = rotation
    group.attrs["index_softmax_scale"] = np.float64(softmax_scale)
    codes = group.create_dataset("k_cache", data=np.ascontiguousarray(k_codes, dtype=np.uint8))
    codes.attrs["dtype"] = "float8_e4m3fn"
    group.create_dataset("k_scales", data=np.ascontiguousarray(k_scales, dtype="<f4"))
    group.create_dataset("k_source", data=np.ascontiguousarray(k_source, dtype="<f4"))
    h5file.attrs["format_minor_version"] = np.int32(INDEXER_MINOR_VERSION)


def write_step(h5file, step_name, layer_name, q, weights, new_k, topk_indices,
               k_cache_after=None, k_scales_after=None):
    """/steps/S###/L###/indexer: the query [Nq, H, D] and head weights [Nq, H] float32 as the
    module forms them (after RoPE; weights including H^-0.5), the new key rows [Nq, D] float32,
    the deployed top-k [Nq, K] int32 (positions, -1 padding), and optionally the cache after."""
    group = h5file[f"steps/{step_name}/{layer_name}"].create_group("indexer")
    group.create_dataset("q", data=np.ascontiguousarray(q, dtype="<f4"))
    group.create_dataset("weights", data=np.ascontiguousarray(weights, dtype="<f4"))
    group.create_dataset("new_k", data=np.ascontiguousarray(new_k, dtype="<f4"))
    group.create_dataset("topk_indices", data=np.ascontiguousarray(topk_indices, dtype="<i4"))
    if k_cache_after is not None:
        codes = group.create_dataset("k_cache_after",
                                     data=np.ascontiguousarray(k_cache_after, dtype=np.uint8))
        codes.attrs["dtype"] = "float8_e4m3fn"
        group.create_dataset("k_scales_after",
                             data=np.ascontiguousarray(k_scales_after, dtype="<f4"))


def write_indexer_cache(h5file, layer_name, num_slots, page_size, prefix_keys, steps, n_heads,
                        topk, softmax_scale, block=None, rotation="hadamard"):
    """Writes a layer's indexer objects for a single request whose token position p sits in slot
    p: the cache before the first step holds prefix_keys [T0, D] (the deployed rule); steps is a
    list of (q [S, H, D], k [S, D], weights [S, H]) per step, the rows at the next positions.
    Each step's deployed top-k is taken over the visible positions after its writes (a row sees
    its own key, as DeepSeek's Indexer writes its cache before scoring); the cache after each
    step is stored too. block (default block_size_for(D)) and rotation ("hadamard" or "none") are
    the rule's, written as index_block_size and index_rotation."""
    prefix_keys = np.asarray(prefix_keys, dtype=np.float32)
    width = prefix_keys.shape[-1]
    block = block_size_for(width) if block is None else int(block)
    hadamard = rotation == "hadamard"

    def quantize(x):
        return deployed_quantize(x, hadamard=hadamard, block=block)

    source = np.zeros((num_slots, width), dtype=np.float32)
    codes = np.zeros((num_slots, width), dtype=np.uint8)
    scales = np.zeros((num_slots, width // block), dtype=np.float32)
    start = len(prefix_keys)
    source[:start] = prefix_keys
    codes[:start], scales[:start] = quantize(prefix_keys)

    def paged(x):
        return x.reshape(num_slots // page_size, page_size, -1)

    write_layer(h5file, layer_name, paged(source), paged(codes), paged(scales), n_heads, topk,
                softmax_scale, block=block, rotation=rotation)
    for index, (q, k, weights) in enumerate(steps):
        end = start + len(k)
        source[start:end] = np.asarray(k, dtype=np.float32)
        codes[start:end], scales[start:end] = quantize(source[start:end])
        q_codes, q_scales = quantize(np.asarray(q, dtype=np.float32))
        picked = np.full((end - start, topk), -1, dtype=np.int32)
        for i in range(end - start):
            visible = start + i + 1
            scores = deployed_scores(q_codes[i], q_scales[i], weights[i], codes[:visible],
                                     scales[:visible], softmax_scale)
            chosen = select_topk(scores, topk)
            picked[i, :len(chosen)] = chosen
        write_step(h5file, f"S{index:03d}", layer_name, q, weights, source[start:end], picked,
                   paged(codes), paged(scales))
        start = end


def example_dump(path, seed=1, head_dim=32, block=None, rotation="hadamard", keys=None):
    """A small kvdump v1.2 file with random values (numpy and h5py only): one request, page size
    4 (slot = position), MLA H 2, Dc 16, Dr 4; two layers with an indexer of 2 heads x head_dim
    (32), top-4; 9 cached tokens, a 3-row prefill step (positions 9..11) and a decode step
    (position 12). block and rotation: the indexer rule's (index_block_size, default
    block_size_for(head_dim); index_rotation). keys [2, 13, head_dim] replaces the random indexer
    key rows (per layer, per position). For tests and fuzz seeds."""
    import h5py

    from .codec import quantize_e4m3
    from .writer import KvDumpWriter

    rng = np.random.default_rng(seed)
    heads, dc, dr, page, prefix, chunks = 2, 16, 4, 4, 9, [3, 1]
    total = prefix + sum(chunks)
    num_slots = page * (-(-total // page) + 1)
    rows = rng.standard_normal((total, dc + dr)).astype(np.float32)
    layers = (0, 1)
    with KvDumpWriter(path, model="indexer-example", producer="kvdump.indexer_fp8.example_dump",
                      num_heads=heads, kv_lora_rank=dc, qk_rope_head_dim=dr,
                      sm_scale=float((dc + dr) ** -0.5), page_size=page,
                      float32_inputs=True) as dump:
        pool = np.zeros((num_slots, dc + dr), dtype=np.float32)
        pool[:prefix] = rows[:prefix]
        scale = np.float32(np.abs(rows).max() / 448.0)
        for layer in layers:
            dump.add_layer(layer, scale, quantize_e4m3(pool, scale).reshape(-1, page, dc + dr),
                           kv_source=pool.reshape(-1, page, dc + dr))
        start = prefix
        for index, length in enumerate(chunks):
            end = start + length
            pages = -(-end // page)
            step = dump.add_step("prefill" if index == 0 else "decode", [0, length], [0, pages],
                                 np.arange(pages), [end - (pages - 1) * page],
                                 np.arange(start, end))
            for layer in layers:
                step.add_layer(layer, rng.standard_normal((length, heads, dc)).astype(np.float32),
                               rng.standard_normal((length, heads, dr)).astype(np.float32),
                               rows[start:end])
            start = end
    random_keys = rng.standard_normal((len(layers), total, head_dim)).astype(np.float32)
    keys = random_keys if keys is None else np.asarray(keys, dtype=np.float32)
    with h5py.File(path, "a") as f:
        for n, layer in enumerate(layers):
            steps, start = [], prefix
            for length in chunks:
                q = rng.standard_normal((length, 2, head_dim)).astype(np.float32)
                w = rng.standard_normal((length, 2)).astype(np.float32)
                steps.append((q, keys[n, start:start + length], w))
                start += length
            write_indexer_cache(f, f"L{layer:03d}", num_slots, page, keys[n, :prefix], steps, 2,
                                4, head_dim ** -0.5, block=block, rotation=rotation)


def _float_rows(dataset):
    """float32 values of a float32 or bf16-bits (uint16) dataset."""
    data = dataset[()]
    if data.dtype == np.uint16:
        return float32_from_bf16_bits(data)
    return data.astype(np.float32)


def _need(group, name, where):
    if name not in group:
        raise IndexerError(f"{where}/{name}: missing")
    return group[name]


def _row_slots(step, page_size):
    """Per query row: (position, [slots of positions 0..position]) from the step's indices."""
    qo = step["qo_indptr"][()].astype(np.int64)
    kv = step["kv_indptr"][()].astype(np.int64)
    pages = step["kv_indices"][()].astype(np.int64)
    last = step["kv_last_page_len"][()].astype(np.int64)
    rows = []
    for b in range(len(last)):
        n_pages = kv[b + 1] - kv[b]
        length = 0 if n_pages == 0 else (n_pages - 1) * page_size + last[b]
        slots = (pages[kv[b]:kv[b + 1], None] * page_size + np.arange(page_size)).reshape(-1)
        n_rows = qo[b + 1] - qo[b]
        for r in range(n_rows):
            position = length - n_rows + r
            rows.append((int(position), slots[:position + 1]))
    return rows


def _string_attr(group, name, where):
    if name not in group.attrs:
        raise IndexerError(f"{where}: {name}: missing")
    value = group.attrs[name]
    return value.decode() if isinstance(value, bytes) else str(value)


def _scales(dataset, n_slots, groups, block, where):
    """The scales [n_slots, groups] float32 of a dataset [..., groups]; refuses a last dimension
    that disagrees with the block size (numpy would broadcast one scale over every block)."""
    data = dataset[()]
    if data.ndim < 1 or data.shape[-1] != groups or data.size != n_slots * groups:
        raise IndexerError(f"{where}: shape {list(data.shape)} disagrees with index_block_size "
                           f"{block}: expected {groups} scale(s) per slot for {n_slots} slots")
    return data.reshape(n_slots, groups).astype(np.float32)


class _LayerState:
    def __init__(self, f, name, path):
        where = f"{path}:/layers/{name}/indexer"
        group = f[f"layers/{name}/indexer"]
        self.name = name
        self.n_heads = int(group.attrs["index_n_heads"])
        self.topk = int(group.attrs["index_topk"])
        self.softmax_scale = float(group.attrs["index_softmax_scale"])
        self.scale_format = _string_attr(group, "index_scale_format", where)
        if self.scale_format not in SCALE_FORMATS:
            raise IndexerError(f"{where}: index_scale_format '{self.scale_format}' is unknown; "
                               f"expected one of {', '.join(SCALE_FORMATS)}")
        # The rule the dump declares (docs/kvdump-v1.md): the model quantizes with these, never
        # with the deployed defaults, so a dump written by another rule is judged by its own.
        self.rotation = _string_attr(group, "index_rotation", where)
        if self.rotation not in ROTATIONS:
            raise IndexerError(f"{where}: index_rotation '{self.rotation}' is unknown; expected "
                               f"one of {', '.join(ROTATIONS)}")
        codes = _need(group, "k_cache", where)[()]
        self.width = codes.shape[-1]
        if "index_block_size" not in group.attrs:
            raise IndexerError(f"{where}: index_block_size: missing")
        self.block = int(group.attrs["index_block_size"])
        if not 1 <= self.block <= self.width or self.width % self.block:
            raise IndexerError(f"{where}: index_block_size {self.block} does not divide the key "
                               f"width {self.width} (k_cache's last dimension)")
        if self.rotation == "hadamard" and self.width & (self.width - 1):
            raise IndexerError(f"{where}: index_rotation 'hadamard' needs a power-of-two key "
                               f"width, not {self.width}")
        self.codes = codes.reshape(-1, self.width).copy()
        self.scales = _scales(_need(group, "k_scales", where), len(self.codes),
                              self.width // self.block, self.block, f"{where}/k_scales")
        self.source = _need(group, "k_source", where)[()].reshape(-1, self.width).astype(np.float32)
        layer = f[f"layers/{name}"]
        self.kv_rows = (_float_rows(layer["kv_source"]).reshape(len(self.codes), -1)
                        if "kv_source" in layer else None)


def analyse(path, hadamard=True):
    """Reads a v1.2 dump and returns the per-layer recall, attention error and integrity report
    (a dict, JSON-ready). The model quantizes with each layer's index_rotation and
    index_block_size. hadamard=False skips the rotation even where the dump declares "hadamard"
    (a planted defect: the integrity check then fails on a dump written with it)."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as error:
        raise IndexerError(f"{path}: not a readable HDF5 file ({error})") from None
    with f:
        if int(f.attrs.get("format_minor_version", 0)) < INDEXER_MINOR_VERSION:
            raise IndexerError(f"{path}:/: format_minor_version < 2: the dump holds no indexer "
                               "cache (kvdump v1.2)")
        page_size = int(f.attrs["page_size"])
        dc = int(f.attrs["kv_lora_rank"])
        sm_attn = float(f.attrs["sm_scale"])
        layers = [n for n in sorted(f["layers"]) if "indexer" in f[f"layers/{n}"]]
        if not layers:
            raise IndexerError(f"{path}:/layers: no layer has an indexer group")
        states = {n: _LayerState(f, n, path) for n in layers}
        report = {n: _empty_layer_report(states[n]) for n in layers}
        for step_name in sorted(f["steps"], key=lambda s: int(s[1:])):
            step = f[f"steps/{step_name}"]
            rows = _row_slots(step, page_size)
            slots_written = step["new_kv_slots"][()].astype(np.int64)
            for n in layers:
                _replay_step(f, path, step_name, step, n, states[n], report[n], rows,
                             slots_written, dc, sm_attn, hadamard)
    return {"dump": str(path), "layers": {n: _summarise(r) for n, r in report.items()}}


def _empty_layer_report(state):
    return {"rows": [], "written_slots": 0, "bad_writes": [], "touched_slots": [],
            "steps_with_cache_after": 0, "stored_topk_disagreements": 0,
            "stored_topk_disagreeing_rows": [],
            "n_heads": state.n_heads, "topk": state.topk, "head_dim": state.width,
            "block_size": state.block, "scale_format": state.scale_format,
            "rotation": state.rotation}


def _replay_step(f, path, step_name, step, n, state, report, rows, slots_written, dc, sm_attn,
                 hadamard):
    where = f"{path}:/steps/{step_name}/{n}/indexer"
    if "indexer" not in step[n]:
        raise IndexerError(f"{where}: missing (every step of a layer with an indexer has one)")
    group = step[f"{n}/indexer"]
    new_k = _need(group, "new_k", where)[()].astype(np.float32)
    before_codes, before_scales = state.codes.copy(), state.scales.copy()
    rotate_too = hadamard and state.rotation == "hadamard"
    codes, scales = deployed_quantize(new_k, state.scale_format, rotate_too, state.block)
    state.codes[slots_written], state.scales[slots_written] = codes, scales
    state.source[slots_written] = new_k
    if state.kv_rows is not None:
        state.kv_rows[slots_written] = _float_rows(step[f"{n}/new_kv"])
    report["written_slots"] += len(slots_written)
    if "k_cache_after" in group:
        _check_writes(group, state, before_codes, before_scales, slots_written, step_name, report,
                      f"{where}/k_scales_after")
    q = _need(group, "q", where)[()].astype(np.float32)
    w = _need(group, "weights", where)[()].astype(np.float64)
    stored = _need(group, "topk_indices", where)[()]
    q_codes, q_scales = deployed_quantize(q, state.scale_format, rotate_too, state.block)
    q_nope = _float_rows(step[f"{n}/q_nope"]).astype(np.float64)
    q_pe = _float_rows(step[f"{n}/q_pe"]).astype(np.float64)
    for i, (position, slots) in enumerate(rows):
        exact = exact_scores(q[i], w[i], state.source[slots], state.softmax_scale)
        deployed = deployed_scores(q_codes[i], q_scales[i], w[i], state.codes[slots],
                                   state.scales[slots], state.softmax_scale)
        picked, wanted = select_topk(deployed, state.topk), select_topk(exact, state.topk)
        if not _stored_topk_agrees(stored[i], deployed, state.topk):
            report["stored_topk_disagreements"] += 1
            if len(report["stored_topk_disagreeing_rows"]) < 16:
                report["stored_topk_disagreeing_rows"].append(
                    {"step": step_name, "row": i, "position": position,
                     "stored": [int(x) for x in stored[i][stored[i] >= 0]],
                     "model": [int(x) for x in picked]})
        entry = {"step": step_name, "row": i, "position": position, "visible": len(slots),
                 "recall": recall_with_ties(picked, exact, state.topk),
                 "changed_tokens": int(len(np.setdiff1d(picked, wanted)))}
        if state.kv_rows is not None and entry["changed_tokens"]:
            kv = state.kv_rows[slots].astype(np.float64)
            entry["attention_rel_l2"] = relative_l2(
                attention_output(q_nope[i], q_pe[i], kv[picked], dc, sm_attn),
                attention_output(q_nope[i], q_pe[i], kv[wanted], dc, sm_attn))
        elif state.kv_rows is not None:
            entry["attention_rel_l2"] = 0.0
        report["rows"].append(entry)


def _stored_topk_agrees(stored_row, deployed, topk):
    """Whether a stored top-k row (positions, -1 padding) is a valid top-k of the model's deployed
    scores [visible]: min(K, visible) distinct visible positions, every one a pick by the same tie
    rule as the recall (recall_with_ties against the deployed scores is 1: a different choice
    among tokens tied with the k-th deployed score is a valid tie-break, not a disagreement)."""
    picks = np.asarray(stored_row, dtype=np.int64)
    picks = picks[picks >= 0]
    k = min(int(topk), len(deployed))
    if len(picks) != k or len(np.unique(picks)) != k or np.any(picks >= len(deployed)):
        return False
    return recall_with_ties(picks, deployed, k) == 1.0


def _check_writes(group, state, before_codes, before_scales, slots_written, step_name, report,
                  where):
    """The cache after the step: each written slot holds the deployed rule's bytes of its new_k
    row, every other slot the bytes it held before the step. The captured cache then carries on."""
    after_codes = group["k_cache_after"][()].reshape(state.codes.shape)
    after_scales = _scales(group["k_scales_after"], len(state.codes), state.scales.shape[1],
                           state.block, where)
    written = np.zeros(len(state.codes), dtype=bool)
    written[slots_written] = True
    bad_codes = np.any(after_codes != state.codes, axis=1)
    bad_scales = np.any(after_scales.view(np.uint32) != state.scales.view(np.uint32), axis=1)
    for slot in np.flatnonzero(written & (bad_codes | bad_scales))[:16]:
        report["bad_writes"].append({"step": step_name, "slot": int(slot),
                                     "codes_differ": int(np.count_nonzero(
                                         after_codes[slot] != state.codes[slot])),
                                     "scales_differ": bool(bad_scales[slot])})
    untouched = ~written
    moved = untouched & (np.any(after_codes != before_codes, axis=1) |
                         np.any(after_scales.view(np.uint32) != before_scales.view(np.uint32),
                                axis=1))
    for slot in np.flatnonzero(moved)[:16]:
        report["touched_slots"].append({"step": step_name, "slot": int(slot)})
    report["steps_with_cache_after"] += 1
    state.codes, state.scales = after_codes.copy(), after_scales.copy()


def _summarise(report):
    rows = report.pop("rows")
    recalls = np.array([r["recall"] for r in rows]) if rows else np.array([1.0])
    errors = [r["attention_rel_l2"] for r in rows if "attention_rel_l2" in r]
    worst = sorted(rows, key=lambda r: (r["recall"], -r.get("attention_rel_l2", 0.0)))[:5]
    report.update({
        "rows_checked": len(rows),
        "sparse_rows": int(sum(1 for r in rows if r["visible"] > report["topk"])),
        "recall_mean": float(recalls.mean()), "recall_min": float(recalls.min()),
        "rows_with_changed_tokens": int(sum(1 for r in rows if r["changed_tokens"])),
        "attention_rel_l2_max": float(max(errors)) if errors else None,
        "attention_rel_l2_mean": float(np.mean(errors)) if errors else None,
        "worst_rows": worst,
        # Failed: a written slot off the rule, an unwritten slot moved, or a stored top-k row
        # that is not a valid top-k of the model's deployed scores (those rows are named in
        # stored_topk_disagreeing_rows). The top-k is always stored, so it fails a dump without a
        # captured cache too.
        "integrity": "failed" if (report["bad_writes"] or report["touched_slots"]
                                  or report["stored_topk_disagreements"]) else
                     ("ok" if report["steps_with_cache_after"] else "not captured"),
    })
    return report


def markdown(result):
    """A per-layer table and the worst rows, as markdown lines."""
    lines = ["| layer | rows (sparse) | recall mean | recall min | rows changed | attention "
             "rel. L2 max | mean | stored top-k disagreements | integrity |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["layers"].items():
        lines.append(f"| {name} | {r['rows_checked']} ({r['sparse_rows']}) | "
                     f"{r['recall_mean']:.6f} | {r['recall_min']:.6f} | "
                     f"{r['rows_with_changed_tokens']} | {_fmt(r['attention_rel_l2_max'])} | "
                     f"{_fmt(r['attention_rel_l2_mean'])} | {r['stored_topk_disagreements']} | "
                     f"{r['integrity']} |")
    lines.append("")
    for name, r in result["layers"].items():
        for d in r["stored_topk_disagreeing_rows"]:
            lines.append(f"- {name} {d['step']} row {d['row']} (position {d['position']}): the "
                         f"stored top-k {d['stored']} is not a top-k of the model's deployed "
                         f"scores (model: {d['model']})")
    if any(r["stored_topk_disagreeing_rows"] for r in result["layers"].values()):
        lines.append("")
    lines.append("Worst rows (lowest recall first):")
    lines.append("")
    for name, r in result["layers"].items():
        for w in r["worst_rows"]:
            lines.append(f"- {name} {w['step']} row {w['row']} (position {w['position']}, "
                         f"{w['visible']} visible): recall {w['recall']:.6f}, "
                         f"{w['changed_tokens']} tokens changed, attention rel. L2 "
                         f"{_fmt(w.get('attention_rel_l2'))}")
    return lines


def _fmt(x):
    return "n/a" if x is None else f"{x:.3e}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m kvdump.indexer_fp8",
        description="Judge the DSA indexer's FP8 selection in a kvdump v1.2 file: replays the "
                    "deployed quantization (the rotation, block size and scale format each "
                    "layer declares: deployed, Hadamard, e4m3 with one power-of-two scale per "
                    "128 values, FP8 query) on the stored source rows, and reports per layer the "
                    "top-k recall of the modelled selection against the exact float64 scores (a "
                    "pick tied with the k-th exact score counts as a hit), the worst rows, the "
                    "attention error of the tokens that changed (relative L2 of the MLA output "
                    "on the unquantized KV), whether each written indexer cache slot holds the "
                    "deployed bytes with other slots untouched, and whether each stored top-k "
                    "row is a top-k of the modelled deployed scores (ties either way). Exit 0 "
                    "clean, 1 an integrity failure, 2 bad input.")
    parser.add_argument("dump", help="a kvdump v1.2 file (with --write-example: the file to "
                                     "write)")
    parser.add_argument("--write-example", action="store_true",
                        help="write a small v1.2 example dump (random values) to DUMP and stop")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the table as markdown here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.write_example:
        example_dump(args.dump)
        print(f"indexer_fp8: wrote {args.dump}")
        return 0
    try:
        result = analyse(args.dump)
    except IndexerError as error:
        print(f"indexer_fp8: {error}", file=sys.stderr)
        return 2
    lines = markdown(result)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write("\n".join(lines) + "\n")
    failed = any(r["integrity"] == "failed" for r in result["layers"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
