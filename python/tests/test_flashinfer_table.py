"""scripts/flashinfer_table.py (the H200 table runner) on fake kvaudit reports.

summarize() on hand-written report.json objects: the worst kernel rel_l2 / lse of the kernel
comparison only, failing comparisons counted per kind, failing integrity findings grouped by check
and class with their slot counts, diagnosis findings as one line each, the adapter's
describe found where it is nested. The Markdown shows versions, one row per run (an error run with
its last line) and the commands. A whole run of main() against a fake kvaudit (a Python script that
writes a report for the backend it is given and exits 0, 1 or 2) writes the .md and .json, and
the exec backends' commands start `python -m kvdump.backends` with this checkout's python/ on
PYTHONPATH. With h5py, dump_demands counts the new KV values past 448 and 464 times kv_scale in a
dump written here.

Run: python3 -m unittest discover -s python/tests
"""

import contextlib
import importlib.util
import io
import json
import os
import shlex
import shutil
import sys
import tempfile
import unittest
from unittest import mock

import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(TESTS_DIR, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

spec = importlib.util.spec_from_file_location(
    "flashinfer_table", os.path.join(REPO, "scripts", "flashinfer_table.py"))
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

try:
    import h5py  # noqa: F401
    H5PY_MISSING = None
except ImportError:
    H5PY_MISSING = "h5py is not importable; dump_demands needs it"

DESCRIBE = {"adapter": "flashinfer-fp8", "flashinfer": "0.6.18", "torch": "2.11.0",
            "torch_cuda": "12.8", "device": "NVIDIA H200", "compute_capability": "9.0",
            "driver": "570.86.15", "torch_fp8_cast": {"past_464": "gives the NaN code"}}


def result(comparison, step, layer, rel_l2, lse, passed=True, reasons=()):
    return {"comparison": comparison, "step": step, "layer": layer, "pass": passed,
            "reasons": list(reasons), "metrics": {"rel_l2": rel_l2, "lse_max_abs": lse}}


def finding(check, classification, slots, passed=False):
    return {"check": check, "classification": classification, "slot_count": slots,
            "pass": passed, "step": 0, "layer": 0}


FAILING_REPORT = {
    "verdict": "fail", "backend": "exec:flashinfer-fp8-fa3",
    "backend_description": {"name": "exec:flashinfer-fp8-fa3", "describe": DESCRIBE},
    "results": [result("kernel", 0, 0, 0.002, 1e-5), result("kernel", 1, 0, 0.0031, 2e-5),
                result("total", 0, 0, 0.5, 0.3, passed=False, reasons=["rel_l2 0.5 > 0.0667"]),
                result("cache", 1, 0, 0.25, 0.1, passed=False),
                result("cache", 2, 0, 0.26, 0.1, passed=False)],
    "integrity": [finding("written_slots", "off_by_one_code", 8),
                  finding("written_slots", "off_by_one_code", 3),
                  finding("nan_written", "nan_code", 2),
                  finding("read_consistency", "", 11),
                  finding("storage", "", 0, passed=True)],
    # The shape of report.json's diagnosis (docs/report-schema.md), shortened to what is read.
    "diagnosis": [{"step": 0, "layer": 0, "comparison": "kernel",
                   "summary": "explained by scale-bf16 (kv_scale 0.0029 read as 0.00290)"},
                  {"step": 1, "layer": 0, "comparison": "kernel",
                   "summary": "no hypothesis in the catalogue explains this failure (14 tried)"}],
    "timing": {"total_seconds": 3.5},
}

PASSING_REPORT = {
    "verdict": "pass", "backend": "cuda-fp8",
    "backend_description": {"name": "cuda-fp8", "device": "NVIDIA H200"},
    "results": [result("kernel", 0, 0, 0.0011, 3e-6)], "integrity": [finding("storage", "", 0,
                                                                             passed=True)],
}


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f) if path.endswith((".json", ".args")) else f.read()


