"""kvdump.KvDumpWriter fed real torch tensors (test_writer.py only has a duck-typed stand-in).

One capture (layer 2, kv_scale 0.5, H = 4, Dc = 64, Dr = 16, page_size 4, 8 pages; request 0 holds
5 tokens, then a prefill (request 0 extends by 2, request 1 prefills 3) and a decode) is written
twice: from numpy arrays (bf16 as uint16 bits, fp8 pool as uint8 codes, the example's forms) and
from torch tensors built by torch itself (float32 -> .to(torch.bfloat16), torch.uint8 pools,
torch.int64 indices, a non-contiguous q_nope, a new_kv that requires grad). Every dataset of the
two files must hold the same bytes, shape, element type and attributes, and so must the root and
group attributes: the torch path changes nothing. `out` is not exact in bf16, so it also checks
that torch's float32 -> bf16 rounding gives the bits kvdump's own rounding stores. A second dump
carries every bf16 bit pattern and every e4m3fn code through torch tensors, so that a conversion
that is exact only for ordinary values (through float16, say) is caught too.

With torch.float8_e4m3fn (torch >= 2.1) the pools are also passed as float8 tensors; older torch
(Debian 12 has 1.13) skips that case, saying so. Where a kvaudit binary is found ($KVAUDIT_BINARY,
else build/kvaudit or build-dev/kvaudit of this checkout) the torch-written dump must pass
`kvaudit check --backend cpu-fp8`. Without torch every case is skipped, naming torch.

Run: /usr/bin/python3 -m unittest discover -s python/tests
"""

import os
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
REPO_DIR = os.path.join(PYTHON_DIR, "..")
sys.path.insert(0, PYTHON_DIR)

import kvdump  # noqa: E402

try:
    import torch
    TORCH_MISSING = None
except (ImportError, OSError) as error:  # not installed, or installed without its libraries
    torch = None
    TORCH_MISSING = f"torch is not importable ({error}); the real-torch writer tests need it"

HAS_FLOAT8 = torch is not None and hasattr(torch, "float8_e4m3fn")
NO_FLOAT8 = (f"torch {torch.__version__ if torch else '(missing)'} has no float8_e4m3fn "
             "(added in torch 2.1)")

H, DC, DR, PAGE, PAGES = 4, 64, 16, 4, 8
D = DC + DR
LAYER, KV_SCALE = 2, 0.5
SM_SCALE = 1.0 / np.sqrt(192.0)
ATTRS = dict(model="torch-test", producer="test_writer_torch.py", num_heads=H, kv_lora_rank=DC,
             qk_rope_head_dim=DR, sm_scale=SM_SCALE, page_size=PAGE)


