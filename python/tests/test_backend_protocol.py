"""The protocol server of kvdump.backends (docs/backend-protocol.md, version 1; version 2's
per_token_group pools: test_backend_grouped.py), without torch.

In process: kvdump.backends.protocol.Server with a stub adapter whose outputs are known (out = the
step index in every element, lse = the row number, each written slot set to 0x11), driven through
byte streams: hello / layer / step / bye round trips, the files it writes, and every error reply
(request before hello, wrong version, a descriptor outside the session directory or of the wrong
size or type, broken indices, an adapter that raises), each followed by a request that still gets
its reply. As a program (`python -m kvdump.backends`, through tests/protocol_driver.py): torch or
flashinfer missing (hidden with sys.modules[name] = None) gives an `unsupported` reply naming it
and exit 2 without a traceback; an unreadable hello gives exit 2 and one line on stderr; anything
an adapter prints, from Python or straight to descriptor 1, goes to stderr, never into the
replies.

Run: python3 -m unittest discover -s python/tests
"""

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(TESTS_DIR, "..")
sys.path.insert(0, PYTHON_DIR)
sys.path.insert(0, TESTS_DIR)

from kvdump.backends import protocol  # noqa: E402
from protocol_driver import Driver  # noqa: E402

H, DC, DR, PAGE, SLOTS = 2, 8, 4, 2, 8
D = DC + DR
MODEL = {"num_heads": H, "kv_lora_rank": DC, "qk_rope_head_dim": DR, "sm_scale": 0.25,
         "page_size": PAGE, "num_slots": SLOTS, "kv_dtype": "float8_e4m3fn",
         "kv_scale_kind": "per_tensor"}
# Two requests: request 0 has 3 tokens (pages 3, 1), one new row at position 2 (slot 2);
# request 1 is a fresh 2-token prefill in page 0 (slots 0, 1).
INDICES = {"qo_indptr": [0, 1, 3], "kv_indptr": [0, 2, 3], "kv_indices": [3, 1, 0],
           "kv_last_page_len": [1, 2], "new_kv_slots": [2, 0, 1]}
NQ = 3


class StubAdapter(protocol.Adapter):
    """Known outputs; raises where the test asks it to."""

    name = "stub"

    def __init__(self):
        self.pools = {}
        self.fail_with = None

    def start(self, model, files):
        self.files = files
        return {"adapter": "stub", "heads": model.num_heads}

    def load_layer(self, layer, pool_spec):
        self.pools[layer.group] = self.files.map(pool_spec, "pool")

    def run_step(self, step):
        if self.fail_with is not None:
            raise self.fail_with
        self.pools[step.layer.group][step.new_kv_slots] = 0x11
        nq = step.num_rows
        out = np.full((nq, H, DC), step.index, np.float32).view(np.uint32) >> 16
        lse = np.repeat(np.arange(nq, dtype=np.float32)[:, None], H, axis=1)
        return protocol.StepResult(out.astype(np.uint16), lse, compute_seconds=0.5)


