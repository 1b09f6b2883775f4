"""The backend side of kvaudit's external-backend protocol, versions 1 and 2
(docs/backend-protocol.md).

kvaudit writes one JSON request per line to our standard input and reads exactly one JSON reply
per request, in order, from our standard output. Bulk data are files in the session directory
that kvaudit names in `hello`; a message refers to one by an array descriptor

    {"file": "q_nope.bin", "dtype": "bfloat16", "shape": [Nq, H, Dc]}

(relative to the session directory; row-major, little-endian, exactly prod(shape) elements).
Element types: uint8 (e4m3fn codes), bfloat16 (raw bits, held here as uint16), float32, int32.

Versions: kvaudit asks for 1 with a per_tensor dump (and a bench session) and for 2 with a kvdump
v1.1 per_token_group dump, whose hello model adds kv_scale_group_size, kv_scale_format,
kv_rope_dtype and slot_bytes, and whose pool file is uint8 [num_slots, slot_bytes]: each slot's
bytes [Dc e4m3 codes][G scales: float32 little-endian, or one e8m0 byte each][Dr RoPE: bf16
little-endian or e4m3 codes] (ModelInfo.slot_bytes; grouped.py reads and writes them). This
program answers either, with the version asked for.

This module is the message loop and everything that does not depend on the adapter: parsing and
checking requests, reading and writing arrays (numpy fromfile / memmap), error replies. An adapter
(torch_mla.py, flashinfer_fp8.py, ...) implements `Adapter`; torch is never imported here, so a
missing torch is an `unsupported` reply from the adapter rather than an ImportError.

Exit statuses of `Server.run`: 0 after `bye` or when kvaudit closes our standard input; 2 when the
hello cannot be read (one line on stderr, no reply) or is refused (an error reply, then exit).
"""

import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from ..writer import validate_step_indices

PROTOCOL = "kvaudit-backend"
VERSIONS = (1, 2)  # 2: per_token_group pools too
VERSION = VERSIONS[-1]
ERROR_KINDS = ("unsupported", "bad_input", "internal")
ARRAY_DTYPES = {"uint8": "<u1", "bfloat16": "<u2", "float32": "<f4", "int32": "<i4"}
KV_DTYPES = ("float8_e4m3fn", "bfloat16")
SCALE_KINDS = ("per_tensor", "per_token_group")
SCALE_FORMATS = ("float32", "power_of_two", "e8m0")
STEP_KINDS = ("prefill", "decode")
BENCH_KINDS = ("decode", "prefill")


class BackendError(Exception):
    """A failure that becomes an error reply: kind is one of ERROR_KINDS."""

    def __init__(self, kind, message):
        assert kind in ERROR_KINDS, kind
        super().__init__(message)
        self.kind = kind
        self.message = message


def unsupported(message):
    return BackendError("unsupported", message)


def bad_input(message):
    return BackendError("bad_input", message)


# ---------------------------------------------------------------------------------------------
# Array descriptors


@dataclass(frozen=True)
class ArraySpec:
    """A checked array descriptor: absolute path, protocol dtype name, shape."""

    path: str
    dtype: str
    shape: tuple

    @property
    def numpy_dtype(self):
        return np.dtype(ARRAY_DTYPES[self.dtype])

    @property
    def count(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self):
        return self.count * self.numpy_dtype.itemsize


