"""kvaudit's side of the external-backend protocol (docs/backend-protocol.md, versions 1 and 2),
in Python, for testing the adapters of kvdump.backends without kvaudit.

    with Driver([sys.executable, "-m", "kvdump.backends", "torch", "--device", "cpu"]) as d:
        d.hello(model)                      # -> the hello reply (or an error reply)
        d.layer("L000", 0, kv_scale, pool)  # pool: [num_slots, D] uint8 codes
        result = d.step(0, "S000", "prefill", "L000", 0, kv_scale, indices, q_nope, q_pe, new_kv)
        result.reply, result.out_bits, result.lse, result.pool
        d.bye()

Written from the protocol document only (no code shared with the server): a session directory
of its own, one JSON request per line on the program's stdin, one reply per line read back with
a timeout, arrays as raw little-endian files. The program's stderr goes to a file (`stderr()`).
`replay_dump` drives a whole kvdump file through a backend, as kvaudit does: every layer, then
its steps in order, asking for version 2 with a kvdump v1.1 per_token_group file (its pool file
then holds each slot's bytes: codes, scales, RoPE) and sending a sparse step's topk_indices, as
kvaudit's exec backend does.
"""

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DTYPES = {"uint8": "<u1", "bfloat16": "<u2", "float32": "<f4", "int32": "<i4"}


class ProtocolFailure(AssertionError):
    """The program broke the protocol (no reply, not JSON, exited)."""


@dataclass
class StepOutput:
    reply: dict
    out_bits: np.ndarray = None  # uint16 [Nq, H, Dc]
    lse: np.ndarray = None  # float32 [Nq, H]
    pool: np.ndarray = None  # the pool file after the reply