class SummarizeTests(unittest.TestCase):
    def test_failing_report(self):
        row = table.summarize(FAILING_REPORT, 1, 3.54)
        self.assertEqual(row["verdict"], "fail")
        self.assertEqual(row["kernel_rel_l2"], 0.0031)  # kernel only: total's 0.5 is not taken
        self.assertEqual(row["kernel_lse_max_abs"], 2e-5)
        self.assertEqual(row["total_rel_l2"], 0.5)
        self.assertEqual(row["failing"], {"cache": 2, "total": 1})
        self.assertEqual(row["integrity"], {
            "nan_written [nan_code]": {"findings": 1, "slots": 2},
            "read_consistency": {"findings": 1, "slots": 11},
            "written_slots [off_by_one_code]": {"findings": 2, "slots": 11}})
        self.assertEqual(row["diagnosis"], [
            "step 0 layer 0 kernel: explained by scale-bf16 (kv_scale 0.0029 read as 0.00290)",
            "step 1 layer 0 kernel: no hypothesis in the catalogue explains this failure "
            "(14 tried)"])
        self.assertEqual(row["describe"]["flashinfer"], "0.6.18")
        self.assertEqual(row["seconds"], 3.5)

    def test_passing_report_without_diagnosis(self):
        row = table.summarize(PASSING_REPORT, 0, 1.0)
        self.assertEqual((row["verdict"], row["failing"], row["integrity"], row["diagnosis"]),
                         ("pass", {}, {}, []))
        self.assertEqual(row["describe"], PASSING_REPORT["backend_description"])

    def test_run_without_report(self):
        row = table.summarize(None, 2, 0.3, "kvaudit: exec:x: flashinfer is not installed")
        self.assertEqual(row["verdict"], "error")
        self.assertIn("flashinfer is not installed", row["error"])


class RenderTests(unittest.TestCase):
    def setUp(self):
        runs = []
        for backend, report, status in (("flashinfer-fp8-fa3", FAILING_REPORT, 1),
                                        ("cuda-fp8", PASSING_REPORT, 0)):
            row = table.summarize(report, status, 1.0)
            row.update(backend=backend, dump="glm5_page1.h5", command=f"kvaudit check {backend}")
            runs.append(row)
        error = table.summarize(None, 2, 0.1, "kvaudit: exec:torch-cuda: no CUDA | device")
        error.update(backend="torch-cuda", dump="glm5_page1.h5", command="kvaudit check t")
        runs.append(error)
        self.table = {"command": "scripts/flashinfer_table.py", "date": "2026-12-01",
                      "write": "server", "kvaudit_version": "kvaudit 0.1.0", "runs": runs,
                      "dumps": {"glm5_page1.h5": {"layers": 3, "steps": 4, "written": 23040,
                                                  "past_448": 0, "past_464": 0}}}
        self.markdown = table.render_markdown(self.table)

    def row(self, backend):
        lines = [l for l in self.markdown.splitlines() if l.startswith(f"| {backend} |")]
        self.assertEqual(len(lines), 1, self.markdown)
        return lines[0]

    def test_versions(self):
        for text in ("| flashinfer | 0.6.18 |", "| device | NVIDIA H200 |",
                     "| driver | 570.86.15 |",
                     "| PyTorch bf16 -> e4m3fn cast past 464 | gives the NaN code |"):
            self.assertIn(text, self.markdown)

    def test_rows(self):
        fa3 = self.row("flashinfer-fp8-fa3")
        for text in ("| fail |", "| 0.0031 |", "cache ×2, total ×1",
                     "written_slots [off_by_one_code]: 2 findings, 11 slots",
                     "nan_written [nan_code]: 1 findings, 2 slots",
                     "step 0 layer 0 kernel: explained by scale-bf16"):
            self.assertIn(text, fa3)
        self.assertIn("| pass | 0.0011 |", self.row("cuda-fp8"))
        self.assertIn("| clean |", self.row("cuda-fp8"))
        error = self.row("torch-cuda")
        self.assertIn("error (exit 2)", error)
        self.assertIn("no CUDA \\| device", error)  # a | inside a cell is escaped

    def test_every_table_row_has_the_header_s_columns(self):
        for line in self.markdown.splitlines():
            if line.startswith("| backend |"):
                columns = line.count("|")
        for backend in ("flashinfer-fp8-fa3", "cuda-fp8", "torch-cuda"):
            self.assertEqual(self.row(backend).replace("\\|", "").count("|"), columns)

    def test_render_only_round_trip(self):
        path = os.path.join(tempfile.mkdtemp(), "t.json")
        self.addCleanup(shutil.rmtree, os.path.dirname(path))
        with open(path, "w") as f:
            json.dump(self.table, f)
        self.assertEqual(table.render_markdown(load(path)), self.markdown)


