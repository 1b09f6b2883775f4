"""Tests of kvdump.sglang_capture against the recorded shapes of SGLang 0.4.6.post5, 0.5.4.post3,
0.5.12, 0.5.18 and 0.5.23 (test_sglang_capture_fakes.py): no torch, GPU or SGLang needed.

Per release (one TestCase class each, named after it):
  - a decode step, an extend step with a prefix and another decode are recorded: the dump's pool,
    new_kv, queries, out, slots and paged indices equal what the fake server used, its lse equals
    the tests' own float64 natural-log lse, kv_scale is 1.0; the capture then removes itself;
  - a prefill on the MHA path is recorded from the pool write (q_nope absorbed through w_kc, no
    out/lse);
  - a speculative verify step, a padded (DP attention) batch, a foreign pool writer, a CUDA graph
    entry point and a write outside the attention forward each stop the capture, and the server
    goes on;
  - an exception inside the capture stops it and the server's outputs are those of a server
    without it;
  - a worker killed after step 1, in the middle of step 2, leaves a file h5py and kvaudit read.
Also: the server-flag refusals per release, the refused models (GLM-5), the version gate, and the
installation through a post-import hook.

Where a kvaudit binary is found ($KVAUDIT_BINARY, else build/kvaudit or build-dev/kvaudit), the
captured dumps must also pass `kvaudit check --backend none` (captured out/lse against kvaudit's
reference). Run: /usr/bin/python3 -m unittest discover -s python/tests
"""

import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import types
import unittest
from unittest import mock

import h5py
import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.abspath(os.path.join(TESTS_DIR, "..", ".."))
sys.path.insert(0, TESTS_DIR)

import test_sglang_capture_fakes as fakes  # noqa: E402
from kvdump import sglang_capture as capture  # noqa: E402

LOGGER = "kvdump.sglang_capture"


