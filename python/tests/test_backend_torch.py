"""The `torch` adapter of kvdump.backends on the CPU, against references written here from
docs/kvdump-v1.md with numpy and python/kvdump/codec.py only.

Numerics: a tiny paged case (H 3, Dc 16, Dr 8, page 2, 8 pages; a request with cached tokens that
extends by 2, one with cached tokens and no rows in the prefill, an empty one, a fresh 3-token
prefill; then a decode; every slot without a token holds NaN codes) is served through the protocol
(tests/protocol_driver.py) with `--write kvdump`. The pool after each step must equal the kvdump
write rule's exactly (slots not written keep their NaN codes), out must agree with a float64
reference to bf16 rounding and lse to 1e-5. A NaN code in a token a request sees makes that
request's rows NaN and no other's. Each planted fault must move the result to the reference of
its own wrong convention (and away from the clean one): lse-base2, scale-pow2, scale-latent-only,
sm-scale-missing, read-e5m2, p-e4m3, round-toward-zero (codes checked against a truncation written
here). A bfloat16 pool stores new_kv's bits.

Write rules (kvdump/backends/writes.py) against codec.py on values that exercise them: ties,
464/480 and beyond, infinities, NaN, subnormals, and quotients where division and reciprocal
multiplication differ. `server` is PyTorch's cast of the bf16 quotient: exactly
encode_e4m3(bf16(x / s)) wherever that quotient is within +-464, and past it whatever the
installed torch does (saturation in torch 2.15, the NaN code in older releases), as the adapter's
describe reports; it differs from kvdump's rule by one code where the bf16 quotient double-rounds.

Skipped by name where torch (>= 2.1) is not importable.
Run: python3 -m unittest discover -s python/tests
"""

import math
import os
import sys
import unittest

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TESTS_DIR, ".."))
sys.path.insert(0, TESTS_DIR)

import kvdump  # noqa: E402
from protocol_driver import Driver  # noqa: E402

try:
    import torch
    TORCH_MISSING = None if hasattr(torch, "float8_e4m3fn") else (
        f"torch {torch.__version__} has no float8_e4m3fn (the adapter needs torch >= 2.1)")
except (ImportError, OSError) as error:
    torch = None
    TORCH_MISSING = f"torch is not importable ({error}); the torch adapter tests need it"

H, DC, DR, PAGE, PAGES = 3, 16, 8, 2, 8
D, SLOTS = DC + DR, PAGE * PAGES
KV_SCALE = float(np.float32(0.37))
SM_SCALE = 0.31
MODEL = {"num_heads": H, "kv_lora_rank": DC, "qk_rope_head_dim": DR, "sm_scale": SM_SCALE,
         "page_size": PAGE, "num_slots": SLOTS, "kv_dtype": "float8_e4m3fn",
         "kv_scale_kind": "per_tensor"}

# Pages (docs/kvdump-v1.md "Semantics"): request 0 holds 3 cached tokens in pages 5, 2 (slots
# 10, 11, 4); request 1 holds 2 in page 7 (slots 14, 15); request 2 is empty; request 3 is new.
CACHED = [10, 11, 4, 14, 15]
STEPS = [
    ("prefill", {"qo_indptr": [0, 2, 2, 2, 5], "kv_indptr": [0, 3, 4, 4, 6],
                 "kv_indices": [5, 2, 6, 7, 0, 3], "kv_last_page_len": [1, 2, 0, 1],
                 "new_kv_slots": [5, 12, 0, 1, 6]}),
    ("decode", {"qo_indptr": [0, 1, 2, 2, 3], "kv_indptr": [0, 3, 5, 5, 7],
                "kv_indices": [5, 2, 6, 7, 1, 0, 3], "kv_last_page_len": [2, 1, 0, 2],
                "new_kv_slots": [13, 2, 7]}),
]
LN2 = math.log(2.0)


def bf16_values(rng, *shape, scale=1.0):
    values = (rng.standard_normal(shape) * scale).astype(np.float32)
    return kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(values))


def decode_e5m2(codes):
    """Independent e5m2 decoder: S.EEEEE.MM, bias 15 (only finite codes occur here)."""
    codes = codes.astype(np.int64)
    exponent, mantissa = (codes >> 2) & 0x1F, (codes & 3).astype(np.float64)
    value = np.where(exponent == 0, mantissa / 4 * 2.0**-14,
                     (1 + mantissa / 4) * np.exp2(exponent - 15.0))
    value = np.where(exponent == 31, np.nan, value)
    return np.where(codes & 0x80, -value, value)


