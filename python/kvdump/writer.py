"""Writer of kvdump v1 files (docs/kvdump-v1.md): what a server captures for `kvaudit` to replay.

Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = query rows of
a step, B = requests of a step):
  /layers/L###/kv_cache, kv_source, /steps/S###/L###/kv_cache_after : [num_pages, page_size, D]
  q_nope : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
  out    : [Nq, H, Dc]   lse  : [Nq, H]
  qo_indptr, kv_indptr : [B+1]   kv_last_page_len : [B]   kv_indices : [nnz_pages]
  new_kv_slots : [Nq]

Every object is validated before it is written; a violation raises ValueError whose message starts
with the HDF5 path of the object, e.g. "/steps/S001/L000/q_nope: shape (4, 16, 512) != (4, 8, 512)".

Element types accepted (numpy arrays, or torch tensors by duck typing; torch is never imported
unless a torch tensor is passed):
  bfloat16 tensors : uint16 raw bits, stored as is; float32, rounded to bf16 bits (nearest-even,
                     exact for values that are widened bf16); torch.bfloat16 / ml_dtypes bfloat16.
  float8 pool      : uint8 raw e4m3fn codes; torch.float8_e4m3fn / ml_dtypes float8_e4m3fn.
                     Floats are refused: quantize them with kvdump.quantize_e4m3 first.
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

from .codec import bf16_bits_from_float32

KV_DTYPES = ("float8_e4m3fn", "bfloat16")
STEP_KINDS = ("prefill", "decode")


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


def _check_shape(arr, expected, path):
    if tuple(arr.shape) != tuple(expected):
        _fail(path, f"shape {tuple(arr.shape)} != {tuple(expected)}")


def _bf16_storage(x, shape, path):
    """(uint16 little-endian bits, "bfloat16") of a bfloat16 tensor given as bits or float32."""
    arr = to_numpy(x, path)
    _check_shape(arr, shape, path)
    if arr.dtype == np.uint16:
        return arr.astype("<u2", copy=False), "bfloat16"
    if arr.dtype == np.float32:
        return bf16_bits_from_float32(arr).astype("<u2", copy=False), "bfloat16"
    _fail(path, f"dtype {arr.dtype} is neither bfloat16 bits (uint16) nor float32")


def _pool_storage(x, kv_dtype, shape, path):
    """Storage of a pool: e4m3fn codes for a float8 pool, bf16 bits for a bfloat16 pool."""
    if kv_dtype == "bfloat16":
        return _bf16_storage(x, shape, path)
    arr = to_numpy(x, path)
    _check_shape(arr, shape, path)
    if arr.dtype != np.uint8:
        _fail(path, f"dtype {arr.dtype} is not float8_e4m3fn codes (uint8); "
                    "quantize values with kvdump.quantize_e4m3 first")
    return arr.astype("<u1", copy=False), "float8_e4m3fn"


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
    kv_len = np.where(pages > 0, (pages - 1) * page_size + last, 0)
    short = np.flatnonzero(rows > kv_len)
    if short.size:
        b = int(short[0])
        _fail(f"{path}/kv_indptr", f"request {b} has {rows[b]} query rows but kv_len {kv_len[b]}; "
                                   "each row's own token must be in its pages")
    request = np.repeat(np.arange(batch), rows)
    position = kv_len[request] - rows[request] + (np.arange(num_rows) - qo_indptr[request])
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


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


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

    The file appears at `path` only when close() succeeds (written under a temporary name in the
    same folder until then; deleted after an exception). incremental=True writes `path` directly
    instead, for a capture that must leave a readable file when it stops early: call flush() after
    each step.
    """

    def __init__(self, path, *, model, producer, num_heads, kv_lora_rank, qk_rope_head_dim,
                 sm_scale, page_size, kv_dtype="float8_e4m3fn", compression=None,
                 incremental=False):
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
        self.num_heads = int(num_heads)
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.page_size = int(page_size)
        self.kv_dtype = kv_dtype
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
        attrs["model"] = model
        attrs["producer"] = producer
        attrs["num_heads"] = np.int32(num_heads)
        attrs["kv_lora_rank"] = np.int32(kv_lora_rank)
        attrs["qk_rope_head_dim"] = np.int32(qk_rope_head_dim)
        attrs["sm_scale"] = np.float64(sm_scale)
        attrs["page_size"] = np.int32(page_size)
        attrs["kv_dtype"] = kv_dtype
        attrs["kv_scale_kind"] = "per_tensor"
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

    def _pool_shape(self):
        return (self.num_pages, self.page_size, self.row_width)

    def _require_open(self, path):
        if self._file is None:
            _fail(path, "the writer is closed")

    def _write(self, group, name, arr, dtype_attr):
        compression = self._compression if arr.size else None
        dataset = group.create_dataset(name, data=np.ascontiguousarray(arr),
                                       compression=compression)
        if dtype_attr:
            dataset.attrs["dtype"] = dtype_attr

    def add_layer(self, layer_id, kv_scale, kv_cache, kv_source=None):
        """Adds /layers/L###: the pool of layer `layer_id` before step 0.

        kv_cache: [num_pages, page_size, D] e4m3fn codes (uint8), or bf16 for a bfloat16 pool.
        kv_source: optional, same shape, bfloat16: the values the pool was quantized from.
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
        pool = to_numpy(kv_cache, f"{path}/kv_cache")
        if self.num_pages is None:
            if pool.ndim != 3 or pool.shape[1:] != (self.page_size, self.row_width):
                _fail(f"{path}/kv_cache", f"shape {tuple(pool.shape)} is not (num_pages, "
                                          f"{self.page_size}, {self.row_width})")
            num_pages = pool.shape[0]
        else:
            num_pages = self.num_pages
        shape = (num_pages, self.page_size, self.row_width)
        pool_bits, pool_dtype = _pool_storage(pool, self.kv_dtype, shape, f"{path}/kv_cache")
        source = None
        if kv_source is not None:
            source = _bf16_storage(kv_source, shape, f"{path}/kv_source")
        self.num_pages = num_pages
        group = self._file["layers"].create_group(path.rsplit("/", 1)[1])
        group.attrs["layer_id"] = np.int32(layer_id)
        group.attrs["kv_scale"] = scale
        self._write(group, "kv_cache", pool_bits, pool_dtype)
        if source is not None:
            self._write(group, "kv_source", *source)
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
        step = StepWriter(self, group, path, int(arrays["qo_indptr"][-1]))
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

    def __init__(self, writer, group, path, num_rows):
        self._writer = writer
        self._group = group
        self.path = path
        self.num_rows = num_rows  # Nq
        self.layers = set()

    def add_layer(self, layer_id, q_nope, q_pe, new_kv, out=None, lse=None, kv_cache_after=None):
        """Adds /steps/S###/L###.

        q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D]: bfloat16 (new_kv before quantization).
        out [Nq, H, Dc] bfloat16, lse [Nq, H] float32 (natural log): the production kernel's
        outputs, optional. kv_cache_after: the pool after the step, same type as kv_cache.
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
            "q_nope": _bf16_storage(q_nope, (nq, h, dc), f"{path}/q_nope"),
            "q_pe": _bf16_storage(q_pe, (nq, h, dr), f"{path}/q_pe"),
            "new_kv": _bf16_storage(new_kv, (nq, dc + dr), f"{path}/new_kv"),
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
            tensors["kv_cache_after"] = _pool_storage(kv_cache_after, w.kv_dtype, w._pool_shape(),
                                                      f"{path}/kv_cache_after")
        group = self._group.create_group(path.rsplit("/", 1)[1])
        for name, (arr, dtype_attr) in tensors.items():
            w._write(group, name, arr, dtype_attr)
        self.layers.add(int(layer_id))