def kvaudit_binary():
    candidates = [os.environ.get("KVAUDIT_BINARY", "")]
    candidates += [os.path.join(REPO_DIR, d, "kvaudit") for d in ("build", "build-dev")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def read_dump(path):
    """{"attrs", "layers": {id: {...}}, "steps": [{"attrs", arrays..., "layers": {...}}]}."""
    with h5py.File(path, "r") as f:
        dump = {"attrs": dict(f.attrs), "layers": {}, "steps": []}
        for name, group in f["layers"].items():
            dump["layers"][int(name[1:])] = dict(group.attrs, kv_cache=group["kv_cache"][()])
        for name in sorted(f["steps"]):
            group = f["steps"][name]
            step = {"attrs": dict(group.attrs), "layers": {}}
            for key, item in group.items():
                if isinstance(item, h5py.Group):
                    step["layers"][int(key[1:])] = {k: v[()] for k, v in item.items()}
                else:
                    step[key] = item[()]
            dump["steps"].append(step)
    return dump


def expected_indices(world, batch):
    """Paged indices (page size 1) of a batch, from the fake scheduler's own table."""
    seq_lens = np.asarray(batch.seq_lens)
    rows = ([1] * len(seq_lens) if batch.forward_mode.name == "DECODE"
            else list(batch.extend_seq_lens_cpu))
    table = world.requests.req_to_token
    return dict(qo_indptr=np.concatenate([[0], np.cumsum(rows)]),
                kv_indptr=np.concatenate([[0], np.cumsum(seq_lens)]),
                kv_indices=np.concatenate([table[r, :n] for r, n in
                                           zip(batch.req_pool_indices, seq_lens)]),
                kv_last_page_len=np.ones(len(seq_lens)),
                new_kv_slots=np.asarray(batch.out_cache_loc))


class VersionCase:
    """The capture on one release's shapes; the classes below mix it with TestCase per release."""

    version = None

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "capture.h5")

    def tearDown(self):
        self.tmp.cleanup()

    def world(self, **options):
        return fakes.World(self.version, **options)

    def assert_step_matches(self, world, step, batch, server_step, with_outputs=True):
        for name, value in expected_indices(world, batch).items():
            np.testing.assert_array_equal(step[name], value, err_msg=name)
        self.assertEqual(step["attrs"]["kind"],
                         "decode" if batch.forward_mode.name == "DECODE" else "prefill")
        for layer_id, tensors in step["layers"].items():
            inputs = server_step[layer_id]
            rows = len(batch.out_cache_loc)
            new_kv = np.concatenate([inputs["k_nope"].reshape(rows, -1),
                                     inputs["k_pe"].reshape(rows, -1)], axis=1)
            np.testing.assert_array_equal(tensors["new_kv"], new_kv)
            np.testing.assert_array_equal(tensors["q_pe"], inputs["q_pe"])
            if with_outputs:
                np.testing.assert_array_equal(tensors["q_nope"], inputs["q_nope"])
                np.testing.assert_array_equal(tensors["out"],
                                              inputs["out"].reshape(rows, fakes.H, fakes.DC))
                self.assert_lse(world, batch, inputs, tensors["lse"], layer_id)

    def assert_lse(self, world, batch, inputs, lse, layer_id):
        indices = expected_indices(world, batch)
        for b in range(len(batch.seq_lens)):
            first, last = indices["qo_indptr"][b], indices["qo_indptr"][b + 1]
            tokens = indices["kv_indices"][indices["kv_indptr"][b]:indices["kv_indptr"][b + 1]]
            for j, i in enumerate(range(first, last)):
                visible = tokens[:len(tokens) - (last - first) + j + 1]
                want = fakes.reference_lse(world, None, inputs["q_nope"][i], inputs["q_pe"][i],
                                           layer_id, visible)
                np.testing.assert_allclose(lse[i], want, rtol=1e-6, atol=1e-6)

    def assert_kvaudit_accepts(self, path):
        binary = kvaudit_binary()
        if binary is None:
            return
        run = subprocess.run([binary, "check", path, "--backend", "none", "--threads", "2"],
                             capture_output=True, text=True)
        self.assertEqual(run.returncode, 0, f"kvaudit check:\n{run.stdout}\n{run.stderr}")

    def assert_removed(self, world, cap):
        for layer in world.model.model.layers:
            for module in (layer.self_attn, layer.self_attn.attn_mqa, layer.self_attn.attn_mha):
                self.assertEqual(module.pre_hooks, {})
                self.assertEqual(module.post_hooks, {})
        for name in ("set_mla_kv_buffer", "set_kv_buffer"):
            self.assertNotIn(name, vars(world.pool))
        self.assertNotIn("run", vars(world.backend.decode_wrapper))
        for name in world.shape.graph_methods:
            self.assertEqual(getattr(world.backend, name), world.backend._graph)
        self.assertIsNone(cap._writer)

    # --- recorded steps ---

    def test_decode_and_prefix_extend_steps_are_recorded(self):
        world = self.world()
        world.prefill([3, 2])  # before the capture: the snapshot holds these 5 tokens
        pool_before = [buffer.copy() for buffer in world.pool.kv_buffer]
        cap = world.capture(self.path, max_steps=3)
        decode = world.decode([0, 1])
        extend = world.extend([0], [3])  # request 0 has a 4-token prefix
        last = world.decode([0, 1])
        self.assertEqual((cap.state, cap.steps_written), ("finished", 3))
        world.decode([0, 1])  # runs without the capture
        self.assert_removed(world, cap)

        dump = read_dump(self.path)
        attrs = dump["attrs"]
        self.assertEqual((attrs["page_size"], attrs["kv_dtype"], attrs["num_heads"],
                          attrs["kv_lora_rank"], attrs["qk_rope_head_dim"]),
                         (1, "float8_e4m3fn", fakes.H, fakes.DC, fakes.DR))
        self.assertEqual(attrs["sm_scale"], fakes.SM_SCALE)
        for layer_id, layer in dump["layers"].items():
            self.assertEqual(layer["kv_scale"], np.float32(1.0))
            np.testing.assert_array_equal(layer["kv_cache"], pool_before[layer_id])
        self.assertEqual(len(dump["steps"]), 3)
        for step, server_step, batch in zip(dump["steps"], world.steps[1:4], world.batches[1:4]):
            self.assert_step_matches(world, step, batch, server_step)
        self.assertEqual(extend[0]["out"].shape[0], 3)
        self.assertIsNotNone(decode and last)
        self.assert_kvaudit_accepts(self.path)

    def test_mha_path_prefill_is_recorded_from_the_pool_write(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=2)
        with self.assertLogs(LOGGER, level="WARNING") as logs:
            world.prefill([3, 2], path="mha")
            world.decode([0, 1])
        self.assertEqual(cap.state, "finished")
        self.assertTrue(any("MHA-path" in line for line in logs.output))
        dump = read_dump(self.path)
        mha, decode = dump["steps"]
        self.assert_step_matches(world, mha, world.batches[0], world.steps[0], with_outputs=False)
        self.assert_step_matches(world, decode, world.batches[1], world.steps[1])
        for layer_id, tensors in mha["layers"].items():
            self.assertNotIn("out", tensors)
            self.assertNotIn("lse", tensors)
            q_mha = world.steps[0][layer_id]["q_mha"]
            w_kc = fakes.f32(world.model.model.layers[layer_id].self_attn.w_kc).astype(np.float64)
            want = np.einsum("thn,hnc->thc", fakes.f32(q_mha[..., :fakes.DN]).astype(np.float64),
                             w_kc)
            np.testing.assert_allclose(fakes.f32(tensors["q_nope"]), want, rtol=1 / 128,
                                       atol=1e-6)
        self.assert_kvaudit_accepts(self.path)

    def test_idle_batches_are_not_steps(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=2)
        world.prefill([2])
        world.idle()
        world.decode([0])
        self.assertEqual((cap.state, cap.steps_written), ("finished", 2))
        kinds = [step["attrs"]["kind"] for step in read_dump(self.path)["steps"]]
        self.assertEqual(kinds, ["prefill", "decode"])

    def test_skip_steps_and_pool_after(self):
        world = self.world()
        cap = world.capture(self.path, layer_ids=(1,), max_steps=2, skip_steps=1,
                            capture_pool_after=True)
        world.prefill([2, 2])
        pool_before = world.pool.kv_buffer[1].copy()
        world.decode([0, 1])
        after_first = world.pool.kv_buffer[1].copy()
        world.decode([0, 1])
        self.assertEqual(cap.state, "finished")
        dump = read_dump(self.path)
        self.assertEqual(list(dump["layers"]), [1])
        np.testing.assert_array_equal(dump["layers"][1]["kv_cache"], pool_before)
        np.testing.assert_array_equal(dump["steps"][0]["layers"][1]["kv_cache_after"], after_first)
        np.testing.assert_array_equal(dump["steps"][1]["layers"][1]["kv_cache_after"],
                                      world.pool.kv_buffer[1])
        self.assert_kvaudit_accepts(self.path)

    def test_bf16_pool_and_checkpoint_scale(self):
        world = self.world(pool_dtype="torch.bfloat16")
        world.model.model.layers[0].self_attn.attn_mqa.k_scale_float = 0.5
        cap = world.capture(self.path, max_steps=1)
        with self.assertLogs(LOGGER, level="WARNING") as logs:
            world.prefill([2])
        self.assertEqual(cap.state, "finished")
        self.assertTrue(any("k_scale 0.5" in line for line in logs.output), logs.output)
        dump = read_dump(self.path)
        self.assertEqual(dump["attrs"]["kv_dtype"], "bfloat16")
        self.assertEqual(dump["layers"][0]["kv_scale"], np.float32(1.0))
        self.assert_kvaudit_accepts(self.path)

    # --- refused steps: the capture stops, the server goes on ---

    def stopped(self, world, cap, act, reason):
        with self.assertLogs(LOGGER, level="WARNING") as logs:
            act()
        self.assertEqual(cap.state, "stopped", cap.stop_reason)
        self.assertIn(reason, cap.stop_reason)
        self.assertTrue(any(reason in line for line in logs.output))
        self.assert_removed(world, cap)
        world.decode([0])  # the server goes on, without hooks

    def test_speculative_verify_step_stops_capture(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=5)
        world.prefill([2])
        self.stopped(world, cap, lambda: world.verify([0]), "TARGET_VERIFY")
        self.assertEqual(len(world.steps[1][0]["out"]), 2)  # the verify step itself ran
        self.assertEqual(len(read_dump(self.path)["steps"]), 1)
        self.assert_kvaudit_accepts(self.path)

    def test_padded_dp_attention_batch_stops_capture(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=5)
        world.prefill([2])

        def padded():
            batch = world._batch("DECODE", [0], [1])
            batch.global_num_tokens_cpu = [1, 4]
            world.run(batch)

        self.stopped(world, cap, padded, "padded")

    def test_foreign_pool_writer_stops_capture(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=5)
        world.prefill([2])
        name = world.shape.foreign_writers[0]
        self.stopped(world, cap, lambda: getattr(world.pool, name)(), name)
        self.assertEqual(world.pool.foreign_calls, 1)  # the server's call still ran

    def test_cuda_graph_entry_point_stops_capture(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=5)
        world.prefill([2])
        name = world.shape.graph_methods[-1]
        self.stopped(world, cap, lambda: getattr(world.backend, name)(), name)
        self.assertEqual(world.backend.graph_calls, 1)

    def test_write_outside_attention_stops_capture(self):
        world = self.world()
        cap = world.capture(self.path, max_steps=5)
        world.prefill([2])
        attn = world.model.model.layers[1].self_attn.attn_mqa
        rows = fakes.bf16(np.zeros((1, 1, fakes.D)))
        stray = lambda: world.pool.set_kv_buffer(attn, np.array([150]), rows, None)  # noqa: E731
        self.stopped(world, cap, stray, "outside its attention forward")

    def test_exception_in_the_capture_stops_it_not_the_server(self):
        plain, world = self.world(seed=7), self.world(seed=7)
        for target in (plain, world):
            target.prefill([3])
        cap = world.capture(self.path, max_steps=5)
        real = capture.lse_by_rerun
        calls = []

        def fails_on_third(*args, **kwargs):  # steps 1 fine (2 layers), step 2 fails
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("boom")
            return real(*args, **kwargs)

        with mock.patch.object(capture, "lse_by_rerun", fails_on_third):
            world.decode([0])
            with self.assertLogs(LOGGER, level="WARNING") as logs:
                world.decode([0])
        self.assertEqual(cap.state, "stopped")
        self.assertIn("RuntimeError: boom", cap.stop_reason)
        self.assertTrue(any("Traceback" in line for line in logs.output))
        self.assert_removed(world, cap)
        plain.decode([0])
        plain.decode([0])
        for ours, theirs in zip(world.steps, plain.steps):
            for layer_id in ours:
                np.testing.assert_array_equal(ours[layer_id]["out"], theirs[layer_id]["out"])
        self.assertEqual(len(read_dump(self.path)["steps"]), 1)
        self.assert_kvaudit_accepts(self.path)

    def test_killed_worker_leaves_a_readable_file(self):
        script = textwrap.dedent(f"""
            import os, signal, sys
            sys.path.insert(0, {TESTS_DIR!r})
            import test_sglang_capture_fakes as fakes
            world = fakes.World({self.version!r})
            cap = world.capture({self.path!r}, max_steps=5)
            world.prefill([3, 2])                    # step 1, written and flushed
            kill = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
            world.model.model.layers[1].self_attn.register_forward_pre_hook(kill, with_kwargs=True)
            world.decode([0, 1])                     # killed in the middle of step 2
            print("not killed")
            """)
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        self.assertEqual(run.returncode, -signal.SIGKILL, run.stdout + run.stderr)
        dump = read_dump(self.path)
        self.assertEqual(len(dump["steps"]), 1)
        self.assertEqual(sorted(dump["steps"][0]["layers"]), [0, 1])
        binary = kvaudit_binary()
        if binary is not None:
            info = subprocess.run([binary, "info", self.path], capture_output=True, text=True)
            self.assertEqual(info.returncode, 0, info.stdout + info.stderr)
        self.assert_kvaudit_accepts(self.path)

    # --- accessors and refusals up front ---

    def test_accessors_find_pools_and_rank(self):
        world = self.world(tp_rank=3)
        world.prefill([2])
        batch = world.batches[0]
        api = world.api()
        if world.shape.pools_on_batch:
            self.assertIs(api.runtime(batch)[1], world.pool)
            runner = types.SimpleNamespace(tp_rank=3)
        else:
            self.assertFalse(hasattr(batch, "token_to_kv_pool"))
            with self.assertRaises(capture.CaptureStopped):
                api.runtime(batch)  # no forward context outside a forward
            world.context.current = world.backend
            backend, pool, requests = api.runtime(batch)
            self.assertEqual((backend, pool, requests), (world.backend, world.pool, world.requests))
            runner = types.SimpleNamespace()  # ModelRunner.tp_rank is gone
        self.assertEqual(api.tp_rank(runner), 3)

    def test_server_flags(self):
        shape = fakes.VERSIONS[self.version]
        self.assertEqual(capture.server_args_problems(fakes.server_args(shape)), [])
        launched = dict(shape.server_flags, attention_backend="fa3")  # a plain launch on Hopper
        if shape.graph_config:
            phase = types.SimpleNamespace(backend="full")
            launched["cuda_graph_config"] = types.SimpleNamespace(decode=phase, prefill=phase)
        problems = "\n".join(capture.server_args_problems(types.SimpleNamespace(**launched)))
        self.assertIn("--attention-backend flashinfer", problems)
        self.assertIn("--disable-cuda-graph", problems)
        for change, words in ((dict(speculative_algorithm="EAGLE"), "--speculative-algorithm"),
                              (dict(enable_hierarchical_cache=True), "HiCache"),
                              (dict(enable_dp_attention=True), "DP attention"),
                              (dict(disaggregation_mode="decode"), "prefill server"),
                              (dict(prefill_attention_backend="fa3"), "flashinfer")):
            args = fakes.server_args(shape, **change)
            self.assertIn(words, "\n".join(capture.server_args_problems(args)), change)
        if "disable_piecewise_cuda_graph" in shape.server_flags:  # 0.5.12: prefill graphs
            args = fakes.server_args(shape, disable_piecewise_cuda_graph=False)
            self.assertIn("--disable-piecewise-cuda-graph",
                          "\n".join(capture.server_args_problems(args)))

    def test_install_on_a_model_runner(self):
        world = self.world(tp_rank=2)
        world.tp_rank = 2
        template = os.path.join(self.tmp.name, "L{layer}_rank{rank}.h5")
        cap = capture.capture_for_runner(world, [1, 0], template, api=world.api(), max_steps=1)
        self.assertEqual(cap.layer_ids, [0, 1])
        self.assertEqual(cap.path, os.path.join(self.tmp.name, "L0-1_rank2.h5"))
        self.assertIn(f"sglang {self.version} flashinfer_mla tp-rank 2", cap.producer)
        world.prefill([2])
        self.assertEqual(cap.state, "finished")
        self.assert_kvaudit_accepts(cap.path)

    def test_install_refuses_what_it_cannot_capture(self):
        cases = ((dict(architecture="GlmMoeDsaForCausalLM"), "656-byte"),
                 (dict(version="0.5.99"), "was not checked"),
                 (dict(flags=dict(disable_cuda_graph=False, cuda_graph_config=None)),
                  "--disable-cuda-graph"))
        for case, words in cases:
            world = self.world()
            api = world.api()
            api.version = case.get("version", api.version)
            world.model_config.hf_config.architectures = [case.get("architecture",
                                                                   "DeepseekV3ForCausalLM")]
            for name, value in case.get("flags", {}).items():
                setattr(world.server_args, name, value)
            with self.assertLogs(LOGGER, level="WARNING") as logs:
                self.assertIsNone(capture.capture_for_runner(world, [0], self.path, api=api))
            self.assertIn(words, "\n".join(logs.output), case)
            self.assertEqual(world.model.model.layers[0].self_attn.pre_hooks, {})
        world = self.world()
        api = world.api()
        api.version = "0.5.99"
        self.assertIsNotNone(capture.capture_for_runner(world, [0], self.path, api=api,
                                                        allow_unverified_version=True))