def kvaudit_binary():
    """The kvaudit binary to check dumps with, or None."""
    candidates = [os.environ.get("KVAUDIT_BINARY", "")]
    candidates += [os.path.join(REPO_DIR, d, "kvaudit") for d in ("build", "build-dev")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    return None


def bf16_values(rng, *shape):
    """Random float32 values that are exact in bf16 (their low 16 bits are zero)."""
    bits = rng.standard_normal(shape).astype(np.float32).view(np.uint32) & 0xFFFF0000
    return bits.view(np.float32)


def exact_bf16_bits(values):
    """bf16 bits of float32 values exact in bf16, by truncation (independent of kvdump.codec)."""
    bits = values.view(np.uint32)
    assert not np.any(bits & 0xFFFF), "not exact in bf16"
    return (bits >> 16).astype(np.uint16)


def capture():
    """The capture as numpy: layer pool and source, then per step its index arrays and tensors.
    bf16 tensors are float32 here (exact in bf16 except `out`); pools are uint8 e4m3fn codes."""
    rng = np.random.default_rng(7)
    free = [3, 6, 1, 4, 0, 7, 2, 5]
    pages, length = {}, {}

    def append(request, count):
        owned = pages.setdefault(request, [])
        start = length.get(request, 0)
        slots = []
        for pos in range(start, start + count):
            if pos // PAGE == len(owned):
                owned.append(free.pop(0))
            slots.append(owned[pos // PAGE] * PAGE + pos % PAGE)
        length[request] = start + count
        return slots

    source = np.zeros((PAGES * PAGE, D), np.float32)
    pool = np.zeros((PAGES * PAGE, D), np.uint8)
    cached = append(0, 5)
    source[cached] = bf16_values(rng, len(cached), D)
    pool[cached] = kvdump.quantize_e4m3(source[cached], KV_SCALE)
    layer = dict(kv_cache=pool.reshape(PAGES, PAGE, D).copy(),
                 kv_source=source.reshape(PAGES, PAGE, D).copy())

    steps = []
    for kind, rows in (("prefill", [(0, 2), (1, 3)]), ("decode", [(0, 1), (1, 1)])):
        slots, owners, positions = [], [], []
        for request, count in rows:
            slots += append(request, count)
            owners += [request] * count
            positions += range(length[request] - count, length[request])
        qo, kv, indices, last = [0], [0], [], []
        for request, count in rows:
            qo.append(qo[-1] + count)
            indices += pages[request]
            kv.append(len(indices))
            last.append((length[request] - 1) % PAGE + 1)
        nq = len(slots)
        q_nope, q_pe = bf16_values(rng, nq, H, DC), bf16_values(rng, nq, H, DR)
        new_kv = bf16_values(rng, nq, D)
        pool[slots] = kvdump.quantize_e4m3(new_kv, KV_SCALE)
        values = kvdump.decode_e4m3(pool).astype(np.float64) * KV_SCALE
        out = np.zeros((nq, H, DC), np.float32)
        lse = np.zeros((nq, H), np.float32)
        for i, (request, pos) in enumerate(zip(owners, positions)):
            seen = [pages[request][p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
            c, r = values[seen, :DC], values[seen, DC:]
            s = SM_SCALE * (q_nope[i].astype(np.float64) @ c.T + q_pe[i].astype(np.float64) @ r.T)
            top = s.max(axis=1, keepdims=True)
            row_lse = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
            out[i], lse[i] = np.exp(s - row_lse[:, None]) @ c, row_lse
        steps.append(dict(
            indices=dict(kind=kind, qo_indptr=qo, kv_indptr=kv, kv_indices=indices,
                         kv_last_page_len=last, new_kv_slots=slots),
            tensors=dict(q_nope=q_nope, q_pe=q_pe, new_kv=new_kv, out=out, lse=lse,
                         kv_cache_after=pool.reshape(PAGES, PAGE, D).copy())))
    return layer, steps


def write(path, layer, steps, **attrs):
    with kvdump.KvDumpWriter(path, **{**ATTRS, **attrs}) as dump:
        dump.add_layer(LAYER, KV_SCALE, layer["kv_cache"], kv_source=layer["kv_source"])
        for step in steps:
            dump.add_step(**step["indices"]).add_layer(LAYER, **step["tensors"])


def as_numpy(layer, steps):
    """The capture in the numpy forms: bf16 as uint16 bits (exact ones by truncation, `out` given
    as float32 for the writer to round), pools as uint8 codes, indices as lists."""
    layer = dict(kv_cache=layer["kv_cache"], kv_source=exact_bf16_bits(layer["kv_source"]))
    converted = []
    for step in steps:
        t = dict(step["tensors"])
        for name in ("q_nope", "q_pe", "new_kv"):
            t[name] = exact_bf16_bits(t[name])
        converted.append(dict(indices=step["indices"], tensors=t))
    return layer, converted


def as_torch(layer, steps, pool_dtype=None):
    """The capture as torch tensors made the way a server holds them: bf16 by torch's own
    float32 -> bfloat16 conversion, pools as torch.uint8 (or viewed as pool_dtype), lse float32,
    indices int64 / int32 tensors. q_nope is a non-contiguous view; new_kv requires grad."""
    def pool(codes):
        tensor = torch.from_numpy(codes.copy())
        return tensor if pool_dtype is None else tensor.view(pool_dtype)

    def bf16(values):
        return torch.from_numpy(values.copy()).to(torch.bfloat16)

    layer = dict(kv_cache=pool(layer["kv_cache"]), kv_source=bf16(layer["kv_source"]))
    converted = []
    for step in steps:
        t = step["tensors"]
        q_nope = bf16(np.ascontiguousarray(t["q_nope"].transpose(1, 0, 2))).transpose(0, 1)
        assert not q_nope.is_contiguous()
        tensors = dict(q_nope=q_nope, q_pe=bf16(t["q_pe"]),
                       new_kv=bf16(t["new_kv"]).requires_grad_(True), out=bf16(t["out"]),
                       lse=torch.from_numpy(t["lse"].copy()),
                       kv_cache_after=pool(t["kv_cache_after"]))
        indices = dict(step["indices"])
        for name in ("qo_indptr", "kv_indptr", "kv_indices"):
            indices[name] = torch.tensor(indices[name], dtype=torch.int64)
        for name in ("kv_last_page_len", "new_kv_slots"):
            indices[name] = torch.tensor(indices[name], dtype=torch.int32)
        converted.append(dict(indices=indices, tensors=tensors))
    return layer, converted


def file_contents(path):
    """{object path: (kind, shape, dtype, bytes or None, {attr: (dtype, value bytes)})}."""
    def attrs(obj):
        result = {}
        for name in obj.attrs:
            value = obj.attrs[name]
            data = value.encode() if isinstance(value, str) else np.asarray(value).tobytes()
            result[name] = (str(obj.attrs.get_id(name).dtype), data)
        return result

    with h5py.File(path, "r") as f:
        contents = {"/": ("group", None, None, None, attrs(f))}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                contents["/" + name] = ("dataset", obj.shape, obj.dtype.str, obj[()].tobytes(),
                                        attrs(obj))
            else:
                contents["/" + name] = ("group", None, None, None, attrs(obj))
        f.visititems(visit)
    return contents


@unittest.skipUnless(torch is not None, TORCH_MISSING or "")
class RealTorchTest(unittest.TestCase):
    def setUp(self):
        self._dir = tempfile.TemporaryDirectory()
        self.numpy_path = os.path.join(self._dir.name, "numpy.h5")
        self.torch_path = os.path.join(self._dir.name, "torch.h5")
        self.layer, self.steps = capture()
        write(self.numpy_path, *as_numpy(self.layer, self.steps))

    def tearDown(self):
        self._dir.cleanup()

    def assert_same_files(self):
        expected, actual = file_contents(self.numpy_path), file_contents(self.torch_path)
        self.assertEqual(sorted(actual), sorted(expected))
        for name in sorted(expected):
            kind, shape, dtype, data, attrs = expected[name]
            got = actual[name]
            self.assertEqual(got[:3], (kind, shape, dtype), name)
            self.assertEqual(got[4], attrs, name)
            if data is not None and got[3] != data:
                a = np.frombuffer(data, np.dtype(dtype))
                b = np.frombuffer(got[3], np.dtype(dtype))
                k = int(np.flatnonzero(a != b)[0])
                self.fail(f"{name}: element {k} is {b[k]!r} from torch, {a[k]!r} from numpy")

    def test_numpy_path_holds_the_values(self):
        # Anchors the reference file, so that the comparisons below compare against the capture.
        with h5py.File(self.numpy_path, "r") as f:
            self.assertEqual(f["layers/L002/kv_cache"].attrs["dtype"], "float8_e4m3fn")
            np.testing.assert_array_equal(f["layers/L002/kv_cache"][()], self.layer["kv_cache"])
            for s, step in enumerate(self.steps):
                group = f[f"steps/S{s:03d}/L002"]
                self.assertEqual(sorted(group), ["kv_cache_after", "lse", "new_kv", "out",
                                                 "q_nope", "q_pe"])
                self.assertEqual(group["q_nope"].attrs["dtype"], "bfloat16")
                self.assertEqual(group["q_nope"].dtype, np.dtype("<u2"))
                np.testing.assert_array_equal(
                    group["q_nope"][()].astype(np.uint32) << 16,
                    step["tensors"]["q_nope"].view(np.uint32))
                np.testing.assert_array_equal(
                    group["out"][()], kvdump.bf16_bits_from_float32(step["tensors"]["out"]))

    def test_torch_tensors_write_the_same_file(self):
        write(self.torch_path, *as_torch(self.layer, self.steps))
        self.assert_same_files()

    @unittest.skipUnless(HAS_FLOAT8, NO_FLOAT8)
    def test_torch_float8_pools_write_the_same_file(self):
        write(self.torch_path, *as_torch(self.layer, self.steps, pool_dtype=torch.float8_e4m3fn))
        self.assert_same_files()

    def write_every_pattern(self, path, pool, source):
        # H = 1, Dc = Dr = 64, one slot per page: 512 pages of 128 elements = 65536 elements.
        attrs = dict(ATTRS, num_heads=1, kv_lora_rank=64, qk_rope_head_dim=64, page_size=1)
        with kvdump.KvDumpWriter(path, **attrs) as dump:
            dump.add_layer(LAYER, KV_SCALE, pool, kv_source=source)

    def every_pattern(self):
        """Every bf16 bit pattern (NaN payloads, infinities, subnormals, -0, values beyond
        float16's range) and every e4m3fn code (NaN 0x7F / 0xFF too), 256 times each."""
        bf16_bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(512, 1, 128)
        codes = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(512, 1, 128)
        return bf16_bits, codes

    def test_every_bit_pattern_through_torch(self):
        bf16_bits, codes = self.every_pattern()
        self.write_every_pattern(self.numpy_path, codes, bf16_bits)
        # A bf16 tensor holding given bits can only be made by viewing int16 storage.
        source = torch.from_numpy(bf16_bits.view(np.int16).copy()).view(torch.bfloat16)
        self.write_every_pattern(self.torch_path, torch.from_numpy(codes.copy()), source)
        self.assert_same_files()

    @unittest.skipUnless(HAS_FLOAT8, NO_FLOAT8)
    def test_every_e4m3_code_as_torch_float8(self):
        bf16_bits, codes = self.every_pattern()
        self.write_every_pattern(self.numpy_path, codes, bf16_bits)
        source = torch.from_numpy(bf16_bits.view(np.int16).copy()).view(torch.bfloat16)
        pool = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
        self.write_every_pattern(self.torch_path, pool, source)
        self.assert_same_files()

    def test_bfloat16_pool_from_torch(self):
        bits = exact_bf16_bits(self.layer["kv_source"])
        tensor = torch.from_numpy(self.layer["kv_source"].copy()).to(torch.bfloat16)
        step = self.steps[1]
        np_tensors = {k: exact_bf16_bits(v) for k, v in step["tensors"].items()
                      if k in ("q_nope", "q_pe", "new_kv")}
        th_tensors = {k: torch.from_numpy(v.copy()).to(torch.bfloat16)
                      for k, v in step["tensors"].items() if k in ("q_nope", "q_pe", "new_kv")}
        # Any self-consistent step will do: one decode row per request, pages as in step 1.
        for path, pool, tensors in ((self.numpy_path, bits, np_tensors),
                                    (self.torch_path, tensor, th_tensors)):
            with kvdump.KvDumpWriter(path, **ATTRS, kv_dtype="bfloat16") as dump:
                dump.add_layer(LAYER, 1.0, pool)
                dump.add_step(**step["indices"]).add_layer(LAYER, **tensors, kv_cache_after=pool)
        self.assert_same_files()
        with h5py.File(self.torch_path, "r") as f:
            self.assertEqual(f["layers/L002/kv_cache"].attrs["dtype"], "bfloat16")

    def test_refusals_of_torch_dtypes(self):
        layer, steps = as_torch(self.layer, self.steps)
        with kvdump.KvDumpWriter(self.torch_path, **ATTRS) as dump:
            with self.assertRaisesRegex(ValueError, r"^/layers/L002/kv_cache: "):
                dump.add_layer(LAYER, KV_SCALE, layer["kv_cache"].float())
            with self.assertRaisesRegex(ValueError, r"^/layers/L002/kv_source: "):
                dump.add_layer(LAYER, KV_SCALE, layer["kv_cache"],
                               kv_source=layer["kv_source"].half())
            if hasattr(torch, "float8_e5m2"):
                with self.assertRaisesRegex(ValueError, r"^/layers/L002/kv_cache: .*e4m3fn"):
                    dump.add_layer(LAYER, KV_SCALE, layer["kv_cache"].view(torch.float8_e5m2))
            dump.add_layer(LAYER, KV_SCALE, layer["kv_cache"])
            step = dump.add_step(**steps[0]["indices"])
            tensors = steps[0]["tensors"]
            with self.assertRaisesRegex(ValueError, r"^/steps/S000/L002/q_nope: "):
                step.add_layer(LAYER, **{**tensors, "q_nope": tensors["q_nope"].half()})
            with self.assertRaisesRegex(ValueError, r"^/steps/S000/L002/lse: "):
                step.add_layer(LAYER, **{**tensors, "lse": tensors["lse"].double()})
            step.add_layer(LAYER, **tensors)

    def test_kvaudit_check_passes_the_torch_dump(self):
        binary = kvaudit_binary()
        if binary is None:
            self.skipTest("no kvaudit binary ($KVAUDIT_BINARY, build/kvaudit, build-dev/kvaudit)")
        write(self.torch_path, *as_torch(self.layer, self.steps))
        for args in (["info", self.torch_path],
                     ["check", self.torch_path, "--backend", "cpu-fp8", "--threads", "2"]):
            run = subprocess.run([binary] + args, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            self.assertEqual(run.returncode, 0, f"{binary} {' '.join(args)}:\n{run.stdout}")
        self.assertIn("verdict: PASS", run.stdout)


if __name__ == "__main__":
    unittest.main()