class Driver:
    def __init__(self, command, env=None, timeout=120):
        self.session = tempfile.mkdtemp(prefix="kvdump-driver-")
        self.timeout = timeout
        self.stderr_path = os.path.join(self.session, "stderr.log")
        environment = dict(os.environ if env is None else env)
        environment["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(PYTHON_DIR)] + [p for p in [environment.get("PYTHONPATH")] if p])
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=environment, cwd=self.session)
        self._lines = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()
        self.pool_files = {}

    def _read_lines(self):
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    # -- transport -----------------------------------------------------------------------------

    def send(self, message):
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def send_raw(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def receive(self):
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            raise ProtocolFailure(f"no reply within {self.timeout} s; stderr:\n{self.stderr()}")
        if line is None:
            raise ProtocolFailure(f"the program closed its stdout (exit {self.proc.poll()}); "
                                  f"stderr:\n{self.stderr()}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise ProtocolFailure(f"not a JSON reply: {line!r}")
        if not isinstance(reply, dict) or "type" not in reply:
            raise ProtocolFailure(f"not a reply object: {line!r}")
        return reply

    def request(self, message):
        self.send(message)
        return self.receive()

    def stderr(self):
        self._stderr.flush()
        with open(self.stderr_path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def wait(self, timeout=None):
        """The program's exit status (after its stdin is closed)."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        return self.proc.wait(timeout=timeout or self.timeout)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            try:
                stream.close()
            except OSError:  # a broken pipe on flush
                pass
        shutil.rmtree(self.session, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- arrays --------------------------------------------------------------------------------

    def put(self, name, array, dtype):
        """Writes `array` as `dtype` (bfloat16: uint16 bits) and returns its descriptor."""
        array = np.ascontiguousarray(array, dtype=DTYPES[dtype])
        array.tofile(os.path.join(self.session, name))
        return {"file": name, "dtype": dtype, "shape": list(array.shape)}

    def get(self, descriptor):
        path = os.path.join(self.session, descriptor["file"])
        return np.fromfile(path, dtype=DTYPES[descriptor["dtype"]]).reshape(descriptor["shape"])

    @staticmethod
    def output(name, dtype, shape):
        return {"file": name, "dtype": dtype, "shape": list(shape)}

    # -- messages ------------------------------------------------------------------------------

    def hello(self, model, name="test", reciprocal_scale=False, version=1):
        return self.request({"type": "hello", "protocol": "kvaudit-backend", "version": version,
                             "name": name, "session_dir": self.session, "model": model,
                             "reciprocal_scale": reciprocal_scale})

    def layer(self, group, layer_id, kv_scale, pool, dtype="uint8"):
        descriptor = self.put(f"pool_{group}.bin", pool, dtype)
        self.pool_files[group] = descriptor
        return self.request({"type": "layer",
                             "layer": {"group": group, "layer_id": layer_id, "kv_scale": kv_scale},
                             "pool": descriptor})

    def step(self, index, group, kind, layer_group, layer_id, kv_scale, indices, q_nope, q_pe,
             new_kv, tensor_dtype="bfloat16", pool_reloaded=False, topk_indices=None):
        """indices: dict of the five int arrays; q_nope, q_pe, new_kv as uint16 bf16 bits (or
        float32 with tensor_dtype="float32"); topk_indices int32 [Nq, K] for a sparse step
        (version 2)."""
        inputs = {name: self.put(f"{name}.bin", indices[name], "int32")
                  for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                               "new_kv_slots")}
        for name, array in (("q_nope", q_nope), ("q_pe", q_pe), ("new_kv", new_kv)):
            inputs[name] = self.put(f"{name}.bin", array, tensor_dtype)
        if topk_indices is not None:
            inputs["topk_indices"] = self.put("topk_indices.bin", topk_indices, "int32")
        nq, heads, dc = np.shape(q_nope)
        outputs = {"out": self.output("out.bin", "bfloat16", [nq, heads, dc]),
                   "lse": self.output("lse.bin", "float32", [nq, heads])}
        reply = self.request({
            "type": "step", "step": {"index": index, "group": group, "kind": kind},
            "layer": {"group": layer_group, "layer_id": layer_id, "kv_scale": kv_scale},
            "pool_reloaded": pool_reloaded, "inputs": inputs, "outputs": outputs})
        if reply["type"] != "result":
            return StepOutput(reply)
        pool_descriptor = reply.get("pool", self.pool_files[layer_group])
        return StepOutput(reply, self.get(outputs["out"]), self.get(outputs["lse"]),
                          self.get(pool_descriptor))

    def bye(self):
        return self.request({"type": "bye"})


def text_attr(attrs, name, default=None):
    value = attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


def grouped_pool(layer, attrs):
    """A per_token_group layer's pool as the protocol's pool file holds it: uint8 [S, slot_bytes],
    each slot [Dc codes][G scales: float32 LE or e8m0 bytes][Dr RoPE: bf16 LE or e4m3 codes]
    (kvdump v1.1; the packed flashmla_fp8 slot already is that)."""
    cache = layer["kv_cache"][()]
    slots = cache.shape[0] * cache.shape[1]
    if text_attr(attrs, "kv_cache_layout", "split") == "flashmla_fp8":
        return cache.reshape(slots, -1).astype(np.uint8)
    scales = layer["kv_scales"][()].reshape(slots, -1)
    scale_bytes = (scales.astype(np.uint8) if text_attr(attrs, "kv_scale_format") == "e8m0"
                   else np.ascontiguousarray(scales.astype("<f4")).view(np.uint8))
    rope = layer["kv_rope"][()].reshape(slots, -1)
    rope_bytes = (np.ascontiguousarray(rope.astype("<u2")).view(np.uint8)
                  if rope.dtype == np.uint16 else rope.astype(np.uint8))
    return np.concatenate([cache.reshape(slots, -1).astype(np.uint8), scale_bytes, rope_bytes],
                          axis=1)


def read_dump(path):
    """A kvdump file as plain numpy (bf16 as uint16 bits): (model, layers, steps)."""
    import h5py

    with h5py.File(path, "r") as f:
        attrs = f.attrs
        scale_kind = text_attr(attrs, "kv_scale_kind", "per_tensor")
        pools = {name: (grouped_pool(g, attrs) if scale_kind == "per_token_group"
                        else g["kv_cache"][()]) for name, g in f["layers"].items()}
        first = next(iter(f["layers"].values()))["kv_cache"]
        model = {"num_heads": int(attrs["num_heads"]), "kv_lora_rank": int(attrs["kv_lora_rank"]),
                 "qk_rope_head_dim": int(attrs["qk_rope_head_dim"]),
                 "sm_scale": float(attrs["sm_scale"]), "page_size": int(attrs["page_size"]),
                 "num_slots": int(first.shape[0] * first.shape[1]),
                 "kv_dtype": text_attr(attrs, "kv_dtype"), "kv_scale_kind": scale_kind}
        if scale_kind == "per_token_group":
            model.update(kv_scale_group_size=int(attrs["kv_scale_group_size"]),
                         kv_scale_format=text_attr(attrs, "kv_scale_format"),
                         kv_rope_dtype=text_attr(attrs, "kv_rope_dtype"),
                         slot_bytes=int(next(iter(pools.values())).shape[-1]))
        layers = [{"group": name, "layer_id": int(g.attrs["layer_id"]),
                   "kv_scale": float(g.attrs["kv_scale"]),
                   "pool": pools[name].reshape(model["num_slots"], -1)}
                  for name, g in f["layers"].items()]
        steps = []
        for index, (name, g) in enumerate(f["steps"].items()):
            indices = {key: g[key][()] for key in ("qo_indptr", "kv_indptr", "kv_indices",
                                                     "kv_last_page_len", "new_kv_slots")}
            tensors = {layer["group"]: {key: g[layer["group"]][key][()]
                                        for key in ("q_nope", "q_pe", "new_kv", "topk_indices")
                                        if key in g[layer["group"]]}
                       for layer in layers}
            steps.append({"index": index, "group": name, "kind": text_attr(g.attrs, "kind"),
                          "indices": indices, "tensors": tensors})
    return model, layers, steps


def replay_dump(driver, path):
    """Replays a kvdump file through the driver's backend, layer by layer; returns
    {(step group, layer group): StepOutput}. Stops at the first error reply."""
    model, layers, steps = read_dump(path)
    reply = driver.hello(model, version=2 if model["kv_scale_kind"] == "per_token_group" else 1)
    if reply["type"] != "hello":
        return {("hello", ""): StepOutput(reply)}
    results = {}
    for layer in layers:
        reply = driver.layer(layer["group"], layer["layer_id"], layer["kv_scale"], layer["pool"])
        if reply["type"] != "ok":
            return {**results, ("layer", layer["group"]): StepOutput(reply)}
        for step in steps:
            t = step["tensors"][layer["group"]]
            output = driver.step(step["index"], step["group"], step["kind"], layer["group"],
                                 layer["layer_id"], layer["kv_scale"], step["indices"],
                                 t["q_nope"], t["q_pe"], t["new_kv"],
                                 topk_indices=t.get("topk_indices"))
            results[(step["group"], layer["group"])] = output
            if output.reply["type"] != "result":
                return results
    return results