FAKE_KVAUDIT = """#!{python}
import json, sys
args = sys.argv[1:]
if args[0] == "--version":
    print("kvaudit 9.9.9")
    sys.exit(0)
backend = args[args.index("--backend") + 1]
out = args[args.index("--json") + 1]
with open(out + ".args", "w") as f:
    json.dump(args, f)
if backend == "exec:torch-cuda":
    print("kvaudit: exec:torch-cuda: no CUDA device", file=sys.stderr)
    sys.exit(2)
report = {{"verdict": "pass", "results": [{{"comparison": "kernel", "pass": True,
           "metrics": {{"rel_l2": 0.001, "lse_max_abs": 1e-6}}}}], "integrity": [],
           "backend_description": {{"flashinfer": "0.6.18"}}}}
json.dump(report, open(out, "w"))
"""


class RunTests(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="flashinfer-table-test-")
        self.addCleanup(shutil.rmtree, self.dir)
        self.kvaudit = os.path.join(self.dir, "kvaudit")
        with open(self.kvaudit, "w") as f:
            f.write(FAKE_KVAUDIT.format(python=sys.executable))
        os.chmod(self.kvaudit, 0o755)
        self.dump = os.path.join(self.dir, "tiny.h5")
        open(self.dump, "wb").close()

    def test_main_writes_markdown_and_json(self):
        out = os.path.join(self.dir, "reports", "flashinfer-h200")
        with mock.patch.object(table, "dump_demands", lambda path: None), \
                contextlib.redirect_stdout(io.StringIO()):  # the dump is no HDF5 file
            status = table.main(["--kvaudit", self.kvaudit, "--python", "/opt/py/bin/python3",
                                 "--pythonpath", "/opt/fi", "--dumps", self.dump,
                                 "--no-whole-model", "--backends", "flashinfer-fp8-fa2",
                                 "torch-cuda", "cuda-fp8", "--work",
                                 os.path.join(self.dir, "work"), "--out", out])
        self.assertEqual(status, 0)
        saved = load(out + ".json")
        self.assertEqual([(r["backend"], r["verdict"]) for r in saved["runs"]],
                         [("flashinfer-fp8-fa2", "pass"), ("torch-cuda", "error"),
                          ("cuda-fp8", "pass")])
        self.assertEqual(saved["kvaudit_version"], "kvaudit 9.9.9")
        markdown = load(out + ".md")
        self.assertIn("no CUDA device", markdown)
        args = load(os.path.join(self.dir, "work", "flashinfer-fp8-fa2", "tiny.json.args"))
        self.assertEqual(args[args.index("--backend") + 1], "exec:flashinfer-fp8-fa2")
        command = shlex.split(args[args.index("--backend-command") + 1])
        self.assertEqual(command[0], f"PYTHONPATH={os.path.join(REPO, 'python')}:/opt/fi")
        self.assertEqual(command[1:], ["/opt/py/bin/python3", "-m", "kvdump.backends",
                                       "flashinfer-fp8", "--flashinfer-backend", "fa2"])
        builtin = load(os.path.join(self.dir, "work", "cuda-fp8", "tiny.json.args"))
        self.assertEqual(builtin[builtin.index("--backend") + 1], "cuda-fp8")
        self.assertNotIn("--backend-command", builtin)


@unittest.skipIf(H5PY_MISSING, H5PY_MISSING)
class DumpDemandTests(unittest.TestCase):
    def test_counts_values_past_448_and_464_times_kv_scale(self):
        import kvdump

        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, "d.h5")
        scale = 0.5
        new_kv = np.zeros((2, 12), np.float32)
        new_kv[0, :3] = [224.0, 228.0, -240.0]  # / 0.5: 448 (not past), 456, -480
        new_kv[1, 5] = 233.0  # 466
        with kvdump.KvDumpWriter(path, model="t", producer="test", num_heads=1, kv_lora_rank=8,
                                 qk_rope_head_dim=4, sm_scale=0.5, page_size=1) as dump:
            dump.add_layer(0, kv_scale=scale, kv_cache=np.zeros((4, 1, 12), np.uint8))
            step = dump.add_step("prefill", [0, 2], [0, 2], [0, 1], [1], [0, 1])
            step.add_layer(0, np.zeros((2, 1, 8), np.float32), np.zeros((2, 1, 4), np.float32),
                           new_kv)
        info = table.dump_demands(path)
        self.assertEqual(info, {"layers": 1, "steps": 1, "written": 24, "past_448": 3,
                                "past_464": 2})


if __name__ == "__main__":
    unittest.main()