def truncated_codes(quotients):
    """e4m3fn codes of float32 quotients rounded toward zero (saturating at 448; NaN -> 0x7F),
    by search in the table of positive values: the largest value not above |q|."""
    table = kvdump.decode_e4m3(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    magnitude = np.minimum(np.abs(quotients.astype(np.float64)), 448.0)
    code = np.searchsorted(table, np.nan_to_num(magnitude), side="right") - 1
    code = code.astype(np.uint8) | np.where(np.signbit(quotients), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(quotients), np.uint8(0x7F), code).astype(np.uint8)


def make_case(seed=5):
    """The initial pool (NaN codes where no token is cached) and each step's tensors."""
    rng = np.random.default_rng(seed)
    pool = np.where(rng.random((SLOTS, D)) < 0.5, 0x7F, 0xFF).astype(np.uint8)
    pool[CACHED] = kvdump.quantize_e4m3(bf16_values(rng, len(CACHED), D, scale=8.0), KV_SCALE)
    steps = []
    for kind, indices in STEPS:
        nq = len(indices["new_kv_slots"])
        steps.append({"kind": kind, "indices": {k: np.array(v, np.int32)
                                                for k, v in indices.items()},
                      "q_nope": bf16_values(rng, nq, H, DC, scale=0.4),
                      "q_pe": bf16_values(rng, nq, H, DR, scale=0.4),
                      "new_kv": bf16_values(rng, nq, D, scale=8.0)})
    return pool, steps


def visible_slots(indices):
    """For every row, the slots it sees (kvdump-v1 "Causal positions")."""
    qo, kv, pages, last = (indices[k] for k in ("qo_indptr", "kv_indptr", "kv_indices",
                                                "kv_last_page_len"))
    rows = []
    for b in range(len(last)):
        count = kv[b + 1] - kv[b]
        kv_len = (count - 1) * PAGE + last[b] if count else 0
        n_q = qo[b + 1] - qo[b]
        for j in range(n_q):
            position = kv_len - n_q + j
            rows.append([pages[kv[b] + p // PAGE] * PAGE + p % PAGE for p in range(position + 1)])
    return rows


def reference(pool, steps, write=None, ckv_scale=KV_SCALE, kpe_scale=KV_SCALE,
              sm_scale=SM_SCALE, decode=kvdump.decode_e4m3, round_p=False):
    """float64 replay: per step (pool after, out [Nq, H, Dc], lse [Nq, H])."""
    pool = pool.copy()
    results = []
    for step in steps:
        slots = step["indices"]["new_kv_slots"]
        pool[slots] = (write or (lambda x: kvdump.quantize_e4m3(x, KV_SCALE)))(step["new_kv"])
        values = decode(pool).astype(np.float64)
        values[:, :DC] *= ckv_scale
        values[:, DC:] *= kpe_scale
        rows = visible_slots(step["indices"])
        out = np.zeros((len(rows), H, DC))
        lse = np.zeros((len(rows), H))
        for i, seen in enumerate(rows):
            c, r = values[seen, :DC], values[seen, DC:]
            s = sm_scale * (step["q_nope"][i].astype(np.float64) @ c.T
                            + step["q_pe"][i].astype(np.float64) @ r.T)
            top = s.max(axis=1, keepdims=True)
            lse[i] = top[:, 0] + np.log(np.exp(s - top).sum(axis=1))
            p = np.exp(s - lse[i][:, None])
            if round_p:
                p = kvdump.decode_e4m3(kvdump.encode_e4m3(p.astype(np.float32)))
            out[i] = p @ c
        results.append((pool.copy(), out, lse))
    return results


def serve(pool, steps, *options, model=None, pool_dtype="uint8", kv_scale=KV_SCALE):
    """Runs the steps through `python -m kvdump.backends torch --device cpu OPTIONS`; returns per
    step (pool after, out as float32, lse) and the hello reply."""
    command = [sys.executable, "-m", "kvdump.backends", "torch", "--device", "cpu", *options]
    with Driver(command) as driver:
        hello = driver.hello(model or MODEL)
        assert hello["type"] == "hello", hello
        reply = driver.layer("L003", 3, kv_scale, pool, dtype=pool_dtype)
        assert reply == {"type": "ok"}, reply
        results = []
        for index, step in enumerate(steps):
            output = driver.step(index, f"S{index:03d}", step["kind"], "L003", 3, kv_scale,
                                 step["indices"], kvdump.bf16_bits_from_float32(step["q_nope"]),
                                 kvdump.bf16_bits_from_float32(step["q_pe"]),
                                 kvdump.bf16_bits_from_float32(step["new_kv"]))
            assert output.reply["type"] == "result", (output.reply, driver.stderr())
            results.append((output.pool, kvdump.float32_from_bf16_bits(output.out_bits),
                            output.lse))
        assert driver.bye() == {"type": "bye"}
        assert driver.wait() == 0
    return results, hello


def out_close(out, ref):
    """out (bf16 values) within bf16 rounding of the float64 reference (plus fp32 noise)."""
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    return np.all(np.abs(out - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * scale)


def lse_close(lse, ref):
    return np.all(np.abs(lse - ref) <= 1e-5 * (1 + np.abs(ref)))


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class TorchAdapterNumericsTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pool, cls.steps = make_case()
        cls.clean = reference(cls.pool, cls.steps)
        cls.served, cls.hello = serve(cls.pool, cls.steps, "--write", "kvdump")

    def test_pool_after_each_step_is_the_kvdump_write(self):
        for (pool, _, _), (ref_pool, _, _) in zip(self.served, self.clean):
            np.testing.assert_array_equal(pool, ref_pool)
        # The slots no step wrote kept their NaN codes.
        written = np.concatenate([s["indices"]["new_kv_slots"] for s in self.steps] + [CACHED])
        unwritten = np.setdiff1d(np.arange(SLOTS), written)
        np.testing.assert_array_equal(self.served[-1][0][unwritten], self.pool[unwritten])

    def test_out_and_lse_match_float64(self):
        for (_, out, lse), (_, ref_out, ref_lse) in zip(self.served, self.clean):
            self.assertTrue(np.all(np.isfinite(out)) and np.all(np.isfinite(lse)))
            self.assertTrue(out_close(out, ref_out), np.abs(out - ref_out).max())
            self.assertTrue(lse_close(lse, ref_lse), np.abs(lse - ref_lse).max())

    def test_describe_names_the_adapter_and_versions(self):
        describe = self.hello["describe"]
        self.assertEqual(describe["adapter"], "torch")
        self.assertEqual(describe["torch"], torch.__version__)
        self.assertTrue(describe["device"].startswith("cpu"))
        self.assertEqual(describe["options"]["write"], "kvdump")
        self.assertIn("past_464", describe["torch_fp8_cast"])
        self.assertNotIn("faults", describe)
        self.assertEqual(self.hello["capabilities"], ["check"])

    def test_a_visible_nan_code_reaches_only_its_request(self):
        pool = self.pool.copy()
        pool[11, 3] = 0x7F  # request 0, position 1: seen by request 0's rows only
        served, _ = serve(pool, self.steps, "--write", "kvdump")
        for index, (_, out, lse) in enumerate(served):
            request0 = 2 if index == 0 else 1  # its rows come first in both steps
            self.assertTrue(np.all(np.isnan(out[:request0])) and np.all(np.isnan(lse[:request0])))
            self.assertTrue(np.all(np.isfinite(out[request0:])))
            self.assertTrue(np.all(np.isfinite(lse[request0:])))

    def fault_matches(self, fault, **convention):
        served, hello = serve(self.pool, self.steps, "--write", "kvdump", "--fault", fault)
        self.assertTrue(any(fault in text for text in hello["describe"]["faults"]))
        wrong = reference(self.pool, self.steps, **convention)
        for (_, out, lse), (_, ref_out, ref_lse), (_, clean_out, clean_lse) in zip(
                served, wrong, self.clean):
            self.assertTrue(out_close(out, ref_out), np.abs(out - ref_out).max())
            self.assertTrue(lse_close(lse, ref_lse), np.abs(lse - ref_lse).max())
        return served

    def test_fault_scale_pow2_reads_with_the_power_of_two_below(self):
        pow2 = 2.0 ** math.floor(math.log2(KV_SCALE))  # 0.25 for 0.37
        served = self.fault_matches("scale-pow2", ckv_scale=pow2, kpe_scale=pow2)
        self.assertFalse(out_close(served[0][1], self.clean[0][1]))

    def test_fault_scale_latent_only(self):
        self.fault_matches("scale-latent-only", kpe_scale=1.0)

    def test_fault_sm_scale_missing(self):
        self.fault_matches("sm-scale-missing", sm_scale=1.0)

    def test_fault_read_e5m2(self):
        self.fault_matches("read-e5m2", decode=decode_e5m2)

    def test_fault_p_e4m3(self):
        self.fault_matches("p-e4m3", round_p=True)

    def test_fault_lse_base2(self):
        served, _ = serve(self.pool, self.steps, "--write", "kvdump", "--fault", "lse-base2")
        for (_, out, lse), (_, ref_out, ref_lse) in zip(served, self.clean):
            self.assertTrue(out_close(out, ref_out))
            self.assertTrue(lse_close(lse, ref_lse / LN2))
            self.assertFalse(lse_close(lse, ref_lse))

    def test_fault_round_toward_zero_truncates_every_written_code(self):
        served, _ = serve(self.pool, self.steps, "--write", "kvdump", "--fault",
                          "round-toward-zero")
        truncate = reference(self.pool, self.steps, write=lambda x: truncated_codes(
            x / np.float32(KV_SCALE)))
        for (pool, _, _), (ref_pool, _, _), (clean_pool, _, _) in zip(served, truncate,
                                                                      self.clean):
            np.testing.assert_array_equal(pool, ref_pool)
            self.assertTrue(np.any(pool != clean_pool))

    def test_pool_reloaded_reads_a_replaced_pool_file(self):
        """kvaudit may rewrite the pool file between steps (pool_reloaded): the adapter must
        serve the next step from the new file, even when it is a new file under the old name."""
        step0, step1 = self.steps
        command = [sys.executable, "-m", "kvdump.backends", "torch", "--device", "cpu", "--write",
                   "kvdump"]
        replaced = self.pool.copy()
        replaced[CACHED] = kvdump.quantize_e4m3(
            bf16_values(np.random.default_rng(21), len(CACHED), D, scale=8.0), KV_SCALE)
        with Driver(command) as driver:
            driver.hello(MODEL)
            driver.layer("L003", 3, KV_SCALE, self.pool)
            bits = kvdump.bf16_bits_from_float32
            first = driver.step(0, "S000", "prefill", "L003", 3, KV_SCALE, step0["indices"],
                                bits(step0["q_nope"]), bits(step0["q_pe"]), bits(step0["new_kv"]))
            reloaded = first.pool.copy()
            reloaded[CACHED] = replaced[CACHED]
            path = os.path.join(driver.session, driver.pool_files["L003"]["file"])
            reloaded.tofile(path + ".new")
            os.replace(path + ".new", path)  # a new inode: a stale mapping would not see it
            second = driver.step(1, "S001", "decode", "L003", 3, KV_SCALE, step1["indices"],
                                 bits(step1["q_nope"]), bits(step1["q_pe"]), bits(step1["new_kv"]),
                                 pool_reloaded=True)
        self.assertEqual(second.reply["type"], "result", second.reply)
        expected = reference(replaced, self.steps)[1]
        np.testing.assert_array_equal(second.pool, expected[0])
        self.assertTrue(out_close(kvdump.float32_from_bf16_bits(second.out_bits), expected[1]))

    def test_bfloat16_pool_stores_new_kv_bits(self):
        rng = np.random.default_rng(9)
        values = bf16_values(rng, SLOTS, D, scale=3.0)
        pool = kvdump.bf16_bits_from_float32(values)
        model = dict(MODEL, kv_dtype="bfloat16")
        served, _ = serve(pool, self.steps, model=model, pool_dtype="bfloat16", kv_scale=1.0)
        expected = pool.copy()
        for step, (after, out, lse) in zip(self.steps, served):
            expected[step["indices"]["new_kv_slots"]] = kvdump.bf16_bits_from_float32(
                step["new_kv"])
            np.testing.assert_array_equal(after, expected)
            values = kvdump.float32_from_bf16_bits(expected).astype(np.float64)
            ref = reference_from_values(values, step)
            self.assertTrue(out_close(out, ref[0]))
            self.assertTrue(lse_close(lse, ref[1]))


GROUPED_FORMS = [("float32", "float8_e4m3fn", KV_SCALE), ("power_of_two", "bfloat16", 1.0),
                 ("e8m0", "float8_e4m3fn", KV_SCALE)]


def grouped_model(scale_format, rope):
    return dict(MODEL, kv_scale_kind="per_token_group", kv_scale_group_size=8,
                kv_scale_format=scale_format, kv_rope_dtype=rope)


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class GroupedTorchTests(unittest.TestCase):
    """Protocol version 2: per_token_group pools (Dc 16 in groups of 8) in every scale format and
    RoPE type, written by the v1.1 rule and read with each slot's own scales."""

    def serve(self, model, pool, steps, kv_scale, *options):
        command = [sys.executable, "-m", "kvdump.backends", "torch", "--device", "cpu", *options]
        with Driver(command) as driver:
            hello = driver.hello(model, version=2)
            self.assertEqual(hello["type"], "hello", hello)
            self.assertEqual(hello["version"], 2)
            self.assertEqual(driver.layer("L003", 3, kv_scale, pool), {"type": "ok"})
            results = []
            for index, step in enumerate(steps):
                bits = kvdump.bf16_bits_from_float32
                output = driver.step(index, f"S{index:03d}", step["kind"], "L003", 3, kv_scale,
                                     step["indices"], bits(step["q_nope"]), bits(step["q_pe"]),
                                     bits(step["new_kv"]))
                self.assertEqual(output.reply["type"], "result", (output.reply, driver.stderr()))
                results.append((output.pool, kvdump.float32_from_bf16_bits(output.out_bits),
                                output.lse))
            self.assertEqual(driver.bye(), {"type": "bye"})
        return hello, results

    def test_every_form_matches_float64(self):
        from kvdump.backends import grouped, protocol

        for scale_format, rope, kv_scale in GROUPED_FORMS:
            with self.subTest(scale_format=scale_format, rope=rope):
                model = grouped_model(scale_format, rope)
                info = protocol.parse_model({"version": 2, "model": model})
                rng = np.random.default_rng(31)
                pool = np.where(rng.random((SLOTS, info.slot_bytes)) < 0.5, 0x7F,
                                0xFF).astype(np.uint8)
                pool[CACHED] = grouped.encode_rows(bf16_values(rng, len(CACHED), D, scale=8.0),
                                                   info, kv_scale)
                _, steps = make_case(seed=31)
                hello, served = self.serve(model, pool, steps, kv_scale, "--write", "server")
                self.assertIn("v1.1", hello["describe"]["write_rule"])
                self.assertEqual(hello["describe"]["pool"]["slot_bytes"], info.slot_bytes)
                expected = pool.copy()
                for step, (after, out, lse) in zip(steps, served):
                    expected[step["indices"]["new_kv_slots"]] = grouped.encode_rows(
                        step["new_kv"], info, kv_scale)
                    np.testing.assert_array_equal(after, expected)
                    with np.errstate(invalid="ignore", over="ignore"):
                        values = grouped.dequantize(expected, info, kv_scale)
                    ref_out, ref_lse = reference_from_values(values, step)
                    self.assertTrue(out_close(out, ref_out), np.abs(out - ref_out).max())
                    self.assertTrue(lse_close(lse, ref_lse), np.abs(lse - ref_lse).max())

    def test_a_version_1_hello_with_a_grouped_model_is_refused(self):
        command = [sys.executable, "-m", "kvdump.backends", "torch", "--device", "cpu"]
        with Driver(command) as driver:
            reply = driver.hello(grouped_model("float32", "float8_e4m3fn"), version=1)
            self.assertEqual(driver.wait(), 2)
        self.assertEqual(reply["kind"], "unsupported")
        self.assertIn("needs protocol version 2", reply["message"])


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class BenchDataTests(unittest.TestCase):
    """The data a bench case times (timing itself needs a GPU): shapes, distinct pages per case,
    no NaN codes, and the torch adapter's attention over it is finite."""

    def case(self, **changes):
        from kvdump.backends import protocol

        fields = dict(name="t", kind="prefill", batch=3, context=70, num_heads=2, page_size=16,
                      pool_slots=1024, kv_dtype="float8_e4m3fn", q_len=5, warmup=0,
                      iterations=1, flush_l2=False)
        fields.update(changes)
        return protocol.BenchCase(**fields)

    def test_case_data(self):
        from kvdump.backends.bench import case_data

        data = case_data(torch, self.case(), torch.device("cpu"))
        self.assertEqual(tuple(data.pool.shape), (1024, 576))
        self.assertFalse(torch.any((data.pool & 0x7F) == 0x7F))
        self.assertEqual(tuple(data.q_nope.shape), (15, 2, 512))
        self.assertEqual(data.qo_indptr.tolist(), [0, 5, 10, 15])
        self.assertEqual(data.kv_indptr.tolist(), [0, 5, 10, 15])  # ceil(70 / 16) pages each
        self.assertEqual(len(set(data.kv_indices.tolist())), 15)
        self.assertEqual(data.kv_last_page_len.tolist(), [6, 6, 6])
        self.assertEqual([r.kv_len for r in data.requests], [70, 70, 70])
        small = case_data(torch, self.case(pool_slots=0), torch.device("cpu"))
        self.assertEqual(small.pool.shape[0], 3 * 5 * 16)  # just the pages needed

    def test_attention_over_case_data_is_finite(self):
        from kvdump.backends import protocol
        from kvdump.backends.bench import case_data
        from kvdump.backends.torch_mla import TorchAdapter

        adapter = TorchAdapter(argparse_options())
        model = protocol.ModelInfo(**dict(protocol.BENCH_MODEL, num_heads=2))
        adapter.start(model, None)
        data = case_data(torch, self.case(), adapter.device)
        prepared = [adapter.prepare_request(r) for r in data.requests]
        out, lse = adapter.attention(data.q_nope, data.q_pe, data.pool, prepared, data.kv_scale)
        self.assertEqual(tuple(out.shape), (15, 2, 512))
        self.assertTrue(torch.all(torch.isfinite(out.float())) and torch.all(torch.isfinite(lse)))

    def test_cpu_bench_is_unsupported(self):
        from kvdump.backends import protocol
        from kvdump.backends.torch_mla import TorchAdapter

        adapter = TorchAdapter(argparse_options())
        adapter.start(protocol.ModelInfo(**protocol.BENCH_MODEL), None)
        with self.assertRaises(protocol.BackendError) as caught:
            adapter.bench(self.case())
        self.assertEqual(caught.exception.kind, "unsupported")


def argparse_options():
    import argparse

    return argparse.Namespace(device="cpu", write="server", fault=[])


def reference_from_values(values, step):
    rows = visible_slots(step["indices"])
    out, lse = np.zeros((len(rows), H, DC)), np.zeros((len(rows), H))
    for i, seen in enumerate(rows):
        c, r = values[seen, :DC], values[seen, DC:]
        s = SM_SCALE * (step["q_nope"][i] @ c.T + step["q_pe"][i] @ r.T)
        lse[i] = np.log(np.exp(s).sum(axis=1))
        out[i] = np.exp(s - lse[i][:, None]) @ c
    return out, lse


def rule_inputs():
    """float32 values exact in bf16 that exercise the write rules, with the scales to use."""
    rng = np.random.default_rng(11)
    table = kvdump.decode_e4m3(np.arange(0x7F, dtype=np.uint8))
    midpoints = (table[:-1] + table[1:]) / 2
    edges = np.array([448, 456, 464, 472, 480, 496, 512, 1e4, np.inf, np.nan, 2.0**-9, 2.0**-10,
                      3 * 2.0**-10, 0.0], np.float32)
    values = np.concatenate([table, midpoints, edges, rng.standard_normal(20000) * 40,
                             rng.standard_normal(2000) * 300]).astype(np.float32)
    values = np.concatenate([values, -values])
    values = kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(values))
    return values, [1.0, 0.37, 0.11495536, 0.0943, 3.0]


def division_differs_from_reciprocal(scale):
    """float32 values x (a dump's float32 new_kv) where x / s and x * fp32(1 / s) round to
    different e4m3 codes: neighbours of s times the e4m3 midpoints."""
    s = np.float32(scale)
    table = kvdump.decode_e4m3(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    ties = (((table[:-1] + table[1:]) / 2) * float(s)).astype(np.float32)
    x = np.concatenate([ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.inf)])
    with np.errstate(over="ignore"):
        divided, multiplied = x / s, x * (np.float32(1) / s)
    differ = kvdump.encode_e4m3(divided) != kvdump.encode_e4m3(multiplied)
    return x[differ]


@unittest.skipIf(TORCH_MISSING, TORCH_MISSING)
class WriteRuleTests(unittest.TestCase):
    def codes(self, values, scale, rule, float32=False, **options):
        """The rule's codes of values given as a bf16 tensor (float32=True: a float32 one)."""
        from kvdump.backends import writes

        tensor = torch.from_numpy(values.copy()) if float32 else torch.from_numpy(
            kvdump.bf16_bits_from_float32(values).view(np.int16)).view(torch.bfloat16)
        return writes.fp8_codes(tensor, scale, rule, **options).numpy()

    def test_kvdump_rule_is_the_codec(self):
        values, scales = rule_inputs()
        for scale in scales:
            with self.subTest(scale=scale):
                np.testing.assert_array_equal(self.codes(values, scale, "kvdump"),
                                              kvdump.quantize_e4m3(values, scale))

    def test_kvdump_rule_divides(self):
        for scale in (0.37, 0.0943, 3.0):
            x = division_differs_from_reciprocal(scale)
            self.assertGreater(x.size, 0)
            with self.subTest(scale=scale):
                np.testing.assert_array_equal(self.codes(x, scale, "kvdump", float32=True),
                                              kvdump.quantize_e4m3(x, scale))
                s = np.float32(scale)
                np.testing.assert_array_equal(
                    self.codes(x, scale, "kvdump", float32=True, reciprocal=True),
                    kvdump.encode_e4m3(x * (np.float32(1) / s)))

    def bf16_quotient(self, values, scale):
        """bf16(fp32(x) / fp32(s)): PyTorch's bf16 tensor / Python float on the CPU."""
        with np.errstate(over="ignore", invalid="ignore"):
            q = values / np.float32(scale)
        return kvdump.float32_from_bf16_bits(kvdump.bf16_bits_from_float32(q))

    def test_server_rule_is_the_cast_of_the_bf16_quotient(self):
        from kvdump.backends.environment import cast_probe

        past_464 = cast_probe(torch, torch.device("cpu"))["past_464"]
        values, scales = rule_inputs()
        for scale in scales:
            with self.subTest(scale=scale):
                codes = self.codes(values, scale, "server")
                q = self.bf16_quotient(values, scale)
                inside = np.abs(q) <= 464
                np.testing.assert_array_equal(codes[inside], kvdump.encode_e4m3(q[inside]))
                beyond = codes[np.isfinite(q) & ~inside] & 0x7F
                expected = 0x7E if past_464 == "saturates to 448" else 0x7F
                self.assertTrue(np.all(beyond == expected), (past_464, np.unique(beyond)))
                self.assertTrue(np.all(codes[np.isnan(q)] & 0x7F == 0x7F))

    def test_server_rule_double_rounds_through_bf16(self):
        rng = np.random.default_rng(3)
        values = bf16_values(rng, 50000, scale=20.0)
        server = self.codes(values, 0.11495536, "server")
        exact = kvdump.quantize_e4m3(values, 0.11495536)
        differ = server != exact
        self.assertGreater(differ.sum(), 0)  # about 2% of codes here
        steps = np.abs(server[differ].astype(int) - exact[differ].astype(int))
        self.assertTrue(np.all(steps == 1))  # always the neighbouring code
        # With kv_scale 1 (SGLang's MLA pool) nothing is divided and nothing double-rounds.
        np.testing.assert_array_equal(self.codes(values, 1.0, "server"),
                                      kvdump.quantize_e4m3(values, 1.0))

    def test_saturate_rule_clamps_before_the_cast(self):
        values, scales = rule_inputs()
        for scale in scales:
            with self.subTest(scale=scale):
                codes = self.codes(values, scale, "saturate")
                q = self.bf16_quotient(values, scale)
                number = ~np.isnan(q)
                np.testing.assert_array_equal(codes[number], kvdump.encode_e4m3(q[number]))
                self.assertTrue(np.all(codes[~number] & 0x7F == 0x7F))

    def test_round_toward_zero_fault(self):
        values, scales = rule_inputs()
        for scale in scales:
            with self.subTest(scale=scale):
                with np.errstate(over="ignore", invalid="ignore"):
                    q = values / np.float32(scale)
                np.testing.assert_array_equal(
                    self.codes(values, scale, "kvdump", round_toward_zero=True),
                    truncated_codes(q))


if __name__ == "__main__":
    unittest.main()
