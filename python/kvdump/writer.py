"""Writer of kvdump v1 and v1.1 files (docs/kvdump-v1.md): what a server captures for `kvaudit`
to replay.

Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = query rows of
a step, B = requests of a step):
  /layers/L###/kv_cache, kv_source, /steps/S###/L###/kv_cache_after : [num_pages, page_size, D]
  q_nope : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
  out    : [Nq, H, Dc]   lse  : [Nq, H]
  qo_indptr, kv_indptr : [B+1]   kv_last_page_len : [B]   kv_indices : [nnz_pages]
  new_kv_slots : [Nq]

v1.1 (kvdump-v1.md "Version 1.1"; the root then carries format_minor_version = 1):
  kv_scale_kind "per_token_group" (G = Dc / kv_scale_group_size scales per slot):
    split layout        : kv_cache [num_pages, page_size, Dc] e4m3fn codes,
                          kv_rope [num_pages, page_size, Dr] (kv_rope_dtype),
                          kv_scales [num_pages, page_size, G] float32, or e8m0 codes (uint8)
                          (kv_cache_after, kv_rope_after, kv_scales_after likewise: all or none)
    flashmla_fp8 layout : kv_cache [num_pages, page_size, Dc + 4G + 2Dr] uint8, each slot
                          Dc codes, G little-endian float32 scales, Dr little-endian bf16
  topk_indices : [Nq, K] int32, per step and layer (sparse attention): token positions of the
                 row's request, -1 padding; a file that has one carries format_minor_version = 1.

Every object is validated before it is written; a violation raises ValueError whose message starts
with the HDF5 path of the object, e.g. "/steps/S001/L000/q_nope: shape (4, 16, 512) != (4, 8, 512)".

Element types accepted (numpy arrays, or torch tensors by duck typing; torch is never imported
unless a torch tensor is passed):
  bfloat16 tensors : uint16 raw bits, stored as is; float32, rounded to bf16 bits (nearest-even,
                     exact for values that are widened bf16); torch.bfloat16 / ml_dtypes bfloat16.
  float8 pool      : uint8 raw e4m3fn codes; torch.float8_e4m3fn / ml_dtypes float8_e4m3fn.
                     Floats are refused: quantize them with kvdump.quantize_e4m3 first (v1.1:
                     kvdump.quantize_rows, and kvdump.pack_flashmla_fp8 for the packed layout).
  float32 scales   : float32 (kv_scales with kv_scale_format float32 or power_of_two).
  e8m0 scales      : uint8 codes; torch.float8_e8m0fnu / ml_dtypes float8_e8m0fnu.
  lse              : float32.
  index arrays     : any integer type whose values fit int32.
Groups are named by the model's layer id (L005 for layer 5) and by step order (S000, S001, ...).

Files are written atomically by default: under a temporary name in the same folder, renamed onto
the path by a successful close(); after an exception, or a close() that finds the dump incomplete,
the temporary is deleted, so no partial file is left (and an existing file of that name stays as
it was). A capture that may stop at any moment passes incremental=True instead: the file is
written under its own name from the start, and flush() after each step keeps what was written
readable.
"""

import math
import numbers
import os
import tempfile
import weakref

import numpy as np

from .codec import ROPE_DTYPES, SCALE_FORMATS, bf16_bits_from_float32

KV_DTYPES = ("float8_e4m3fn", "bfloat16")
STEP_KINDS = ("prefill", "decode")
KV_SCALE_KINDS = ("per_tensor", "per_token_group")
KV_CACHE_LAYOUTS = ("split", "flashmla_fp8")


def _fail(path, what):
    raise ValueError(f"{path}: {what}")


def to_numpy(x, path):
    """A numpy array of x. torch.bfloat16 comes back as uint16 bits, torch.float8_e4m3fn as uint8
    codes (the same for ml_dtypes arrays); other float8 kinds are refused."""
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "detach") and hasattr(x, "cpu"):
        tensor = x.detach().cpu().contiguous()
        name = str(tensor.dtype)
        if name in ("torch.bfloat16", "torch.float8_e4m3fn"):
            import torch  # the caller's tensor proves torch is there

            bits = torch.int16 if name == "torch.bfloat16" else torch.uint8
            arr = tensor.view(bits).numpy()
            return arr.view(np.uint16) if name == "torch.bfloat16" else arr
        if name.startswith("torch.float8"):
            _fail(path, f"dtype {name} is not float8_e4m3fn (the only fp8 type of kvdump v1)")
        arr = tensor.numpy()
    else:
        arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        return arr.view(np.uint16)
    if arr.dtype.name == "float8_e4m3fn":
        return arr.view(np.uint8)
    if arr.dtype.name.startswith("float8"):
        _fail(path, f"dtype {arr.dtype.name} is not float8_e4m3fn (the only fp8 type of kvdump v1)")
    return arr


def _float8_name(x):
    """The float8 dtype name of a torch tensor or numpy (ml_dtypes) array ("float8_e8m0fnu"),
    or None for any other type."""
    dtype = getattr(x, "dtype", None)
    name = str(dtype) if hasattr(x, "detach") else getattr(dtype, "name", "")
    name = name.removeprefix("torch.")
    return name if name.startswith("float8") else None


