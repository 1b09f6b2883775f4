"""Protocol version 2 on the backend side (docs/backend-protocol.md "Version 2"), without torch:
kvdump v1.1 per_token_group pools.

kvdump/backends/grouped.py: a slot's bytes [Dc e4m3 codes][G scales: float32 LE or e8m0][Dr RoPE:
bf16 LE or e4m3] for every scale format and RoPE type; the write rule is kvdump.codec.quantize_rows
packed (checked against the C++ writer's pool of the shipped datasets/glm5_pertoken_fp8rope.h5,
whose cached slots were written from its kv_source by kvaudit's own rule); the scales laid out as
FlashInfer's ckv_scale_arr [pages, page_size, G]; exact dequantization.

kvdump/backends/protocol.py: a version 2 hello with a per_token_group model (its keys, slot_bytes,
the pool file's [num_slots, slot_bytes] uint8 shape), refused in a version 1 hello, a version 1
per_tensor session unchanged, the reply's version the one asked for.

Run: python3 -m unittest discover -s python/tests
"""

import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(TESTS_DIR, "..")
sys.path.insert(0, PYTHON_DIR)
sys.path.insert(0, TESTS_DIR)

import kvdump  # noqa: E402
from kvdump.backends import grouped, protocol  # noqa: E402
from protocol_driver import Driver, read_dump, replay_dump  # noqa: E402

DATASETS = os.path.join(PYTHON_DIR, "..", "datasets")
H5PY_MISSING = importlib.util.find_spec("h5py") is None

H, DC, DR, PAGE, SLOTS, GROUP = 2, 8, 4, 2, 8, 4
MODEL = {"num_heads": H, "kv_lora_rank": DC, "qk_rope_head_dim": DR, "sm_scale": 0.25,
         "page_size": PAGE, "num_slots": SLOTS, "kv_dtype": "float8_e4m3fn",
         "kv_scale_kind": "per_token_group", "kv_scale_group_size": GROUP,
         "kv_scale_format": "float32", "kv_rope_dtype": "float8_e4m3fn", "slot_bytes": 20}
FORMS = [(f, r) for f in ("float32", "power_of_two", "e8m0") for r in ("float8_e4m3fn", "bfloat16")]


def model_info(scale_format="float32", rope="float8_e4m3fn", dc=DC, dr=DR, group=GROUP,
               page=PAGE, slots=SLOTS):
    return protocol.ModelInfo(num_heads=H, kv_lora_rank=dc, qk_rope_head_dim=dr, sm_scale=0.25,
                              page_size=page, num_slots=slots, kv_dtype="float8_e4m3fn",
                              kv_scale_kind="per_token_group", version=2,
                              kv_scale_group_size=group, kv_scale_format=scale_format,
                              kv_rope_dtype=rope)


def rows(rng, n, d, gain=8.0):
    values = (rng.standard_normal((n, d)) * gain).astype(np.float32)
    values[0, :GROUP] = 0  # an all-zero group: scale 1
    return kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(values))