for _version in fakes.VERSIONS:
    _name = "TestSglang_" + _version.replace(".", "_")
    globals()[_name] = type(_name, (VersionCase, unittest.TestCase), {"version": _version})
del _version, _name


class ModelsAndInstallation(unittest.TestCase):
    def test_served_and_refused_models(self):
        for architecture in ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"):
            self.assertEqual(capture.architecture_problems(architecture), [])
        glm5 = capture.architecture_problems("GlmMoeDsaForCausalLM")[0]
        for words in ("GLM-5", "64-token", "656-byte", "sparse"):
            self.assertIn(words, glm5)
        other = capture.architecture_problems("LlamaForCausalLM")[0]
        self.assertIn("DeepSeek-V3 / DeepSeek-R1", other)
        self.assertIn("GLM-4.7-Flash", other)

    def test_versions(self):
        for version in capture.CHECKED_VERSIONS:
            self.assertEqual(capture.version_problems(version), [])
        self.assertTrue(capture.version_problems("0.5.24"))
        self.assertEqual(capture.version_problems("0.5.24", allow_unverified_version=True), [])

    def test_lse_is_converted_from_base_2(self):
        class Wrapper:
            _page_size, _causal = 1, False

            def run(self, *args, return_lse=False, **kwargs):
                assert return_lse and "out" not in kwargs
                return np.zeros((1, 2, 4), np.uint16), np.array([[1.0, -3.0]], np.float32)

        out = np.zeros((1, 2, 4), np.uint16)
        lse, differing = capture.lse_by_rerun((Wrapper(), (), {"out": out}), out, "decode")
        np.testing.assert_allclose(lse, [[math.log(2.0), -3 * math.log(2.0)]], rtol=1e-7)
        self.assertEqual((lse.dtype, differing), (np.float32, 0))

    def test_environment_installs_a_post_import_patch(self):
        with tempfile.TemporaryDirectory() as root:
            package = os.path.join(root, "sglang", "srt", "model_executor")
            os.makedirs(package)
            for folder in ("sglang", "sglang/srt", "sglang/srt/model_executor"):
                open(os.path.join(root, folder, "__init__.py"), "w").close()
            with open(os.path.join(package, "model_runner.py"), "w") as f:
                f.write("class ModelRunner:\n    def load_model(self):\n        return 'loaded'\n")
            script = textwrap.dedent(f"""
                import sys
                sys.path[:0] = [{root!r}, {os.path.join(REPO_DIR, "python")!r}]
                from kvdump import sglang_capture
                assert not sglang_capture.install_from_environment({{}})
                assert sglang_capture.install_from_environment(
                    {{"KVDUMP_SGLANG_LAYERS": "3,5", "KVDUMP_SGLANG_PATH": "/tmp/x_{{rank}}.h5"}})
                assert "sglang.srt.model_executor.model_runner" not in sys.modules
                from sglang.srt.model_executor.model_runner import ModelRunner
                print(ModelRunner.load_model.__name__)
                print(ModelRunner().load_model())   # refused (no server args): still loads
                """)
            run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
            self.assertEqual(run.returncode, 0, run.stderr)
            self.assertEqual(run.stdout.split(), ["load_model_and_capture", "loaded"])
            self.assertIn("kvdump capture not installed", run.stderr)