def _check_shape(arr, expected, path):
    if tuple(arr.shape) != tuple(expected):
        _fail(path, f"shape {tuple(arr.shape)} != {tuple(expected)}")


def _bf16_storage(x, shape, path, keep_float32=False):
    """(uint16 little-endian bits, "bfloat16") of a bfloat16 tensor given as bits or float32;
    with keep_float32, a float32 tensor is stored as it is ("float32": the format accepts a float32
    dataset wherever it names a bfloat16 tensor, and kvaudit uses its values unrounded)."""
    arr = to_numpy(x, path)
    _check_shape(arr, shape, path)
    if arr.dtype == np.uint16:
        return arr.astype("<u2", copy=False), "bfloat16"
    if arr.dtype == np.float32 and keep_float32:
        return arr.astype("<f4", copy=False), "float32"
    if arr.dtype == np.float32:
        return bf16_bits_from_float32(arr).astype("<u2", copy=False), "bfloat16"
    _fail(path, f"dtype {arr.dtype} is neither bfloat16 bits (uint16) nor float32")


def _pool_storage(x, kv_dtype, shape, path):
    """Storage of a pool: e4m3fn codes for a float8 pool, bf16 bits for a bfloat16 pool."""
    if kv_dtype == "bfloat16":
        return _bf16_storage(x, shape, path)
    return _codes_storage(x, shape, path, "quantize values with kvdump.quantize_e4m3 first")


def _uint8_storage(x, shape, path, dtype_attribute, expected):
    """(uint8 array, dtype_attribute) of a tensor stored as raw bytes; `expected` names what the
    bytes must be, for the message when they are not uint8."""
    arr = to_numpy(x, path)
    _check_shape(arr, shape, path)
    if arr.dtype != np.uint8:
        _fail(path, f"dtype {arr.dtype} is not {expected}")
    return arr.astype("<u1", copy=False), dtype_attribute


def _codes_storage(x, shape, path, hint):
    """(uint8 e4m3fn codes, "float8_e4m3fn") of a float8 tensor given as codes."""
    return _uint8_storage(x, shape, path, "float8_e4m3fn", f"float8_e4m3fn codes (uint8); {hint}")


def _rope_storage(x, rope_dtype, shape, path):
    """v1.1 RoPE part: bf16 bits ("bfloat16") or e4m3fn codes of x / kv_scale ("float8_e4m3fn")."""
    if rope_dtype == "bfloat16":
        return _bf16_storage(x, shape, path)
    return _codes_storage(x, shape, path, "quantize values with kvdump.quantize_rows first")


def _scales_storage(x, scale_format, shape, path):
    """v1.1 group scales: float32 values (float32, power_of_two) or e8m0 codes (uint8, stored
    with dtype "float8_e8m0fnu"). Values are not checked: slots without a token hold anything."""
    name = _float8_name(x)
    if scale_format != "e8m0":
        arr = to_numpy(x, path)
        _check_shape(arr, shape, path)
        if arr.dtype != np.float32:
            _fail(path, f"dtype {arr.dtype} is not float32 (kv_scale_format {scale_format})")
        return arr.astype("<f4", copy=False), "float32"
    if name is not None and name != "float8_e8m0fnu":
        _fail(path, f"dtype {name} is not float8_e8m0fnu (kv_scale_format e8m0)")
    if name is None:
        arr = to_numpy(x, path)
    elif hasattr(x, "detach"):
        import torch  # the caller's tensor proves torch is there

        arr = x.detach().cpu().contiguous().view(torch.uint8).numpy()
    else:
        arr = np.asarray(x).view(np.uint8)
    _check_shape(arr, shape, path)
    if arr.dtype != np.uint8:
        _fail(path, f"dtype {arr.dtype} is not e8m0 scale codes (uint8) (kv_scale_format e8m0)")
    return arr.astype("<u1", copy=False), "float8_e8m0fnu"


def _packed_storage(x, shape, path):
    """(uint8 bytes, "flashmla_fp8") of a pool in FlashMLA's packed FP8 slot form."""
    return _uint8_storage(x, shape, path, "flashmla_fp8",
                          "flashmla_fp8 slot bytes (uint8); build them with "
                          "kvdump.pack_flashmla_fp8")


def _int32_vector(x, path):
    arr = to_numpy(x, path)
    if arr.size == 0:
        arr = arr.astype(np.int64).reshape(-1) if arr.ndim <= 1 else arr
    if arr.ndim != 1:
        _fail(path, f"shape {tuple(arr.shape)} is not one-dimensional")
    if arr.dtype.kind not in "iu":
        _fail(path, f"dtype {arr.dtype} is not an integer type")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        _fail(path, "values do not fit int32")
    return arr.astype("<i4")


def _check_indptr(arr, path):
    if arr.size == 0:
        _fail(path, "is empty; it holds B+1 >= 1 entries")
    if arr[0] != 0:
        _fail(path, f"starts at {arr[0]}, not 0")
    drops = np.flatnonzero(np.diff(arr) < 0)
    if drops.size:
        k = int(drops[0])
        _fail(path, f"decreases at entry {k + 1} ({arr[k]} -> {arr[k + 1]})")