class Session:
    """A session directory, request lines and a Server run over them."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvdump-protocol-test-")
        self.lines = []
        self.adapter = StubAdapter()

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def put(self, name, array, dtype):
        np.ascontiguousarray(array, dtype=protocol.ARRAY_DTYPES[dtype]).tofile(
            os.path.join(self.dir, name))
        return {"file": name, "dtype": dtype, "shape": list(np.shape(array))}

    def add(self, message):
        self.lines.append(json.dumps(message) if isinstance(message, dict) else message)

    def hello(self, **changes):
        message = {"type": "hello", "protocol": "kvaudit-backend", "version": 1, "name": "stub",
                   "session_dir": self.dir, "model": dict(MODEL), "reciprocal_scale": False}
        message.update(changes)
        self.add(message)

    def layer(self, group="L000"):
        pool = np.full((SLOTS, D), 0x7F, np.uint8)  # NaN codes everywhere
        self.add({"type": "layer", "layer": {"group": group, "layer_id": 0, "kv_scale": 0.5},
                  "pool": self.put(f"pool_{group}.bin", pool, "uint8")})

    def step(self, index=0, layer="L000", **replace):
        rng = np.random.default_rng(index)
        inputs = {name: self.put(f"{name}.bin", np.array(v), "int32")
                  for name, v in INDICES.items()}
        for name, shape in (("q_nope", (NQ, H, DC)), ("q_pe", (NQ, H, DR)), ("new_kv", (NQ, D))):
            inputs[name] = self.put(f"{name}.bin", rng.integers(0, 2**15, shape), "bfloat16")
        inputs.update(replace)
        self.add({"type": "step", "step": {"index": index, "group": f"S{index:03d}",
                                           "kind": "prefill"},
                  "layer": {"group": layer, "layer_id": 0, "kv_scale": 0.5},
                  "pool_reloaded": False, "inputs": inputs,
                  "outputs": {"out": {"file": "out.bin", "dtype": "bfloat16",
                                      "shape": [NQ, H, DC]},
                              "lse": {"file": "lse.bin", "dtype": "float32", "shape": [NQ, H]}}})

    def run(self):
        """(exit status, replies, log text)."""
        requests = io.BytesIO("".join(line + "\n" for line in self.lines).encode())
        replies, log = io.BytesIO(), io.StringIO()
        server = protocol.Server(make_adapter=lambda: self.adapter, requests=requests,
                                 replies=replies, log=log)
        status = server.run()
        lines = replies.getvalue().decode().splitlines()
        return status, [json.loads(line) for line in lines], log.getvalue()

    def read(self, name, dtype, shape):
        return np.fromfile(os.path.join(self.dir, name),
                           dtype=protocol.ARRAY_DTYPES[dtype]).reshape(shape)


class RoundTripTests(unittest.TestCase):
    def setUp(self):
        self.session = Session()
        self.addCleanup(self.session.close)

    def test_hello_layer_step_bye(self):
        s = self.session
        s.hello()
        s.layer()
        s.step(index=3)
        s.add({"type": "bye"})
        status, replies, _ = s.run()
        self.assertEqual(status, 0)
        self.assertEqual([r["type"] for r in replies], ["hello", "ok", "result", "bye"])
        self.assertEqual(replies[0]["version"], 1)
        self.assertEqual(replies[0]["capabilities"], ["check"])
        self.assertEqual(replies[0]["describe"], {"adapter": "stub", "heads": H})
        self.assertEqual(replies[2]["compute_seconds"], 0.5)
        self.assertNotIn("pool", replies[2])
        out = s.read("out.bin", "bfloat16", (NQ, H, DC))
        self.assertTrue(np.all(out == 0x4040))  # bf16 bits of 3.0
        lse = s.read("lse.bin", "float32", (NQ, H))
        np.testing.assert_array_equal(lse, [[0, 0], [1, 1], [2, 2]])
        pool = s.read("pool_L000.bin", "uint8", (SLOTS, D))
        written = INDICES["new_kv_slots"]
        self.assertTrue(np.all(pool[written] == 0x11))
        self.assertTrue(np.all(np.delete(pool, written, axis=0) == 0x7F))

    def test_hello_without_model_is_a_bench_session(self):
        s = self.session
        hello = {"type": "hello", "protocol": "kvaudit-backend", "version": 1, "name": "stub",
                 "session_dir": s.dir}
        s.add(hello)
        s.layer()
        s.add({"type": "bye"})
        status, replies, _ = s.run()
        self.assertEqual(status, 0)
        self.assertEqual(replies[0]["type"], "hello")
        self.assertEqual(replies[1]["kind"], "bad_input")
        self.assertIn("no model", replies[1]["message"])

    def test_end_of_input_without_bye_exits_0(self):
        self.session.hello()
        status, replies, _ = self.session.run()
        self.assertEqual((status, [r["type"] for r in replies]), (0, ["hello"]))

    def test_bench_is_unsupported_by_an_adapter_without_it(self):
        s = self.session
        s.hello()
        s.add({"type": "bench", "case": {"name": "decode", "kind": "decode", "batch": 2,
                                         "context": 64, "num_heads": 16, "page_size": 1,
                                         "pool_slots": 0, "kv_dtype": "float8_e4m3fn"},
               "warmup": 1, "iterations": 2, "flush_l2": False})
        s.add({"type": "bench", "case": {"name": "p", "kind": "prefill", "batch": 1,
                                         "context": 64, "num_heads": 16, "page_size": 1}})
        _, replies, _ = s.run()
        self.assertEqual(replies[1], {"type": "error", "kind": "unsupported",
                                      "message": "stub has no bench"})
        self.assertEqual(replies[2]["kind"], "unsupported")
        self.assertIn("q_len", replies[2]["message"])


class ErrorReplyTests(unittest.TestCase):
    """Each error gets an error reply of the right kind; the next request is still answered."""

    def setUp(self):
        self.session = Session()
        self.addCleanup(self.session.close)

    def run_after_hello(self, add, layer=True):
        s = self.session
        s.hello()
        if layer:
            s.layer()
        add(s)
        s.add({"type": "bye"})
        status, replies, log = s.run()
        self.assertEqual(status, 0)
        self.assertEqual(replies[-1], {"type": "bye"}, "the loop went on after the error")
        return replies[-2], log

    def assert_error(self, reply, kind, *words):
        self.assertEqual(reply["type"], "error", reply)
        self.assertEqual(reply["kind"], kind, reply)
        for word in words:
            self.assertIn(word, reply["message"])

    def test_unknown_request_type(self):
        reply, _ = self.run_after_hello(lambda s: s.add({"type": "dance"}))
        self.assert_error(reply, "bad_input", "dance")

    def test_unreadable_request_line(self):
        reply, _ = self.run_after_hello(lambda s: s.add("{not json"))
        self.assert_error(reply, "bad_input", "unreadable request")

    def test_second_hello(self):
        reply, _ = self.run_after_hello(lambda s: s.hello())
        self.assert_error(reply, "bad_input", "hello")

    def test_step_before_its_layer(self):
        reply, _ = self.run_after_hello(lambda s: s.step(layer="L007"))
        self.assert_error(reply, "bad_input", "L007")

    def test_descriptor_outside_the_session_directory(self):
        outside = {"file": "../../etc/passwd", "dtype": "bfloat16", "shape": [NQ, H, DC]}
        reply, _ = self.run_after_hello(lambda s: s.step(q_nope=outside))
        self.assert_error(reply, "bad_input", "q_nope", "outside the session directory")

    def test_absolute_path(self):
        absolute = {"file": "/tmp/x.bin", "dtype": "bfloat16", "shape": [NQ, H, DC]}
        reply, _ = self.run_after_hello(lambda s: s.step(q_nope=absolute))
        self.assert_error(reply, "bad_input", "q_nope", "relative")

    def test_file_of_the_wrong_size(self):
        def add(s):
            s.put("short.bin", np.zeros(5), "bfloat16")
            s.step(q_pe={"file": "short.bin", "dtype": "bfloat16", "shape": [NQ, H, DR]})
        reply, _ = self.run_after_hello(add)
        self.assert_error(reply, "bad_input", "q_pe", "10 bytes", str(NQ * H * DR * 2))

    def test_wrong_dtype_and_shape(self):
        def add(s):
            s.step(q_nope=s.put("q.bin", np.zeros((NQ, H, DC)), "int32"))
            s.step(new_kv=s.put("kv.bin", np.zeros((NQ, D + 1)), "bfloat16"))
        s = self.session
        s.hello()
        s.layer()
        add(s)
        _, replies, _ = s.run()
        self.assert_error(replies[2], "bad_input", "q_nope", "int32")
        self.assert_error(replies[3], "bad_input", "new_kv", f"[{NQ}, {D}]")

    def test_indices_that_break_kvdump_rules(self):
        bad = dict(INDICES, new_kv_slots=[3, 0, 1])
        reply, _ = self.run_after_hello(
            lambda s: s.step(new_kv_slots=s.put("slots.bin", np.array(bad["new_kv_slots"]),
                                                "int32")))
        self.assert_error(reply, "bad_input", "/steps/S000/new_kv_slots")

    def test_adapter_failure_is_internal_with_a_traceback_on_stderr(self):
        self.session.adapter.fail_with = ZeroDivisionError("boom")
        reply, log = self.run_after_hello(lambda s: s.step())
        self.assert_error(reply, "internal", "ZeroDivisionError: boom")
        self.assertIn("Traceback", log)

    def test_adapter_backend_error_keeps_its_kind(self):
        self.session.adapter.fail_with = protocol.unsupported("no kernel for 3 heads")
        reply, log = self.run_after_hello(lambda s: s.step())
        self.assertEqual(reply, {"type": "error", "kind": "unsupported",
                                 "message": "no kernel for 3 heads"})
        self.assertNotIn("Traceback", log)


class HelloTests(unittest.TestCase):
    def setUp(self):
        self.session = Session()
        self.addCleanup(self.session.close)

    def refused(self, **changes):
        self.session.hello(**changes)
        self.session.layer()  # never answered: the server exits after a refused hello
        status, replies, _ = self.session.run()
        self.assertEqual(status, 2)
        self.assertEqual(len(replies), 1)
        self.assertEqual(replies[0]["type"], "error")
        return replies[0]

    def test_other_version_is_unsupported(self):
        reply = self.refused(version=3)
        self.assertEqual(reply["kind"], "unsupported")
        self.assertIn("version 3", reply["message"])
        self.assertIn("versions 1, 2", reply["message"])

    def test_other_protocol_is_unsupported(self):
        self.assertEqual(self.refused(protocol="other")["kind"], "unsupported")

    def test_unknown_kv_dtype_is_unsupported(self):
        reply = self.refused(model=dict(MODEL, kv_dtype="float8_e5m2"))
        self.assertEqual(reply["kind"], "unsupported")
        self.assertIn("float8_e5m2", reply["message"])

    def test_missing_session_directory_is_bad_input(self):
        reply = self.refused(session_dir="/nonexistent/kvdump")
        self.assertEqual(reply["kind"], "bad_input")

    def test_missing_model_field_is_bad_input(self):
        model = dict(MODEL)
        del model["num_heads"]
        reply = self.refused(model=model)
        self.assertEqual(reply["kind"], "bad_input")
        self.assertIn("num_heads", reply["message"])

    def test_first_request_not_hello(self):
        s = self.session
        s.add({"type": "bye"})
        status, replies, _ = s.run()
        self.assertEqual(status, 2)
        self.assertEqual(replies[0]["kind"], "bad_input")

    def test_unreadable_hello_exits_2_without_a_reply(self):
        s = self.session
        s.add("{\"type\": \"hel")
        status, replies, log = s.run()
        self.assertEqual((status, replies), (2, []))
        self.assertEqual(len(log.strip().splitlines()), 1, log)

    def test_no_input_at_all(self):
        status, replies, log = self.session.run()
        self.assertEqual((status, replies), (2, []))
        self.assertIn("no hello", log)


def python_can_import(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


HIDE = ("import sys\n"
        "for name in {hidden!r}: sys.modules[name] = None  # import name raises ImportError\n"
        "from kvdump.backends.__main__ import main\n"
        "sys.exit(main({argv!r}))\n")

NOISY = """
import os, sys, types
import kvdump.backends as backends
from kvdump.backends import protocol

