"""kvaudit's idea of GLM-5 / DeepSeek-V3.2 attention judged against the models' own code
(kvdump.hf_capture): the exact reference on the captured source rows, mapped through the module's
W_UV, must reproduce the module's attention output within the bound float32 storage allows.

The bound (per element, derived in agreement_bound below): the dump stores q and the kv rows as
float32, each rounded once at u = 2^-24 relative; kvaudit computes exactly on those, the module
in float64 on the unrounded values. Scores move by at most sigma = sm_scale * sum_j |q_j k_j| * 2u
(+u^2), every softmax weight by a factor within exp(+-2 sigma), the latent values by u, so the
latent output moves by at most ((e^(2 sigma) - 1)(1 + u) + u) * max_t |c_t|, and W_UV's row v
maps that to at most sum_j |W_UV[v, j]| times as much; 1e-12 of the output's size more covers
float64 arithmetic on both sides. A wrong softmax scale (GLM-5's 1/16 stated as 1/sqrt(192)), a
dropped YaRN mscale^2 or a query absorbed with the wrong matrix moves the output by orders of
magnitude more.

Needs torch and transformers (the package's [hf] extra) and a kvaudit binary ($KVAUDIT_BINARY,
else build/kvaudit); skipped without them unless KVAUDIT_REQUIRE_HF=1, where they must be there.
"""

import json
import math
import os
import shutil
import subprocess
import tempfile
import unittest
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
U = 2.0 ** -24


def _missing():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        return f"needs torch and transformers: {error}"
    if not os.path.exists(_kvaudit()):
        return f"needs a kvaudit binary ({_kvaudit()}; set KVAUDIT_BINARY)"
    return None


def _kvaudit():
    return os.environ.get("KVAUDIT_BINARY") or os.path.join(ROOT, "build", "kvaudit")


def reference_source_outputs(dump, work):
    """kvaudit's Rs (exact attention on kv_source / new_kv) per (step, layer): kvaudit check
    --backend none --save-outputs."""
    import h5py

    outputs = os.path.join(work, os.path.basename(dump) + ".outputs.h5")
    run = subprocess.run([_kvaudit(), "check", dump, "--backend", "none", "--certify", "0",
                          "--save-outputs", outputs], capture_output=True, text=True)
    if run.returncode not in (0, 1):
        raise AssertionError(f"kvaudit check exited {run.returncode}: {run.stderr}")
    result = {}
    with h5py.File(outputs, "r") as f:
        for step in f["steps"]:
            for layer in f["steps"][step]:
                group = f["steps"][step][layer]
                result[(step, layer)] = group["reference_source_out"][...]
    return result


def agreement_bound(dump, step, layer, w_uv):
    """Per element of W_UV @ out [Nq, H, Dv]: the bound of the module docstring, from the
    dump's own float32 q and rows (the source rows a row sees: kv_source then new_kv)."""
    import h5py

    with h5py.File(dump, "r") as f:
        sm_scale = float(f.attrs["sm_scale"])
        source = f[f"layers/{layer}/kv_source"][:, 0, :].astype(np.float64)
        steps = sorted(f["steps"])
        rows = source.copy()
        for name in steps[:steps.index(step) + 1]:
            slots = f[f"steps/{name}/new_kv_slots"][...]
            rows[slots] = f[f"steps/{name}/{layer}/new_kv"][...]
        group = f[f"steps/{step}/{layer}"]
        q = np.concatenate([group["q_nope"][...], group["q_pe"][...]], axis=-1).astype(np.float64)
        end = int(f[f"steps/{step}/kv_indptr"][-1])
    rows = rows[:end]
    sigma = sm_scale * np.einsum("ihd,td->iht", np.abs(q), np.abs(rows)).max(axis=-1) * (2 * U + U * U)
    dc = w_uv.shape[-1]
    latent_error = ((np.expm1(2 * sigma) * (1 + U) + U) * np.abs(rows[:, :dc]).max())  # [Nq, H]
    return latent_error[:, :, None] * np.abs(w_uv).sum(axis=-1)[None, :, :]