def validate_step_indices(path, kind, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                          new_kv_slots, num_pages, page_size):
    """Checks the index rules of kvdump-v1 for the step at `path` ("/steps/S000"); raises
    ValueError naming the offending object, else returns the five arrays as int32, by name."""
    arrays = {}
    for name, value in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len),
                        ("new_kv_slots", new_kv_slots)):
        arrays[name] = _int32_vector(value, f"{path}/{name}")
    _check_step_arrays(path, kind, num_pages, page_size, **arrays)
    return arrays


def _check_step_arrays(path, kind, num_pages, page_size, qo_indptr, kv_indptr, kv_indices,
                       kv_last_page_len, new_kv_slots):
    if kind not in STEP_KINDS:
        _fail(path, f'kind "{kind}" is not "prefill" or "decode" (an extend step is "prefill")')
    _check_indptr(qo_indptr, f"{path}/qo_indptr")
    batch = qo_indptr.size - 1
    if kv_indptr.size != qo_indptr.size:
        _fail(f"{path}/kv_indptr",
              f"length {kv_indptr.size} != {qo_indptr.size} (B+1 of qo_indptr)")
    _check_indptr(kv_indptr, f"{path}/kv_indptr")
    if kv_indptr[-1] != kv_indices.size:
        _fail(f"{path}/kv_indptr", f"ends at {kv_indptr[-1]}, but kv_indices has "
                                   f"{kv_indices.size} entries")
    outside = np.flatnonzero((kv_indices < 0) | (kv_indices >= num_pages))
    if outside.size:
        k = int(outside[0])
        _fail(f"{path}/kv_indices", f"entry {k} = {kv_indices[k]} is outside [0, {num_pages})")
    if kv_last_page_len.size != batch:
        _fail(f"{path}/kv_last_page_len", f"length {kv_last_page_len.size} != {batch} (B)")
    pages = np.diff(kv_indptr).astype(np.int64)
    last = kv_last_page_len.astype(np.int64)
    for b in range(batch):
        if pages[b] == 0 and last[b] != 0:
            _fail(f"{path}/kv_last_page_len", f"request {b} has no page, so its entry must be 0, "
                                              f"not {last[b]}")
        if pages[b] > 0 and not 1 <= last[b] <= page_size:
            _fail(f"{path}/kv_last_page_len", f"request {b}: {last[b]} is outside 1..{page_size}")
    rows = np.diff(qo_indptr).astype(np.int64)
    if kind == "decode" and np.any(rows > 1):
        b = int(np.flatnonzero(rows > 1)[0])
        _fail(f"{path}/qo_indptr", f"decode step: request {b} has {rows[b]} rows (at most 1)")
    num_rows = int(qo_indptr[-1])
    if new_kv_slots.size != num_rows:
        _fail(f"{path}/new_kv_slots", f"length {new_kv_slots.size} != {num_rows} (Nq, the last "
                                      "entry of qo_indptr)")
    # kvdump-v1 Semantics: kv_len(b) tokens after the writes; row j of request b sits at position
    # kv_len(b) - n_q(b) + j, which must exist (every row sees at least its own token).
    kv_len = _kv_lengths(kv_indptr, kv_last_page_len, page_size)
    short = np.flatnonzero(rows > kv_len)
    if short.size:
        b = int(short[0])
        _fail(f"{path}/kv_indptr", f"request {b} has {rows[b]} query rows but kv_len {kv_len[b]}; "
                                   "each row's own token must be in its pages")
    request, position = _row_positions(qo_indptr, kv_indptr, kv_last_page_len, page_size)
    page = kv_indices[kv_indptr[request] + position // page_size].astype(np.int64)
    expected = page * page_size + position % page_size
    wrong = np.flatnonzero(new_kv_slots != expected)
    if wrong.size:
        i = int(wrong[0])
        _fail(f"{path}/new_kv_slots", f"row {i} (request {request[i]}, position {position[i]}) "
                                      f"has slot {new_kv_slots[i]}, but that position's slot is "
                                      f"{expected[i]}")
    # Two rows writing one slot would race on a GPU (the step's writes are concurrent).
    order = np.argsort(new_kv_slots, kind="stable")
    repeats = np.flatnonzero(np.diff(new_kv_slots[order]) == 0)
    if repeats.size:
        first, second = int(order[repeats[0]]), int(order[repeats[0] + 1])
        _fail(f"{path}/new_kv_slots", f"rows {first} and {second} both write slot "
                                      f"{new_kv_slots[first]}: two writes of one slot in one step "
                                      "would race")


def _kv_lengths(kv_indptr, kv_last_page_len, page_size):
    """kv_len(b) = (pages(b) - 1) * P + kv_last_page_len[b] tokens after the writes, 0 without
    pages (kvdump-v1 "Requests, tokens and slots"); int64 [B]."""
    pages = np.diff(kv_indptr).astype(np.int64)
    last = kv_last_page_len.astype(np.int64)
    return np.where(pages > 0, (pages - 1) * page_size + last, 0)


def _row_positions(qo_indptr, kv_indptr, kv_last_page_len, page_size):
    """(request [Nq], position [Nq]) of every query row, int64: row j of request b sits at token
    position kv_len(b) - n_q(b) + j (kvdump-v1 "Causal positions") and sees positions 0..that."""
    rows = np.diff(qo_indptr).astype(np.int64)
    kv_len = _kv_lengths(kv_indptr, kv_last_page_len, page_size)
    request = np.repeat(np.arange(rows.size), rows)
    position = kv_len[request] - rows[request] + (np.arange(int(rows.sum())) - qo_indptr[request])
    return request, position


def _topk_storage(x, positions, path):
    """int32 [Nq, K] topk_indices (kvdump-v1.md "Sparse attention"), checked against the rows'
    token positions: K >= 1; every entry -1 (padding) or in 0..pos(i); no position twice in a
    row; at least one position per row."""
    arr = to_numpy(x, path)
    num_rows = positions.size
    if arr.ndim != 2:
        _fail(path, f"shape {tuple(arr.shape)} is not two-dimensional [Nq, K]")
    if arr.shape[0] != num_rows:
        _fail(path, f"shape {tuple(arr.shape)} has {arr.shape[0]} rows, not Nq = {num_rows}")
    if arr.shape[1] < 1:
        _fail(path, f"shape {tuple(arr.shape)}: K = 0, but every row lists at least one position")
    if arr.dtype.kind not in "iu":
        _fail(path, f"dtype {arr.dtype} is not an integer type")
    if arr.size and (int(arr.min()) < -(2**31) or int(arr.max()) >= 2**31):
        _fail(path, "values do not fit int32")
    topk = arr.astype(np.int64)
    position = positions.astype(np.int64)[:, None]
    outside = (topk != -1) & ((topk < 0) | (topk > position))
    if outside.any():
        i, k = (int(v) for v in np.argwhere(outside)[0])
        _fail(path, f"row {i} (token position {position[i, 0]}): entry {k} = {topk[i, k]} is "
                    f"neither -1 nor a position in 0..{position[i, 0]} (causal)")
    listed = np.sort(np.where(topk == -1, np.int64(-1), topk), axis=1)
    twice = (listed[:, 1:] == listed[:, :-1]) & (listed[:, 1:] != -1)
    if twice.any():
        i, k = (int(v) for v in np.argwhere(twice)[0])
        value = listed[i, k + 1]
        first, second = (int(e) for e in np.flatnonzero(topk[i] == value)[:2])
        _fail(path, f"row {i} (token position {position[i, 0]}) lists position {value} twice "
                    f"(entries {first} and {second})")
    empty = np.flatnonzero(np.all(topk == -1, axis=1))
    if empty.size:
        i = int(empty[0])
        _fail(path, f"row {i} (token position {position[i, 0]}) lists no position (every entry "
                    "is -1); a row attends to at least one token")
    return arr.astype("<i4")


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _grouping_options(kv_dtype, kv_lora_rank, kv_scale_kind, group_size, scale_format,
                      rope_dtype, layout):
    """The v1.1 root attributes of a per_token_group file, by name, in file order ({} for
    per_tensor, which takes none of the options); raises ValueError naming "/"."""
    options = (("kv_scale_group_size", group_size), ("kv_scale_format", scale_format),
               ("kv_rope_dtype", rope_dtype), ("kv_cache_layout", layout))
    if kv_scale_kind not in KV_SCALE_KINDS:
        _fail("/", f'kv_scale_kind "{kv_scale_kind}" is not one of {", ".join(KV_SCALE_KINDS)}')
    if kv_scale_kind == "per_tensor":
        for name, value in options:
            if value is not None:
                _fail("/", f'{name} = {value!r} is a per_token_group option, but kv_scale_kind '
                           'is "per_tensor"')
        return {}
    if kv_dtype != "float8_e4m3fn":
        _fail("/", f'kv_scale_kind "per_token_group" needs kv_dtype "float8_e4m3fn", not '
                   f'"{kv_dtype}"')
    if (isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral)
            or group_size < 1):
        _fail("/", f"kv_scale_group_size = {group_size!r} is not a positive integer "
                   '(kv_scale_kind "per_token_group" needs it)')
    if kv_lora_rank % group_size:
        _fail("/", f"kv_scale_group_size = {group_size} does not divide kv_lora_rank = "
                   f"{kv_lora_rank}")
    if scale_format not in SCALE_FORMATS:
        _fail("/", f'kv_scale_format {scale_format!r} is not one of {", ".join(SCALE_FORMATS)}')
    if rope_dtype not in ROPE_DTYPES:
        _fail("/", f'kv_rope_dtype {rope_dtype!r} is not one of {", ".join(ROPE_DTYPES)}')
    layout = "split" if layout is None else layout
    if layout not in KV_CACHE_LAYOUTS:
        _fail("/", f'kv_cache_layout {layout!r} is not one of {", ".join(KV_CACHE_LAYOUTS)}')
    if layout == "flashmla_fp8" and scale_format == "e8m0":
        _fail("/", 'kv_cache_layout "flashmla_fp8" stores float32 scales: kv_scale_format must be '
                   '"float32" or "power_of_two", not "e8m0"')
    if layout == "flashmla_fp8" and rope_dtype != "bfloat16":
        _fail("/", 'kv_cache_layout "flashmla_fp8" stores a bf16 RoPE part: kv_rope_dtype must be '
                   f'"bfloat16", not "{rope_dtype}"')
    return {"kv_scale_group_size": int(group_size), "kv_scale_format": scale_format,
            "kv_rope_dtype": rope_dtype, "kv_cache_layout": layout}