class Noisy(protocol.Adapter):
    name = "noisy"
    def start(self, model, files):
        print("noise from print")
        os.write(1, b"noise on descriptor 1\\n")
        return {"adapter": "noisy"}

module = types.ModuleType("kvdump.backends.noisy")
module.Noisy = Noisy
sys.modules["kvdump.backends.noisy"] = module
backends.ADAPTERS["noisy"] = ("noisy", "Noisy", "prints")
from kvdump.backends.__main__ import main
sys.exit(main(["noisy"]))
"""


class ProgramTests(unittest.TestCase):
    """`python -m kvdump.backends` as kvaudit starts it."""

    def hello_model(self):
        return dict(MODEL, kv_lora_rank=512, qk_rope_head_dim=64, page_size=1, num_slots=16)

    def refusal(self, hidden, argv):
        with Driver([sys.executable, "-c", HIDE.format(hidden=hidden, argv=argv)]) as driver:
            reply = driver.hello(self.hello_model())
            status = driver.wait()
            stderr = driver.stderr()
        self.assertEqual(status, 2)
        self.assertNotIn("Traceback", stderr)
        self.assertEqual(reply["type"], "error", reply)
        self.assertEqual(reply["kind"], "unsupported")
        return reply["message"]

    def test_missing_torch_is_unsupported_for_every_adapter(self):
        for adapter in ("torch", "flashinfer-fp8", "flashinfer-cast-bf16"):
            with self.subTest(adapter=adapter):
                message = self.refusal(["torch"], [adapter])
                self.assertIn("torch is not installed", message)

    @unittest.skipUnless(python_can_import("torch"), "torch is not importable here")
    def test_missing_flashinfer_is_unsupported(self):
        for adapter in ("flashinfer-fp8", "flashinfer-cast-bf16"):
            with self.subTest(adapter=adapter):
                message = self.refusal(["flashinfer"], [adapter])
                self.assertIn("flashinfer is not installed", message)

    def test_unreadable_hello_exits_2_with_one_line(self):
        with Driver([sys.executable, "-c", HIDE.format(hidden=[], argv=["torch"])]) as driver:
            driver.send_raw(b"hello?\n")
            status = driver.wait()
            stderr = driver.stderr()
        self.assertEqual(status, 2)
        self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
        self.assertIn("hello", stderr)

    def test_usage_error_exits_2(self):
        result = subprocess.run([sys.executable, "-m", "kvdump.backends", "no-such-adapter"],
                                capture_output=True, cwd=PYTHON_DIR, stdin=subprocess.DEVNULL)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stdout, b"")

    def test_output_of_an_adapter_goes_to_stderr(self):
        with Driver([sys.executable, "-c", NOISY]) as driver:
            reply = driver.hello(self.hello_model())
            bye = driver.bye()
            status = driver.wait()
            stderr = driver.stderr()
        self.assertEqual(reply["type"], "hello", reply)
        self.assertEqual(bye, {"type": "bye"})
        self.assertEqual(status, 0)
        self.assertIn("noise from print", stderr)
        self.assertIn("noise on descriptor 1", stderr)


if __name__ == "__main__":
    unittest.main()