class SessionFiles:
    """The session directory of a run and the arrays in it."""

    def __init__(self, directory):
        if not isinstance(directory, str) or not directory:
            raise bad_input("hello: session_dir is not a non-empty string")
        if not os.path.isdir(directory):
            raise bad_input(f"hello: session_dir {directory} is not a directory")
        self.directory = os.path.realpath(directory)

    def spec(self, descriptor, name):
        """The checked descriptor `name` of a message (a file inside the session directory)."""
        if not isinstance(descriptor, dict):
            raise bad_input(f"{name}: the array descriptor is not an object")
        file, dtype = descriptor.get("file"), descriptor.get("dtype")
        shape = descriptor.get("shape")
        if not isinstance(file, str) or not file or os.path.isabs(file):
            raise bad_input(f"{name}: file {file!r} is not a path relative to the session "
                            "directory")
        path = os.path.realpath(os.path.join(self.directory, file))
        if os.path.commonpath([path, self.directory]) != self.directory:
            raise bad_input(f"{name}: file {file!r} is outside the session directory")
        if dtype not in ARRAY_DTYPES:
            raise bad_input(f"{name}: dtype {dtype!r} is not one of {', '.join(ARRAY_DTYPES)}")
        if (not isinstance(shape, list)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            raise bad_input(f"{name}: shape {shape!r} is not a list of non-negative integers")
        return ArraySpec(path, dtype, tuple(shape))

    @staticmethod
    def expect(spec, name, dtypes, shape):
        """Checks the descriptor's dtype (one of `dtypes`) and shape (None entries are free)."""
        if spec.dtype not in dtypes:
            raise bad_input(f"{name}: dtype {spec.dtype} is not {' or '.join(dtypes)}")
        if shape is not None and (len(spec.shape) != len(shape) or any(
                want is not None and got != want for got, want in zip(spec.shape, shape))):
            wanted = "[" + ", ".join("*" if n is None else str(n) for n in shape) + "]"
            raise bad_input(f"{name}: shape {list(spec.shape)} is not {wanted}")

    @staticmethod
    def _check_size(spec, name):
        try:
            size = os.path.getsize(spec.path)
        except OSError as error:
            raise bad_input(f"{name}: cannot read {spec.path}: {error.strerror}") from None
        if size != spec.nbytes:
            raise bad_input(f"{name}: {spec.path} holds {size} bytes, but {spec.dtype} "
                            f"{list(spec.shape)} is {spec.nbytes}")

    def read(self, spec, name):
        """A new in-memory array holding the file (np.fromfile: one read)."""
        self._check_size(spec, name)
        if spec.count == 0:
            return np.zeros(spec.shape, spec.numpy_dtype)
        return np.fromfile(spec.path, dtype=spec.numpy_dtype).reshape(spec.shape)

    def map(self, spec, name):
        """The file mapped read-write (np.memmap): stores into the array land in the file."""
        self._check_size(spec, name)
        if spec.count == 0:  # mmap cannot map an empty file
            return np.zeros(spec.shape, spec.numpy_dtype)
        return np.memmap(spec.path, dtype=spec.numpy_dtype, mode="r+", shape=spec.shape)

    @staticmethod
    def write(spec, name, array):
        """Writes `array` (exactly the descriptor's dtype and shape) to the file, in place."""
        array = np.ascontiguousarray(array)
        if array.dtype != spec.numpy_dtype or tuple(array.shape) != spec.shape:
            raise BackendError("internal", f"{name}: the adapter produced {array.dtype} "
                                           f"{list(array.shape)}, not {spec.dtype} "
                                           f"{list(spec.shape)}")
        # Overwrite rather than replace the file: kvaudit may hold it mapped.
        fd = os.open(spec.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with os.fdopen(fd, "wb", closefd=False) as out:
                out.write(memoryview(array).cast("B"))
            os.ftruncate(fd, spec.nbytes)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class ModelInfo:
    """hello's `model` (the dump's root attributes) and options of the run."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    sm_scale: float
    page_size: int
    num_slots: int
    kv_dtype: str
    kv_scale_kind: str
    name: str = ""
    reciprocal_scale: bool = False
    bench_only: bool = False  # hello had no model: a `kvaudit bench --peer` session
    version: int = 1  # the protocol version of the session
    # per_token_group (version 2) only: channels per scale, the scales' and the RoPE part's storage
    kv_scale_group_size: int = 0
    kv_scale_format: str = ""
    kv_rope_dtype: str = ""

    @property
    def row_width(self):
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_pages(self):
        return self.num_slots // self.page_size

    @property
    def grouped(self):
        """A per_token_group pool: every slot holds its own latent scales."""
        return self.kv_scale_kind == "per_token_group"

    @property
    def num_scale_groups(self):
        return self.kv_lora_rank // self.kv_scale_group_size if self.grouped else 0

    @property
    def scale_bytes(self):
        """Bytes of one group scale: 4 (float32, power_of_two) or 1 (e8m0)."""
        return 1 if self.kv_scale_format == "e8m0" else 4

    @property
    def scales_offset(self):
        """Byte offset of a grouped slot's scales (after its Dc latent codes)."""
        return self.kv_lora_rank

    @property
    def rope_offset(self):
        """Byte offset of a grouped slot's RoPE part (after its scales)."""
        return self.kv_lora_rank + self.num_scale_groups * self.scale_bytes

    @property
    def slot_bytes(self):
        """Bytes of one slot of the pool file: Dc + G * scale_bytes + Dr * (2 or 1) (grouped),
        D (an FP8 pool) or 2 D (a bfloat16 pool)."""
        if self.grouped:
            return self.rope_offset + self.qk_rope_head_dim * (
                2 if self.kv_rope_dtype == "bfloat16" else 1)
        return self.row_width * (2 if self.kv_dtype == "bfloat16" else 1)

    @property
    def pool_dtype(self):
        """The pool file's element type: bfloat16 for a bfloat16 pool, else uint8."""
        return "bfloat16" if self.kv_dtype == "bfloat16" and not self.grouped else "uint8"

    @property
    def pool_width(self):
        """Elements per slot in the pool file: slot_bytes (grouped), else D."""
        return self.slot_bytes if self.grouped else self.row_width


@dataclass(frozen=True)
class LayerInfo:
    group: str
    layer_id: int
    kv_scale: float  # already rounded to float32 (kvdump-v1: the float32 value is the scale)


@dataclass
class StepRequest:
    """A checked `step`: index arrays as int32, tensors as numpy arrays (bfloat16 as uint16 bits,
    otherwise float32), and the output descriptors."""

    index: int
    group: str
    kind: str
    layer: LayerInfo
    pool_reloaded: bool
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    new_kv_slots: np.ndarray
    q_nope: np.ndarray
    q_pe: np.ndarray
    new_kv: np.ndarray
    out: ArraySpec = None
    lse: ArraySpec = None
    # Version 2, a sparse step (kvdump v1.1): int32 [Nq, K] token positions of each row's request
    # that the row attends to, -1 padding (kvaudit has checked them: causal, distinct, >= 1).
    topk_indices: np.ndarray = None

    @property
    def where(self):
        return f"{self.group} {self.layer.group}"

    @property
    def num_rows(self):
        return int(self.qo_indptr[-1])


@dataclass
class StepResult:
    """What an adapter computed for a step: out as bf16 bits [Nq, H, Dc] (uint16), lse float32
    [Nq, H] (natural log unless a planted fault says otherwise), the time of the step itself, and
    a pool descriptor when the adapter changed its pool's storage (docs/backend-protocol.md)."""

    out_bits: np.ndarray
    lse: np.ndarray
    compute_seconds: float = None
    pool: dict = None


@dataclass(frozen=True)
class BenchCase:
    """A `bench` request's case: the peer generates its own data of this shape."""

    name: str
    kind: str
    batch: int
    context: int
    num_heads: int
    page_size: int
    pool_slots: int
    kv_dtype: str
    q_len: int
    warmup: int
    iterations: int
    flush_l2: bool

    @property
    def pages_per_request(self):
        return -(-self.context // self.page_size)

    @property
    def effective_pool_slots(self):
        needed = self.batch * self.pages_per_request * self.page_size
        return max(self.pool_slots, needed)


class Adapter:
    """What a backend implements. `start` runs at hello and returns the `describe` object, or
    raises BackendError("unsupported", ...) naming what is missing."""

    name = "?"

    def __init__(self, options=None):
        self.options = options  # the command line's options (argparse.Namespace)

    def start(self, model, files):
        raise NotImplementedError

    def capabilities(self):
        return ["check"]

    def load_layer(self, layer, pool_spec):
        raise NotImplementedError

    def run_step(self, step):
        """Writes the step's rows into the layer's pool, attends, keeps the pool file current and
        returns a StepResult."""
        raise NotImplementedError

    def bench(self, case):
        raise unsupported(f"{self.name} has no bench")

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------
# Parsing


def _field(message, key, kinds, what):
    value = message.get(key)
    if isinstance(value, bool) and bool not in kinds:
        value = None
    if not isinstance(value, kinds):
        raise bad_input(f"{what}: {key} is missing or not {kinds[0].__name__}")
    return value


# The model a hello without one (a bench session has no dump) stands for: GLM-5's MLA, the widths
# the bench's cases have, and its softmax scale (qk_head_dim 192 + 64 = 256)^-0.5.
BENCH_MODEL = {"num_heads": 16, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "sm_scale": 256 ** -0.5, "page_size": 1, "num_slots": 0,
               "kv_dtype": "float8_e4m3fn", "kv_scale_kind": "per_tensor"}


def parse_model(hello):
    version = hello.get("version", 1)
    model = hello.get("model")
    if model is None:
        return ModelInfo(name=str(hello.get("name", "")), bench_only=True, version=version,
                         **BENCH_MODEL)
    if not isinstance(model, dict):
        raise bad_input("hello: model is not an object")
    ints = {}
    for key in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "page_size", "num_slots"):
        ints[key] = _field(model, key, (int,), "hello model")
    if min(ints["num_heads"], ints["kv_lora_rank"], ints["page_size"]) < 1:
        raise bad_input("hello model: num_heads, kv_lora_rank and page_size must be positive")
    if ints["qk_rope_head_dim"] < 0 or ints["num_slots"] < 0:
        raise bad_input("hello model: qk_rope_head_dim and num_slots must be non-negative")
    if ints["num_slots"] % ints["page_size"]:
        raise bad_input(f"hello model: num_slots {ints['num_slots']} is not a multiple of "
                        f"page_size {ints['page_size']}")
    sm_scale = _field(model, "sm_scale", (float, int), "hello model")
    if not math.isfinite(sm_scale):
        raise bad_input("hello model: sm_scale is not finite")
    kv_dtype = _field(model, "kv_dtype", (str,), "hello model")
    if kv_dtype not in KV_DTYPES:
        raise unsupported(f"kv_dtype {kv_dtype} is not one of {', '.join(KV_DTYPES)}")
    kind = model.get("kv_scale_kind", "per_tensor")
    group = {}
    if kind == "per_token_group":
        group = parse_group_scales(model, version, ints, kv_dtype)
    elif kind != "per_tensor":
        raise unsupported(f"kv_scale_kind {kind!r} is not "
                          f"{' or '.join(SCALE_KINDS[:2 if version >= 2 else 1])}")
    info = ModelInfo(sm_scale=float(sm_scale), kv_dtype=kv_dtype, kv_scale_kind=kind,
                     name=str(hello.get("name", "")), version=version,
                     reciprocal_scale=bool(hello.get("reciprocal_scale", False)), **group, **ints)
    slot_bytes = model.get("slot_bytes")
    if info.grouped and slot_bytes is not None and slot_bytes != info.slot_bytes:
        raise bad_input(f"hello model: slot_bytes {slot_bytes!r} is not the {info.slot_bytes} "
                        f"bytes of a slot ({info.kv_lora_rank} codes, {info.num_scale_groups} "
                        f"{info.kv_scale_format} scales, {info.qk_rope_head_dim} "
                        f"{info.kv_rope_dtype} RoPE values)")
    return info


def parse_group_scales(model, version, ints, kv_dtype):
    """The per_token_group keys of a version 2 model (kvdump v1.1 root attributes)."""
    if version < 2:
        raise unsupported(f"kv_scale_kind 'per_token_group' needs protocol version 2; this hello "
                          f"asked for version {version}")
    if kv_dtype != "float8_e4m3fn":
        raise bad_input("hello model: kv_scale_kind per_token_group needs kv_dtype float8_e4m3fn")
    group_size = _field(model, "kv_scale_group_size", (int,), "hello model")
    if group_size < 1 or ints["kv_lora_rank"] % group_size:
        raise bad_input(f"hello model: kv_scale_group_size {group_size} does not divide "
                        f"kv_lora_rank {ints['kv_lora_rank']}")
    scale_format = _field(model, "kv_scale_format", (str,), "hello model")
    if scale_format not in SCALE_FORMATS:
        raise unsupported(f"kv_scale_format {scale_format!r} is not one of "
                          f"{', '.join(SCALE_FORMATS)}")
    rope_dtype = _field(model, "kv_rope_dtype", (str,), "hello model")
    if rope_dtype not in KV_DTYPES:
        raise unsupported(f"kv_rope_dtype {rope_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return {"kv_scale_group_size": group_size, "kv_scale_format": scale_format,
            "kv_rope_dtype": rope_dtype}


def parse_layer(message, what):
    layer = message.get("layer")
    if not isinstance(layer, dict):
        raise bad_input(f"{what}: layer is missing or not an object")
    group = _field(layer, "group", (str,), f"{what} layer")
    layer_id = _field(layer, "layer_id", (int,), f"{what} layer")
    scale = float(np.float32(_field(layer, "kv_scale", (float, int), f"{what} layer")))
    if not (math.isfinite(scale) and scale > 0):
        raise bad_input(f"{what} layer {group}: kv_scale {scale} is not finite and > 0")
    return LayerInfo(group, layer_id, scale)


def parse_bench(message, model):
    case = message.get("case")
    if not isinstance(case, dict):
        raise bad_input("bench: case is missing or not an object")
    ints = {key: _field(case, key, (int,), "bench case")
            for key in ("batch", "context", "num_heads", "page_size")}
    if min(ints.values()) < 1:
        raise bad_input("bench case: batch, context, num_heads and page_size must be positive")
    kind = case.get("kind", "decode")
    if kind not in BENCH_KINDS:
        raise bad_input(f"bench case: kind {kind!r} is not decode or prefill")
    q_len = case.get("q_len", 1 if kind == "decode" else None)
    if not isinstance(q_len, int) or isinstance(q_len, bool) or not 1 <= q_len <= ints["context"]:
        raise unsupported(f"bench case {case.get('name', '?')}: a {kind} case needs q_len in "
                          f"1..context (got {q_len!r})")
    if kind == "decode" and q_len != 1:
        raise bad_input("bench case: a decode case has q_len 1")
    pool_slots = case.get("pool_slots", 0)
    if not isinstance(pool_slots, int) or pool_slots < 0:
        raise bad_input("bench case: pool_slots is not a non-negative integer")
    counts = {}
    for key, default in (("warmup", 5), ("iterations", 50)):
        counts[key] = message.get(key, default)
        if not isinstance(counts[key], int) or counts[key] < (1 if key == "iterations" else 0):
            raise bad_input(f"bench: {key} is not a valid count")
    return BenchCase(name=str(case.get("name", "")), kind=kind, pool_slots=pool_slots,
                     kv_dtype=str(case.get("kv_dtype", "float8_e4m3fn")), q_len=q_len,
                     flush_l2=bool(message.get("flush_l2", False)), **counts, **ints)


INDEX_ARRAYS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "new_kv_slots")
TENSOR_INPUTS = ("q_nope", "q_pe", "new_kv")


def parse_step(message, model, files):
    step = message.get("step")
    if not isinstance(step, dict):
        raise bad_input("step: step is missing or not an object")
    index = _field(step, "index", (int,), "step")
    group = _field(step, "group", (str,), "step")
    kind = _field(step, "kind", (str,), "step")
    if kind not in STEP_KINDS:
        raise bad_input(f"step {group}: kind {kind!r} is not prefill or decode")
    layer = parse_layer(message, f"step {group}")
    inputs, outputs = message.get("inputs"), message.get("outputs")
    if not isinstance(inputs, dict) or not isinstance(outputs, dict):
        raise bad_input(f"step {group}: inputs or outputs is missing or not an object")
    arrays = {}
    for name in INDEX_ARRAYS:
        spec = files.spec(inputs.get(name), name)
        files.expect(spec, name, ("int32",), [None])
        arrays[name] = files.read(spec, name)
    # The index rules of kvdump-v1 ("Steps", "Semantics"): kvaudit has validated them, but a
    # broken request must be a bad_input reply, not an IndexError deep inside an adapter.
    try:
        validate_step_indices(f"/steps/{group}", kind, num_pages=model.num_pages,
                              page_size=model.page_size, **arrays)
    except ValueError as error:
        raise bad_input(str(error)) from None
    nq, h = int(arrays["qo_indptr"][-1]), model.num_heads
    dc, dr = model.kv_lora_rank, model.qk_rope_head_dim
    shapes = {"q_nope": [nq, h, dc], "q_pe": [nq, h, dr], "new_kv": [nq, dc + dr]}
    for name in TENSOR_INPUTS:
        spec = files.spec(inputs.get(name), name)
        files.expect(spec, name, ("bfloat16", "float32"), shapes[name])
        arrays[name] = files.read(spec, name)
    if inputs.get("topk_indices") is not None:
        spec = files.spec(inputs.get("topk_indices"), "topk_indices")
        files.expect(spec, "topk_indices", ("int32",), [nq, None])
        arrays["topk_indices"] = files.read(spec, "topk_indices")
    out = files.spec(outputs.get("out"), "out")
    files.expect(out, "out", ("bfloat16",), [nq, h, dc])
    lse = files.spec(outputs.get("lse"), "lse")
    files.expect(lse, "lse", ("float32",), [nq, h])
    return StepRequest(index=index, group=group, kind=kind, layer=layer,
                       pool_reloaded=bool(message.get("pool_reloaded", False)), out=out, lse=lse,
                       **arrays)


# ---------------------------------------------------------------------------------------------
# The loop


def _json_safe(value):
    """describe objects may hold NaN/inf floats; JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclass
class Server:
    """One session: reads requests from `requests` (a binary stream), writes replies to `replies`
    (a binary stream), logs to `log`. `make_adapter()` builds the adapter at hello."""

    make_adapter: object
    requests: object
    replies: object
    log: object = field(default_factory=lambda: sys.stderr)
    adapter: Adapter = None
    model: ModelInfo = None
    files: SessionFiles = None
    layers: dict = field(default_factory=dict)  # layer group -> LayerInfo

    def reply(self, message):
        line = json.dumps(_json_safe(message), separators=(",", ":"), allow_nan=False)
        self.replies.write(line.encode("utf-8") + b"\n")
        self.replies.flush()

    def reply_error(self, error):
        self.reply({"type": "error", "kind": error.kind, "message": error.message})

    def say(self, text):
        print(f"kvdump.backends: {text}", file=self.log, flush=True)

    def next_request(self):
        """The next request as a dict, or None at the end of input. Raises ValueError for a line
        that is not a JSON object."""
        for raw in self.requests:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError("a request is not a JSON object")
            return message
        return None

    def run(self):
        try:
            return self._run()
        except BrokenPipeError:  # kvaudit went away; nobody is left to tell
            return 0
        finally:
            if self.adapter is not None:
                self.adapter.close()

    def _run(self):
        try:
            hello = self.next_request()
        except ValueError as error:
            self.say(f"the hello request cannot be read: {error}")
            return 2
        if hello is None:
            self.say("no hello request: standard input ended before the first line")
            return 2
        try:
            self.reply(self.handle_hello(hello))
        except BackendError as error:
            self.reply_error(error)
            return 2
        except Exception as error:  # noqa: BLE001 - any failure is an error reply, not a traceback
            self.reply_error(self.internal(error))
            return 2
        return self.serve()

    def serve(self):
        while True:
            try:
                message = self.next_request()
            except ValueError as error:
                self.reply_error(bad_input(f"unreadable request: {error}"))
                continue
            if message is None:
                return 0
            kind = message.get("type")
            if kind == "bye":
                self.reply({"type": "bye"})
                return 0
            try:
                self.reply(self.dispatch(kind, message))
            except BackendError as error:
                self.reply_error(error)
            except Exception as error:  # noqa: BLE001
                self.reply_error(self.internal(error))

    def internal(self, error):
        traceback.print_exc(file=self.log)
        return BackendError("internal", f"{type(error).__name__}: {error}")

    def handle_hello(self, hello):
        if hello.get("type") != "hello":
            raise bad_input(f"the first request is {hello.get('type')!r}, not hello")
        if hello.get("protocol") != PROTOCOL:
            raise unsupported(f"protocol {hello.get('protocol')!r} is not {PROTOCOL}")
        version = hello.get("version")
        if isinstance(version, bool) or version not in VERSIONS:
            raise unsupported(f"protocol version {version!r} is not supported (this program "
                              f"speaks versions {', '.join(map(str, VERSIONS))})")
        self.model = parse_model(hello)
        self.files = SessionFiles(hello.get("session_dir"))
        self.adapter = self.make_adapter()
        describe = self.adapter.start(self.model, self.files)
        return {"type": "hello", "version": version,
                "capabilities": self.adapter.capabilities(), "describe": describe}

    def dispatch(self, kind, message):
        if kind in ("layer", "step") and self.model.bench_only:
            raise bad_input(f"{kind}: the hello had no model (a bench session has no dump)")
        if kind == "layer":
            layer = parse_layer(message, "layer")
            spec = self.files.spec(message.get("pool"), "pool")
            self.files.expect(spec, "pool", (self.model.pool_dtype,),
                              [self.model.num_slots, self.model.pool_width])
            self.adapter.load_layer(layer, spec)
            self.layers[layer.group] = layer
            return {"type": "ok"}
        if kind == "step":
            step = parse_step(message, self.model, self.files)
            if step.layer.group not in self.layers:
                raise bad_input(f"step {step.group}: layer {step.layer.group} has had no layer "
                                "request")
            started = time.perf_counter()
            result = self.adapter.run_step(step)
            self.files.write(step.out, "out", result.out_bits)
            self.files.write(step.lse, "lse", result.lse)
            seconds = result.compute_seconds
            reply = {"type": "result",
                     "compute_seconds": time.perf_counter() - started if seconds is None
                     else seconds}
            if result.pool is not None:
                reply["pool"] = result.pool
            return reply
        if kind == "bench":
            case = parse_bench(message, self.model)
            return {"type": "bench", **self.adapter.bench(case)}
        if kind == "hello":
            raise bad_input("hello was already received")
        raise bad_input(f"unknown request type {kind!r}")