FORMAT_ATTRIBUTES = ("format", "format_version", "format_minor_version", "model", "producer",
                     "num_heads", "kv_lora_rank", "qk_rope_head_dim", "sm_scale", "page_size",
                     "kv_dtype", "kv_scale_kind", "kv_scale_group_size", "kv_scale_format",
                     "kv_rope_dtype", "kv_cache_layout")


def _model_attributes(model_attributes):
    """Optional root attributes describing the model's attention configuration
    (docs/kvdump-v1.md "Optional model attributes"): numbers or strings, never a name the format
    itself uses. Returns them as HDF5 attribute values."""
    result = {}
    for name, value in (model_attributes or {}).items():
        if name in FORMAT_ATTRIBUTES:
            _fail("/", f"model attribute {name} is a name the format uses")
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            _fail("/", f"model attribute {name} = {value!r} is not a number or a string")
        result[name] = value if isinstance(value, str) else (
            np.int64(value) if isinstance(value, numbers.Integral) else np.float64(value))
    return result


class KvDumpWriter:
    """Writes one kvdump v1 file. Add every layer's pool first, then the steps in replay order:

        with KvDumpWriter("dump.h5", model="GLM-5", producer="sglang tp-rank 0", num_heads=16,
                          kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.0723,
                          page_size=1) as dump:
            dump.add_layer(0, kv_scale=1.0, kv_cache=codes)   # [num_pages, page_size, D] uint8
            step = dump.add_step("decode", qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                 new_kv_slots)
            step.add_layer(0, q_nope, q_pe, new_kv, out=out, lse=lse)

    Tensors are written as they are added, so a long capture does not accumulate in memory.
    Closing checks that every step holds every layer.

    kvdump v1.1 (docs/kvdump-v1.md "Version 1.1"): kv_scale_kind="per_token_group" with
    kv_scale_group_size (channels per scale, dividing Dc), kv_scale_format ("float32",
    "power_of_two" or "e8m0"), kv_rope_dtype ("bfloat16" or "float8_e4m3fn") and
    kv_cache_layout ("split", the default, or "flashmla_fp8") writes pools with per-slot group
    scales; the root then carries format_minor_version = 1 and those attributes. Pools of the
    split layout are given as kv_cache (latent codes), kv_rope and kv_scales; the packed layout
    as kv_cache alone. Build them from float rows with kvdump.quantize_rows (and
    kvdump.pack_flashmla_fp8). The per_tensor default writes the same v1 file as before.

    The file appears at `path` only when close() succeeds (written under a temporary name in the
    same folder until then; deleted after an exception). incremental=True writes `path` directly
    instead, for a capture that must leave a readable file when it stops early: call flush() after
    each step.
    """

    def __init__(self, path, *, model, producer, num_heads, kv_lora_rank, qk_rope_head_dim,
                 sm_scale, page_size, kv_dtype="float8_e4m3fn", compression=None,
                 incremental=False, kv_scale_kind="per_tensor", kv_scale_group_size=None,
                 kv_scale_format=None, kv_rope_dtype=None, kv_cache_layout=None,
                 float32_inputs=False, model_attributes=None):
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                _fail("/", f"{name} = {value!r} is not a positive integer")
        if not math.isfinite(float(sm_scale)):
            _fail("/", f"sm_scale = {float(sm_scale)} is not finite")
        if kv_dtype not in KV_DTYPES:
            _fail("/", f'kv_dtype "{kv_dtype}" is not one of {", ".join(KV_DTYPES)}')
        for name, value in (("model", model), ("producer", producer)):
            if not isinstance(value, str):
                _fail("/", f"{name} = {value!r} is not a string")
        extra_attributes = _model_attributes(model_attributes)
        grouping = _grouping_options(kv_dtype, int(kv_lora_rank), kv_scale_kind,
                                     kv_scale_group_size, kv_scale_format, kv_rope_dtype,
                                     kv_cache_layout)
        self.num_heads = int(num_heads)
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.page_size = int(page_size)
        self.kv_dtype = kv_dtype
        self.kv_scale_kind = kv_scale_kind
        # v1.1 per_token_group only (None with per_tensor).
        self.kv_scale_group_size = grouping.get("kv_scale_group_size")
        self.kv_scale_format = grouping.get("kv_scale_format")
        self.kv_rope_dtype = grouping.get("kv_rope_dtype")
        self.kv_cache_layout = grouping.get("kv_cache_layout")
        self.format_minor_version = 1 if grouping else 0
        # float32_inputs: q_nope, q_pe, new_kv and kv_source given as float32 are stored as float32
        # (not rounded to bf16): a capture from a float32/float64 model keeps 2^-24 precision.
        self.float32_inputs = bool(float32_inputs)
        self.num_pages = None  # set by the first layer's pool
        self._compression = compression
        self._layers = {}  # layer_id -> group name
        self._steps = []
        # h5py is imported here, not at the top, so that `import kvdump` (and the backend server,
        # kvdump.backends, which uses only validate_step_indices) works without h5py.
        import h5py

        self.path = os.fspath(path)
        self.incremental = bool(incremental)
        self._temp_path = None if self.incremental else self._create_temp_file()
        try:
            self._file = h5py.File(self._temp_path or self.path, "w")
        except BaseException:
            if self._temp_path is not None:
                _remove_quietly(self._temp_path)
            raise
        if self._temp_path is not None:
            # A writer dropped without close() leaves no temporary behind.
            self._finalizer = weakref.finalize(self, _remove_quietly, self._temp_path)
        attrs = self._file.attrs
        attrs["format"] = "kvdump"
        attrs["format_version"] = np.int32(1)
        if grouping:
            attrs["format_minor_version"] = np.int32(1)
        attrs["model"] = model
        attrs["producer"] = producer
        attrs["num_heads"] = np.int32(num_heads)
        attrs["kv_lora_rank"] = np.int32(kv_lora_rank)
        attrs["qk_rope_head_dim"] = np.int32(qk_rope_head_dim)
        attrs["sm_scale"] = np.float64(sm_scale)
        attrs["page_size"] = np.int32(page_size)
        attrs["kv_dtype"] = kv_dtype
        attrs["kv_scale_kind"] = kv_scale_kind
        for name, value in grouping.items():
            attrs[name] = np.int32(value) if name == "kv_scale_group_size" else value
        for name, value in extra_attributes.items():
            attrs[name] = value
        # Both groups at once: a dump without steps is valid (kvaudit requires /steps to exist).
        self._file.create_group("layers")
        self._file.create_group("steps")

    def _create_temp_file(self):
        """An empty ".<name>.kvdump-XXXXXX" next to the path, with a plain file's permissions."""
        folder = os.path.dirname(os.path.abspath(self.path))
        name = os.path.basename(self.path)[:200] or "dump"
        fd, temp = tempfile.mkstemp(prefix=f".{name}.kvdump-", dir=folder)
        os.close(fd)
        os.chmod(temp, 0o666 & ~_umask())
        return temp

    def flush(self):
        """Pushes what was written so far to the file (h5py File.flush): after it, the file read
        by another process holds every step added so far (an incremental writer's file then
        survives the capture stopping; an atomic writer's temporary is not visible anyway)."""
        self._require_open("/")
        self._file.flush()

    def _finish(self, keep):
        """Closes the HDF5 file; renames the temporary onto the path when `keep`, else deletes it."""
        if self._file is None:
            return
        try:
            self._file.close()
        finally:
            self._file = None
            if self._temp_path is not None:
                self._finalizer.detach()
                if keep:
                    os.replace(self._temp_path, self.path)
                else:
                    _remove_quietly(self._temp_path)

    @property
    def row_width(self):
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def per_token_group(self):
        return self.kv_scale_kind == "per_token_group"

    @property
    def num_scale_groups(self):
        """G = Dc / kv_scale_group_size (0 with per_tensor)."""
        return self.kv_lora_rank // self.kv_scale_group_size if self.per_token_group else 0

    @property
    def kv_cache_width(self):
        """The last dimension of kv_cache: D (per_tensor), Dc (split), Dc + 4G + 2Dr (packed)."""
        if not self.per_token_group:
            return self.row_width
        if self.kv_cache_layout == "split":
            return self.kv_lora_rank
        return self.kv_lora_rank + 4 * self.num_scale_groups + 2 * self.qk_rope_head_dim

    def _pool_shape(self, width=None):
        return (self.num_pages, self.page_size, self.kv_cache_width if width is None else width)

    def _pool_tensors(self, path, suffix, kv_cache, kv_rope, kv_scales):
        """{name: (array, dtype attribute)} of a pool (suffix "" for /layers, "_after" for a
        step's capture) in the file's form, checked against the first layer's num_pages."""
        names = {part: f"{part}{suffix}" for part in ("kv_cache", "kv_rope", "kv_scales")}
        cache_path = f"{path}/{names['kv_cache']}"
        if not self.per_token_group:
            for part, value in (("kv_rope", kv_rope), ("kv_scales", kv_scales)):
                if value is not None:
                    _fail(f"{path}/{names[part]}", 'is a v1.1 per_token_group dataset, but '
                          'kv_scale_kind is "per_tensor"')
            return {names["kv_cache"]: _pool_storage(kv_cache, self.kv_dtype, self._pool_shape(),
                                                     cache_path)}
        if self.kv_cache_layout == "flashmla_fp8":
            for part, value in (("kv_rope", kv_rope), ("kv_scales", kv_scales)):
                if value is not None:
                    _fail(f"{path}/{names[part]}", "is absent in the flashmla_fp8 layout (the "
                          f"packed {names['kv_cache']} holds the scales and the RoPE part)")
            return {names["kv_cache"]: _packed_storage(kv_cache, self._pool_shape(), cache_path)}
        for part, value in (("kv_rope", kv_rope), ("kv_scales", kv_scales)):
            if value is None:
                _fail(f"{path}/{names[part]}", f"missing: the split layout stores "
                      f"{names['kv_cache']}, {names['kv_rope']} and {names['kv_scales']} together")
        return {
            names["kv_cache"]: _codes_storage(kv_cache, self._pool_shape(), cache_path,
                                              "quantize values with kvdump.quantize_rows first"),
            names["kv_rope"]: _rope_storage(kv_rope, self.kv_rope_dtype,
                                            self._pool_shape(self.qk_rope_head_dim),
                                            f"{path}/{names['kv_rope']}"),
            names["kv_scales"]: _scales_storage(kv_scales, self.kv_scale_format,
                                                self._pool_shape(self.num_scale_groups),
                                                f"{path}/{names['kv_scales']}"),
        }

    def _use_minor_version(self):
        """Marks the file as using a v1.1 feature (format_minor_version = 1), once."""
        if self.format_minor_version < 1:
            self._file.attrs["format_minor_version"] = np.int32(1)
            self.format_minor_version = 1

    def _require_open(self, path):
        if self._file is None:
            _fail(path, "the writer is closed")

    def _write(self, group, name, arr, dtype_attr):
        compression = self._compression if arr.size else None
        dataset = group.create_dataset(name, data=np.ascontiguousarray(arr),
                                       compression=compression)
        if dtype_attr:
            dataset.attrs["dtype"] = dtype_attr

    def add_layer(self, layer_id, kv_scale, kv_cache, kv_source=None, kv_rope=None,
                  kv_scales=None):
        """Adds /layers/L###: the pool of layer `layer_id` before step 0.

        kv_cache: [num_pages, page_size, D] e4m3fn codes (uint8), or bf16 for a bfloat16 pool.
        kv_source: optional, [num_pages, page_size, D], bfloat16: the values the pool was
        quantized from.
        per_token_group (v1.1), split layout: kv_cache [num_pages, page_size, Dc] latent e4m3fn
        codes, kv_rope [num_pages, page_size, Dr] (bf16, or e4m3fn codes with kv_rope_dtype
        "float8_e4m3fn"), kv_scales [num_pages, page_size, G] (float32, or uint8 e8m0 codes).
        Packed layout: kv_cache [num_pages, page_size, Dc + 4G + 2Dr] uint8 slot bytes, no
        kv_rope or kv_scales. kv_scale multiplies an e4m3 RoPE part and must be 1 with a bf16 one.
        """
        if isinstance(layer_id, bool) or not isinstance(layer_id, numbers.Integral) or layer_id < 0:
            _fail("/layers", f"layer_id = {layer_id!r} is not a non-negative integer")
        path = f"/layers/L{layer_id:03d}"
        self._require_open(path)
        if layer_id in self._layers:
            _fail(path, f"layer {layer_id} was already added")
        if self._steps:
            _fail(path, "layers must be added before the first step (every step holds every layer)")
        scale = np.float32(float(kv_scale))
        if not (math.isfinite(scale) and scale > 0):
            _fail(path, f"kv_scale = {float(kv_scale)} is not finite and > 0 (as float32)")
        if self.kv_dtype == "bfloat16" and scale != 1:
            _fail(path, f"kv_scale = {float(kv_scale)} must be 1 for a bfloat16 pool")
        if self.kv_rope_dtype == "bfloat16" and scale != 1:
            _fail(path, f"kv_scale = {float(kv_scale)} must be 1 with a bfloat16 RoPE part "
                        "(kv_rope_dtype; it multiplies an e4m3 RoPE part only)")
        pool = to_numpy(kv_cache, f"{path}/kv_cache")
        first = self.num_pages is None
        if first:
            if pool.ndim != 3 or pool.shape[1:] != (self.page_size, self.kv_cache_width):
                _fail(f"{path}/kv_cache", f"shape {tuple(pool.shape)} is not (num_pages, "
                                          f"{self.page_size}, {self.kv_cache_width})")
            self.num_pages = pool.shape[0]
        try:
            tensors = self._pool_tensors(path, "", pool, kv_rope, kv_scales)
            if kv_source is not None:
                tensors["kv_source"] = _bf16_storage(kv_source, self._pool_shape(self.row_width),
                                                     f"{path}/kv_source", self.float32_inputs)
        except ValueError:
            if first:
                self.num_pages = None
            raise
        group = self._file["layers"].create_group(path.rsplit("/", 1)[1])
        group.attrs["layer_id"] = np.int32(layer_id)
        group.attrs["kv_scale"] = scale
        for name, (arr, dtype_attr) in tensors.items():
            self._write(group, name, arr, dtype_attr)
        self._layers[int(layer_id)] = group.name.rsplit("/", 1)[1]

    def add_step(self, kind, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, new_kv_slots):
        """Adds /steps/S### (the next in replay order) and returns its StepWriter.

        kind: "prefill" (extend, causal) or "decode" (at most one row per request).
        Index arrays follow FlashInfer's paged layout; see docs/kvdump-v1.md "Steps" and "Semantics".
        """
        path = f"/steps/S{len(self._steps):03d}"
        self._require_open(path)
        if not self._layers:
            _fail(path, "add the layers' pools (add_layer) before the first step")
        arrays = validate_step_indices(path, kind, qo_indptr, kv_indptr, kv_indices,
                                       kv_last_page_len, new_kv_slots, self.num_pages,
                                       self.page_size)
        group = self._file["steps"].create_group(path.rsplit("/", 1)[1])
        group.attrs["kind"] = kind
        for name, arr in arrays.items():
            self._write(group, name, arr, None)
        _, positions = _row_positions(arrays["qo_indptr"], arrays["kv_indptr"],
                                      arrays["kv_last_page_len"], self.page_size)
        step = StepWriter(self, group, path, int(arrays["qo_indptr"][-1]), positions)
        self._steps.append(step)
        return step

    def close(self):
        """Checks that every step holds every layer, then closes the file: renamed onto the path
        when complete; an incomplete one raises ValueError and is deleted (an incremental writer's
        file is kept as written)."""
        if self._file is None:
            return
        complete = False
        try:
            for step in self._steps:
                for layer_id in sorted(self._layers):
                    if layer_id not in step.layers:
                        _fail(f"{step.path}/L{layer_id:03d}",
                              "missing: every step holds every layer of /layers")
            complete = True
        finally:
            self._finish(keep=complete)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
        else:  # keep the first error: the dump is incomplete, an atomic writer leaves no file
            self._finish(keep=False)
        return False