def worst_ratio(dump, work):
    """max over every element of |W_UV Rs - module| / bound, over every step and layer."""
    import h5py

    reference = reference_source_outputs(dump, work)
    worst = 0.0
    with h5py.File(dump + ".module.h5", "r") as side:
        for (step, layer), out in reference.items():
            w_uv = side[f"layers/{layer}/w_uv"][...]
            module = side[f"steps/{step}/{layer}/attn_output"][...]
            mapped = np.einsum("ihc,hvc->ihv", out, w_uv)
            bound = agreement_bound(dump, step, layer, w_uv) + 1e-12 * np.abs(module).max()
            worst = max(worst, float((np.abs(mapped - module) / bound).max()))
    return worst


def set_sm_scale(dump, value, work, name):
    import h5py

    copy = os.path.join(work, name)
    shutil.copyfile(dump, copy)
    shutil.copyfile(dump + ".module.h5", copy + ".module.h5")
    with h5py.File(copy, "r+") as f:
        f.attrs["sm_scale"] = np.float64(value)
    return copy


@unittest.skipIf(_missing() is not None and os.environ.get("KVAUDIT_REQUIRE_HF") != "1",
                 _missing() or "")
class HfCaptureAgreement(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from kvdump import hf_capture

        missing = _missing()
        if missing:
            raise AssertionError(missing)
        cls.work = tempfile.mkdtemp(prefix="hf_capture_")
        cls.hf = hf_capture
        cls.glm5 = os.path.join(cls.work, "glm5.h5")
        # index_topk 8 < the 24-token prefix: every row of every step is really sparse.
        hf_capture.capture(cls.glm5, model="glm5", size="tiny", layers=[0, 2], prefix_tokens=24,
                           extend_tokens=6, decode_steps=2, seed=3, index_topk=8,
                           q_dtype="float32")
        cls.v32 = os.path.join(cls.work, "v32.h5")
        hf_capture.capture(cls.v32, model="deepseek-v32", size="tiny", layers=[1],
                           prefix_tokens=20, extend_tokens=4, decode_steps=2, seed=4,
                           index_topk=8, q_dtype="float32")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.work, ignore_errors=True)

    def test_glm5_capture_is_sparse_and_carries_the_modules_scale(self):
        import h5py

        with h5py.File(self.glm5, "r") as f:
            # The tiny config: qk_nope 48 + qk_rope 16 = 64, no mscale_all_dim: 64^-0.5.
            self.assertEqual(float(f.attrs["sm_scale"]), 0.125)
            self.assertEqual(f.attrs["rope_type"], "default")
            self.assertNotIn("rope_mscale_all_dim", f.attrs)
            topk = f["steps/S000/L000/topk_indices"][...]
            self.assertEqual(topk.shape, (6, 8))
            self.assertTrue(((topk >= 0).sum(axis=1) == 8).all())  # 8 of 25..30 visible

    def test_glm5_reference_reproduces_the_module(self):
        self.assertLessEqual(worst_ratio(self.glm5, self.work), 1.0)

    def test_glm5_deepseek_v3_scale_is_caught(self):
        # What kvaudit used to state for GLM-5: qk_head_dim 192 (128 + 64) instead of 256, i.e.
        # the scale too large by sqrt(256 / 192).
        wrong = set_sm_scale(self.glm5, 0.125 * math.sqrt(256 / 192), self.work, "glm5_scale.h5")
        self.assertGreater(worst_ratio(wrong, self.work), 100.0)

    def test_glm5_wrongly_absorbed_query_is_caught(self):
        # q_nope absorbed with the next head's W_UK instead of its own.
        def wrong(q_pass, w_uk):
            return np.einsum("shn,hnc->shc", q_pass, np.roll(w_uk, 1, axis=0))

        dump = os.path.join(self.work, "glm5_absorb.h5")
        with mock.patch.object(self.hf, "absorb_query", wrong):
            self.hf.capture(dump, model="glm5", size="tiny", layers=[0], prefix_tokens=24,
                            extend_tokens=6, decode_steps=2, seed=3, index_topk=8,
                            q_dtype="float32")
        self.assertGreater(worst_ratio(dump, self.work), 100.0)

    def test_fp8_cost_at_the_layer_output(self):
        # kvdump.hf_compare: W_UV Rs (and o_proj of it) equals the module's outputs to float32
        # precision; W_UV R8 differs by what e4m3 storage costs: above 2^-8 (the pool really is
        # quantized: each stored value moves by up to 2^-4 relative) and below 2^-3 (not garbage).
        from kvdump import hf_compare

        outputs = os.path.join(self.work, "glm5_outputs.h5")
        subprocess.run([_kvaudit(), "check", self.glm5, "--backend", "none", "--certify", "0",
                        "--save-outputs", outputs], check=True, capture_output=True)
        rows = hf_compare.compare(self.glm5, outputs)
        kinds = {what for _, _, what, _ in rows}
        self.assertEqual(kinds, {"source after W_UV", "source after o_proj", "fp8 after W_UV",
                                 "fp8 after o_proj"})
        for step, layer, what, errors in rows:
            with self.subTest(step=step, layer=layer, what=what):
                if what.startswith("source"):
                    self.assertLess(errors["rel_l2"], 2.0**-20)
                else:
                    self.assertGreater(errors["rel_l2"], 2.0**-8)
                    self.assertLess(errors["rel_l2"], 2.0**-3)

    def test_requantize_amax_reproduces_the_captures_pool(self):
        # kvdump.requantize --kv-scale amax is hf_capture's own rule: the same scale and bytes.
        import h5py

        from kvdump import requantize

        again = os.path.join(self.work, "glm5_amax.h5")
        requantize.requantize(self.glm5, again, "amax")
        with h5py.File(self.glm5, "r") as f, h5py.File(again, "r") as g:
            for layer in ("L000", "L002"):
                self.assertEqual(g[f"layers/{layer}"].attrs["kv_scale"],
                                 f[f"layers/{layer}"].attrs["kv_scale"])
                np.testing.assert_array_equal(g[f"layers/{layer}/kv_cache"][...],
                                              f[f"layers/{layer}/kv_cache"][...])

    def test_fp8_cost_at_scale_one_against_amax(self):
        # The same capture's pool at 1.0 (a server without a checkpoint scale) and at amax/448.
        # Default outlier gain 16: amax (by hand below) stays under 464, so nothing saturates at
        # 1.0 and every stored value keeps e4m3's 2^-4 relative rounding at either scale (the
        # smaller scale moves values by a constant factor, subnormals below 2^-6 aside): the cost
        # after o_proj is the same size, within a factor 2 either way. Outlier gain 512: the
        # outlier channels, which carry most of the latent's norm, reach ~2300 > 464 and are
        # stored as 448 at 1.0, losing most of their value: the cost after o_proj is over 2^-2
        # and over 4 times amax/448's.
        import h5py

        from kvdump import hf_compare, requantize

        gained = os.path.join(self.work, "glm5_gain512.h5")
        self.hf.capture(gained, model="glm5", size="tiny", layers=[0], prefix_tokens=24,
                        extend_tokens=6, decode_steps=2, seed=3, index_topk=8,
                        q_dtype="float32", outlier_gain=512.0)
        worst = {}
        for name, dump in (("gain16", self.glm5), ("gain512", gained)):
            with h5py.File(dump, "r") as f:
                rows = [f["layers/L000/kv_source"][...]] + [
                    f[f"steps/{step}/L000/new_kv"][...] for step in f["steps"]]
                amax = max(float(np.abs(r).max()) for r in rows)
            self.assertEqual(amax > 464.0, name == "gain512", f"{name}: amax {amax}")
            served = dump.replace(".h5", "_scale1.h5")
            requantize.requantize(dump, served, "1.0")
            runs = []
            for path in (dump, served):
                outputs = path + ".outputs.h5"
                subprocess.run([_kvaudit(), "check", path, "--backend", "none", "--certify", "0",
                                "--save-outputs", outputs], check=True, capture_output=True)
                runs.append((path, outputs))
            for row in hf_compare.worst_by_scale(hf_compare.compare_runs(runs)):
                worst[(name, row["comparison"], row["kv_scale"])] = row["rel_l2"]
            if name == "gain16":
                report = os.path.join(self.work, "compare.json")
                with mock.patch("sys.stdout"):
                    hf_compare.main([dump, runs[0][1], "--also", *runs[1], "--json", report])
                with open(report, encoding="utf-8") as f:
                    document = json.load(f)
                self.assertEqual(document["runs"][1]["kv_scale"], {"L000": 1.0, "L002": 1.0})
                scales = {row["kv_scale"] for row in document["rows"]
                          if row["comparison"] == "fp8 after o_proj"}
                self.assertEqual(len(scales), 3)  # L000's and L002's amax/448, and 1.0
                # The first dump's outputs given for the re-quantized one: refused, not labelled
                # with 1.0 (they would print the amax/448 errors as the cost at 1.0).
                with mock.patch("sys.stdout"), mock.patch("sys.stderr") as stderr:
                    status = hf_compare.main([dump, runs[0][1], "--also", runs[1][0], runs[0][1]])
                self.assertEqual(status, 2)
                said = "".join(call.args[0] for call in stderr.write.call_args_list)
                self.assertIn("not for " + runs[1][0], said)
        gain16 = {k[2]: v for k, v in worst.items() if k[:2] == ("gain16", "fp8 after o_proj")}
        gain512 = {k[2]: v for k, v in worst.items() if k[:2] == ("gain512", "fp8 after o_proj")}
        at_one = gain16.pop(1.0)
        at_amax = max(gain16.values())
        self.assertTrue(2.0**-8 < at_amax < 2.0**-3 and 2.0**-8 < at_one < 2.0**-3, worst)
        self.assertTrue(0.5 < at_one / at_amax < 2.0, worst)
        at_one = gain512.pop(1.0)
        (at_amax,) = gain512.values()
        self.assertGreater(at_one, 2.0**-2, worst)
        self.assertGreater(at_one, 4.0 * at_amax, worst)

    def test_layer_weights_from_safetensors(self):
        # A checkpoint's layer given as safetensors files is what the module runs with.
        import h5py
        from safetensors.numpy import save_file

        config = self.hf.model_config("glm5", "tiny", 4)
        seeded = self.hf.build_attention("glm5", config, 3, seed=99)
        weights = {f"model.layers.3.self_attn.{name}": value.detach().numpy().astype(np.float32)
                   for name, value in seeded.state_dict().items()}
        weights["model.layers.2.mlp.down_proj.weight"] = np.zeros((2, 2), dtype=np.float32)
        path = os.path.join(self.work, "layer3.safetensors")
        save_file(weights, path)
        dump = os.path.join(self.work, "from_weights.h5")
        self.hf.capture(dump, layers=[3], prefix_tokens=10, extend_tokens=2, decode_steps=1,
                        weights=[path])
        kv_b = weights["model.layers.3.self_attn.kv_b_proj.weight"].astype(np.float64)
        with h5py.File(dump + ".module.h5", "r") as side:
            np.testing.assert_array_equal(side["layers/L003/w_uv"][...],
                                          kv_b.reshape(4, 48 + 32, 64)[:, 48:, :])
        weights["model.layers.3.self_attn.kv_b_proj.weight_scale_inv"] = np.ones(1, np.float32)
        save_file(weights, path)
        with self.assertRaisesRegex(self.hf.CaptureError, "weight_scale_inv"):
            self.hf.capture(dump, layers=[3], prefix_tokens=10, extend_tokens=2,
                            decode_steps=1, weights=[path])

    def test_deepseek_v32_yarn_mscale(self):
        import h5py

        self.assertLessEqual(worst_ratio(self.v32, self.work), 1.0)
        with h5py.File(self.v32, "r") as f:
            sm_scale = float(f.attrs["sm_scale"])
            self.assertEqual(float(f.attrs["rope_mscale_all_dim"]), 1.0)
            self.assertEqual(float(f.attrs["rope_factor"]), 40.0)
        # (48 + 16)^-0.5 * (0.1 ln 40 + 1)^2, by hand: 0.125 * 1.873854...
        mscale = 0.1 * math.log(40.0) + 1.0
        self.assertAlmostEqual(sm_scale, 0.125 * mscale * mscale, places=15)
        dropped = set_sm_scale(self.v32, sm_scale / (mscale * mscale), self.work, "v32_drop.h5")
        self.assertGreater(worst_ratio(dropped, self.work), 100.0)


if __name__ == "__main__":
    unittest.main()