class TorchTensors(unittest.TestCase):
    """The host conversions on real torch tensors (skipped where torch does not import, as in CI):
    a float8 pool copied (not viewed), bf16 writes and queries as bits, int64 index tensors."""

    def setUp(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed")
        if not hasattr(torch, "float8_e4m3fn"):
            self.skipTest("torch < 2.1 has no float8_e4m3fn")
        self.torch = torch

    def test_conversions(self):
        torch = self.torch
        pool = torch.zeros((6, 1, fakes.D), dtype=torch.uint8)
        pool[2, 0, :] = 0x38  # 1.0 in e4m3fn
        snapshot = capture._host_copy(pool.view(torch.float8_e4m3fn), "pool")
        pool[2, 0, :] = 0x40  # a later write must not reach the snapshot
        self.assertEqual((snapshot.dtype, int(snapshot[2, 0, 0])), (np.uint8, 0x38))

        k_nope = torch.randn(3, 1, fakes.DC).to(torch.bfloat16)
        k_rope = torch.randn(3, 1, fakes.DR).to(torch.bfloat16)
        new_kv = capture.new_kv_from_write("set_mla_kv_buffer", k_nope, k_rope, fakes.D)
        want = torch.cat([k_nope, k_rope], dim=-1).reshape(3, fakes.D).view(torch.int16)
        np.testing.assert_array_equal(new_kv, want.numpy().view(np.uint16))
        with self.assertRaises(capture.CaptureStopped):
            capture.new_kv_from_write("set_kv_buffer", k_nope.float(), None, fakes.DC)

        q = torch.randn(fakes.H, 3, fakes.DC).to(torch.bfloat16).transpose(0, 1)  # as bmm leaves it
        q_rope = torch.randn(3, fakes.H, fakes.DR).to(torch.bfloat16)
        q_nope, q_pe = capture.queries_from_mqa((q, None, None, None), {"q_rope": q_rope},
                                                fakes.H, fakes.DC)
        np.testing.assert_array_equal(q_nope, q.contiguous().view(torch.int16).numpy()
                                      .view(np.uint16))
        self.assertEqual(q_pe.shape, (3, fakes.H, fakes.DR))

        table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
        batch = fakes.ForwardBatch(fakes.ForwardMode.DECODE, 2, torch.tensor([3, 1]),
                                   torch.tensor([2, 4]), torch.tensor([31, 13]))
        indices, loc = capture.step_indices("decode", batch, table)
        np.testing.assert_array_equal(indices["kv_indices"], [30, 31, 10, 11, 12, 13])
        np.testing.assert_array_equal(loc, [31, 13])
        self.assertFalse(capture._stream_capturing())


if __name__ == "__main__":
    logging.basicConfig()
    unittest.main()