class StepWriter:
    """One step of a KvDumpWriter; add each layer's tensors with add_layer."""

    def __init__(self, writer, group, path, num_rows, positions):
        self._writer = writer
        self._group = group
        self.path = path
        self.num_rows = num_rows  # Nq
        # Token position of every query row [Nq] (kvdump-v1 "Causal positions").
        self.positions = positions
        self.layers = set()

    def add_layer(self, layer_id, q_nope, q_pe, new_kv, out=None, lse=None, kv_cache_after=None,
                  kv_rope_after=None, kv_scales_after=None, topk_indices=None):
        """Adds /steps/S###/L###.

        q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D]: bfloat16 (new_kv before quantization).
        out [Nq, H, Dc] bfloat16, lse [Nq, H] float32 (natural log): the production kernel's
        outputs, optional. kv_cache_after: the pool after the step, same type as kv_cache; in
        the v1.1 split layout with kv_rope_after and kv_scales_after (all three or none), shaped
        like the layer's kv_cache, kv_rope and kv_scales.
        topk_indices [Nq, K] (v1.1 sparse attention, optional): the token positions of its
        request that row i attends to, -1 padding; each row lists at least one position, none
        twice, none past its own position. Writing it marks the file format_minor_version = 1.
        """
        w = self._writer
        path = f"{self.path}/L{layer_id:03d}"
        w._require_open(path)
        if layer_id not in w._layers:
            _fail(path, f"layer {layer_id} is not in /layers (add_layer it before the steps)")
        if layer_id in self.layers:
            _fail(path, f"layer {layer_id} was already added to this step")
        nq, h, dc, dr = self.num_rows, w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim
        tensors = {
            "q_nope": _bf16_storage(q_nope, (nq, h, dc), f"{path}/q_nope", w.float32_inputs),
            "q_pe": _bf16_storage(q_pe, (nq, h, dr), f"{path}/q_pe", w.float32_inputs),
            "new_kv": _bf16_storage(new_kv, (nq, dc + dr), f"{path}/new_kv", w.float32_inputs),
        }
        if out is not None:
            tensors["out"] = _bf16_storage(out, (nq, h, dc), f"{path}/out")
        if lse is not None:
            arr = to_numpy(lse, f"{path}/lse")
            _check_shape(arr, (nq, h), f"{path}/lse")
            if arr.dtype != np.float32:
                _fail(f"{path}/lse", f"dtype {arr.dtype} is not float32")
            tensors["lse"] = (arr.astype("<f4", copy=False), "float32")
        if kv_cache_after is not None:
            tensors.update(w._pool_tensors(path, "_after", kv_cache_after, kv_rope_after,
                                           kv_scales_after))
        else:
            for name, value in (("kv_rope_after", kv_rope_after),
                                ("kv_scales_after", kv_scales_after)):
                if value is not None:
                    _fail(f"{path}/{name}", "given without kv_cache_after (the pool after the "
                                            "step is all its datasets or none)")
        if topk_indices is not None:
            tensors["topk_indices"] = (_topk_storage(topk_indices, self.positions,
                                                     f"{path}/topk_indices"), None)
            w._use_minor_version()
        group = self._group.create_group(path.rsplit("/", 1)[1])
        for name, (arr, dtype_attr) in tensors.items():
            w._write(group, name, arr, dtype_attr)
        self.layers.add(int(layer_id))