class SlotTests(unittest.TestCase):
    def test_slot_bytes_of_every_form(self):
        self.assertEqual(model_info().slot_bytes, DC + 2 * 4 + DR)
        self.assertEqual(model_info("e8m0", "bfloat16").slot_bytes, DC + 2 + 2 * DR)
        glm = dict(dc=512, dr=64, group=128)
        self.assertEqual(model_info(**glm).slot_bytes, 592)  # FlashInfer's per-token form
        self.assertEqual(model_info("power_of_two", "bfloat16", **glm).slot_bytes, 656)  # FlashMLA
        self.assertEqual(model_info(**glm).rope_offset, 528)
        self.assertEqual((model_info().pool_dtype, model_info().pool_width), ("uint8", 20))

    def test_encode_rows_is_quantize_rows_packed(self):
        rng = np.random.default_rng(1)
        for scale_format, rope in FORMS:
            with self.subTest(scale_format=scale_format, rope=rope):
                model = model_info(scale_format, rope)
                kv_scale = 1.0 if rope == "bfloat16" else 0.37
                x = rows(rng, 5, DC + DR)
                slots = grouped.encode_rows(x, model, kv_scale)
                self.assertEqual((slots.dtype, slots.shape), (np.uint8, (5, model.slot_bytes)))
                codes, rope_part, scales = kvdump.quantize_rows(
                    x, DC, GROUP, scale_format, rope, kv_scale=kv_scale)
                got_codes, got_scales, got_rope = grouped.split_slots(slots, model)
                np.testing.assert_array_equal(got_codes, codes)
                np.testing.assert_array_equal(np.asarray(got_scales).view(np.uint8),
                                              np.asarray(scales).view(np.uint8))
                np.testing.assert_array_equal(got_rope, rope_part)
                # The bytes themselves: scales little-endian right after the codes.
                if scale_format == "e8m0":
                    np.testing.assert_array_equal(slots[:, DC:DC + 2], scales)
                else:
                    np.testing.assert_array_equal(slots[:, DC:DC + 8],
                                                  scales.astype("<f4").view(np.uint8))
                self.assertEqual(grouped.scale_values(slots, model)[0, 0], 1.0)  # zero group

    def test_reciprocal_convention_reaches_the_codes(self):
        model = model_info()
        x = rows(np.random.default_rng(2), 64, DC + DR)
        divided = grouped.encode_rows(x, model, 0.37)
        multiplied = grouped.encode_rows(x, model, 0.37, reciprocal=True)
        codes, _, _ = kvdump.quantize_rows(x, DC, GROUP, "float32", "float8_e4m3fn",
                                           kv_scale=0.37, reciprocal=True)
        np.testing.assert_array_equal(multiplied[:, :DC], codes)
        self.assertEqual(divided.shape, multiplied.shape)

    def test_float32_rows_widens_bf16_bits_exactly(self):
        x = rows(np.random.default_rng(3), 3, DC + DR)
        np.testing.assert_array_equal(
            grouped.float32_rows(kvdump.bf16_bits_from_float32(x)), x)
        np.testing.assert_array_equal(grouped.float32_rows(x), x)

    def test_scale_array_is_indexed_by_physical_slot(self):
        model = model_info()
        x = rows(np.random.default_rng(4), SLOTS, DC + DR)
        pool = grouped.encode_rows(x, model, 0.37)
        array = grouped.scale_array(pool, model)
        self.assertEqual((array.dtype, array.shape), (np.float32, (SLOTS // PAGE, PAGE, 2)))
        self.assertTrue(array.flags.c_contiguous)
        _, _, scales = kvdump.quantize_rows(x, DC, GROUP, "float32", "float8_e4m3fn",
                                            kv_scale=0.37)
        for slot in range(SLOTS):
            np.testing.assert_array_equal(array[slot // PAGE, slot % PAGE], scales[slot])

    def test_dequantize_is_code_times_scale(self):
        for scale_format, rope in FORMS:
            with self.subTest(scale_format=scale_format, rope=rope):
                model = model_info(scale_format, rope)
                kv_scale = 1.0 if rope == "bfloat16" else 0.37
                x = rows(np.random.default_rng(5), 4, DC + DR)
                values = grouped.dequantize(grouped.encode_rows(x, model, kv_scale), model,
                                            kv_scale)
                codes, rope_part, scales = kvdump.quantize_rows(x, DC, GROUP, scale_format, rope,
                                                                kv_scale=kv_scale)
                if scale_format == "e8m0":
                    scales = kvdump.decode_e8m0(scales)
                expected = kvdump.decode_e4m3(codes).astype(np.float64) * np.repeat(
                    scales.astype(np.float64), GROUP, axis=1)
                np.testing.assert_array_equal(values[:, :DC], expected)
                if rope == "bfloat16":
                    np.testing.assert_array_equal(values[:, DC:], x[:, DC:])
                else:
                    np.testing.assert_array_equal(
                        values[:, DC:],
                        kvdump.decode_e4m3(rope_part).astype(np.float64) * np.float32(kv_scale))
                # Every value within the e4m3 rounding of x (no saturation here).
                self.assertTrue(np.all(np.abs(values - x) <= np.abs(x) / 16 + 1e-3))


class ShippedDumpTests(unittest.TestCase):
    """The write rule against kvaudit's own (the C++ writer of the shipped v1.1 dump)."""

    def test_the_cached_slots_of_glm5_pertoken_fp8rope_are_encode_rows_of_kv_source(self):
        try:
            import h5py
        except ImportError:
            self.skipTest("h5py is not installed")
        with h5py.File(os.path.join(DATASETS, "glm5_pertoken_fp8rope.h5"), "r") as f:
            attrs = f.attrs
            layer = f["layers/L003"]
            model = model_info(attrs["kv_scale_format"].decode(), attrs["kv_rope_dtype"].decode(),
                               dc=int(attrs["kv_lora_rank"]), dr=int(attrs["qk_rope_head_dim"]),
                               group=int(attrs["kv_scale_group_size"]),
                               page=int(attrs["page_size"]),
                               slots=int(np.prod(layer["kv_cache"].shape[:2])))
            kv_scale = float(layer.attrs["kv_scale"])
            source = layer["kv_source"][()].reshape(model.num_slots, -1)
            stored = np.concatenate(
                [layer["kv_cache"][()].reshape(model.num_slots, -1),
                 layer["kv_scales"][()].astype("<f4").reshape(model.num_slots, -1).view(np.uint8),
                 layer["kv_rope"][()].reshape(model.num_slots, -1)], axis=1)
        self.assertEqual(stored.shape[1], model.slot_bytes)
        self.assertEqual(model.slot_bytes, 592)
        cached = np.any(source != 0, axis=1)
        self.assertGreater(cached.sum(), 200)
        slots = grouped.encode_rows(grouped.float32_rows(source[cached]), model, kv_scale)
        np.testing.assert_array_equal(slots, stored[cached])


class Session:
    """Requests for protocol.Server with an adapter that records what it gets."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvdump-grouped-test-")
        self.lines = []

        class Recording(protocol.Adapter):
            name = "recording"
            seen = {}

            def start(adapter, model, files):
                adapter.seen["model"] = model
                adapter.files = files
                return {"adapter": "recording"}

            def load_layer(adapter, layer, pool_spec):
                adapter.seen["pool"] = adapter.files.read(pool_spec, "pool")

        self.adapter = Recording()

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def hello(self, version=2, model=MODEL):
        self.lines.append(json.dumps({"type": "hello", "protocol": "kvaudit-backend",
                                      "version": version, "name": "g", "session_dir": self.dir,
                                      "model": model, "reciprocal_scale": False}))

    def layer(self, pool):
        pool.tofile(os.path.join(self.dir, "pool.bin"))
        self.lines.append(json.dumps({
            "type": "layer", "layer": {"group": "L000", "layer_id": 0, "kv_scale": 0.5},
            "pool": {"file": "pool.bin", "dtype": "uint8", "shape": list(pool.shape)}}))

    def run(self):
        requests = io.BytesIO("".join(line + "\n" for line in self.lines).encode())
        replies, log = io.BytesIO(), io.StringIO()
        status = protocol.Server(make_adapter=lambda: self.adapter, requests=requests,
                                 replies=replies, log=log).run()
        return status, [json.loads(line) for line in replies.getvalue().decode().splitlines()]


class VersionTwoTests(unittest.TestCase):
    def setUp(self):
        self.session = Session()
        self.addCleanup(self.session.close)

    def test_a_grouped_hello_and_its_pool_file(self):
        s = self.session
        s.hello()
        pool = np.arange(SLOTS * 20, dtype=np.uint8).reshape(SLOTS, 20)
        s.layer(pool)
        status, replies = s.run()
        self.assertEqual(status, 0)
        self.assertEqual([r["type"] for r in replies], ["hello", "ok"])
        self.assertEqual(replies[0]["version"], 2)  # the version asked for
        model = s.adapter.seen["model"]
        self.assertTrue(model.grouped)
        self.assertEqual((model.kv_scale_group_size, model.kv_scale_format, model.kv_rope_dtype,
                          model.num_scale_groups, model.slot_bytes, model.version),
                         (GROUP, "float32", "float8_e4m3fn", 2, 20, 2))
        np.testing.assert_array_equal(s.adapter.seen["pool"], pool)

    def test_a_pool_file_of_the_per_tensor_shape_is_bad_input(self):
        s = self.session
        s.hello()
        s.layer(np.zeros((SLOTS, DC + DR), np.uint8))
        status, replies = s.run()
        self.assertEqual(replies[1]["kind"], "bad_input")
        self.assertIn("[8, 20]", replies[1]["message"])

    def test_every_form_is_accepted(self):
        for scale_format, rope in FORMS:
            with self.subTest(scale_format=scale_format, rope=rope):
                model = dict(MODEL, kv_scale_format=scale_format, kv_rope_dtype=rope)
                del model["slot_bytes"]  # optional
                info = protocol.parse_model({"version": 2, "model": model})
                self.assertEqual(info.kv_scale_format, scale_format)
                self.assertEqual(info.kv_rope_dtype, rope)

    def test_refusals(self):
        cases = [
            (1, MODEL, "unsupported", "needs protocol version 2"),
            (2, dict(MODEL, slot_bytes=12), "bad_input", "slot_bytes 12 is not the 20 bytes"),
            (2, dict(MODEL, kv_scale_group_size=3), "bad_input", "does not divide"),
            (2, dict(MODEL, kv_scale_format="ue8m0"), "unsupported", "ue8m0"),
            (2, dict(MODEL, kv_rope_dtype="float16"), "unsupported", "float16"),
            (2, dict(MODEL, kv_dtype="bfloat16"), "bad_input", "needs kv_dtype float8_e4m3fn"),
            (2, dict(MODEL, kv_scale_kind="per_block"), "unsupported", "per_block"),
        ]
        for version, model, kind, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(protocol.BackendError) as caught:
                    protocol.parse_model({"version": version, "model": model})
                self.assertEqual(caught.exception.kind, kind)
                self.assertIn(text, caught.exception.message)

    def test_a_version_1_hello_stays_version_1(self):
        s = self.session
        per_tensor = {k: v for k, v in MODEL.items() if not k.startswith("kv_scale_")
                      and k not in ("kv_rope_dtype", "slot_bytes")}
        per_tensor["kv_scale_kind"] = "per_tensor"
        s.hello(version=1, model=per_tensor)
        s.layer(np.zeros((SLOTS, DC + DR), np.uint8))
        status, replies = s.run()
        self.assertEqual([r["type"] for r in replies], ["hello", "ok"])
        self.assertEqual(replies[0]["version"], 1)
        model = s.adapter.seen["model"]
        self.assertFalse(model.grouped)
        self.assertEqual((model.pool_dtype, model.pool_width, model.version), ("uint8", 12, 1))


# A program serving an adapter that writes new rows by the v1.1 rule into its mapped pool file and
# returns zeros: the write, through the protocol, without torch.
WRITER = """
import sys
import numpy as np
from kvdump.backends import grouped, protocol
from kvdump.backends.__main__ import reply_stream

class Writer(protocol.Adapter):
    name = "writer"
    def start(self, model, files):
        self.model, self.files, self.pools = model, files, {}
        return {"adapter": "writer", "slot_bytes": model.slot_bytes}
    def load_layer(self, layer, spec):
        self.pools[layer.group] = self.files.map(spec, "pool")
    def run_step(self, step):
        pool = self.pools[step.layer.group]
        pool[step.new_kv_slots] = grouped.encode_rows(
            grouped.float32_rows(step.new_kv), self.model, step.layer.kv_scale)
        pool.flush()
        nq, heads = step.q_nope.shape[:2]
        # lse: how many tokens each row was told to attend to (-1 for a dense step).
        listed = (np.full(nq, -1.0) if step.topk_indices is None
                  else (step.topk_indices >= 0).sum(axis=1))
        return protocol.StepResult(np.zeros((nq, heads, self.model.kv_lora_rank), np.uint16),
                                   np.repeat(listed[:, None], heads, 1).astype(np.float32))

sys.exit(protocol.Server(make_adapter=Writer, requests=sys.stdin.buffer,
                         replies=reply_stream()).run())
"""


class ReplayTests(unittest.TestCase):
    """The shipped per_token_group dump through tests/protocol_driver.py's replay (version 2)."""

    @unittest.skipIf(H5PY_MISSING, "h5py is not installed")
    def test_replay_of_glm5_pertoken_fp8rope_writes_by_the_v1_1_rule(self):
        path = os.path.join(DATASETS, "glm5_pertoken_fp8rope.h5")
        model, layers, steps = read_dump(path)
        self.assertEqual((model["slot_bytes"], model["kv_scale_kind"]), (592, "per_token_group"))
        self.assertEqual([s["kind"] for s in steps], ["prefill", "decode", "decode"])
        with Driver([sys.executable, "-c", WRITER]) as driver:
            results = replay_dump(driver, path)
            bye = driver.bye()
        self.assertEqual(bye, {"type": "bye"})
        info = protocol.parse_model({"version": 2, "model": model})
        layer = layers[0]
        expected = layer["pool"].copy()
        for step in steps:
            output = results[(step["group"], layer["group"])]
            self.assertEqual(output.reply["type"], "result", output.reply)
            new_kv = step["tensors"][layer["group"]]["new_kv"]
            expected[step["indices"]["new_kv_slots"]] = grouped.encode_rows(
                grouped.float32_rows(new_kv), info, layer["kv_scale"])
            np.testing.assert_array_equal(output.pool, expected)
        self.assertTrue(np.any(expected != layer["pool"]))

    @unittest.skipIf(H5PY_MISSING, "h5py is not installed")
    def test_a_sparse_step_reaches_the_adapter_with_its_topk_indices(self):
        import h5py

        path = os.path.join(DATASETS, "glm5_dsa_flashmla.h5")
        with Driver([sys.executable, "-c", WRITER]) as driver:
            results = replay_dump(driver, path)
            driver.bye()
        with h5py.File(path, "r") as f:
            for (step, layer), output in results.items():
                self.assertEqual(output.reply["type"], "result", output.reply)
                topk = f[f"steps/{step}/{layer}/topk_indices"][()]
                listed = (topk >= 0).sum(axis=1).astype(np.float32)
                np.testing.assert_array_equal(output.lse[:, 0], listed)
        self.assertEqual(len(results), 6)  # 3 steps x 2 layers, all sparse


if __name__ == "__main__":
    unittest.main()
