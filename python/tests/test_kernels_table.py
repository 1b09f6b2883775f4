"""scripts/kernels_table.py (the H200 kernel table runner) without a GPU: the command each kernel
row runs (its own PYTHONPATH, its adapter's arguments), the rows of kernels that are not run, the
summary of a hand-written report.json, and the Markdown of a hand-written table.

Run: python3 -m unittest discover -s python/tests
"""

import importlib.util
import os
import time
import types
import unittest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(TESTS_DIR, "..", ".."))
spec = importlib.util.spec_from_file_location(
    "kernels_table", os.path.join(REPO, "scripts", "kernels_table.py"))
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def options(**changes):
    base = dict(python="python3", pythonpath={"flashinfer-0.7": "/tmp/fi07"}, write="kvdump",
                adapter_args={"sglang-triton-mla": "--num-kv-splits 4"}, deadline=0,
                started=time.time())
    base.update(changes)
    return types.SimpleNamespace(**base)


class Commands(unittest.TestCase):
    def test_each_flashinfer_gets_its_own_pythonpath(self):
        command = table.exec_command("flashinfer-0.7.4-fa3", options())
        self.assertEqual(command, f"PYTHONPATH={REPO}/python:/tmp/fi07 python3 -m kvdump.backends "
                                  "flashinfer-fp8 --flashinfer-backend fa3 --write kvdump")

    def test_adapter_arguments_are_appended(self):
        command = table.exec_command("sglang-triton-mla", options(write="server"))
        self.assertEqual(command, f"PYTHONPATH={REPO}/python python3 -m kvdump.backends "
                                  "sglang-triton-mla --num-kv-splits 4")

    def test_builtin_backend(self):
        self.assertEqual(table.backend_arguments("cuda-fp8", options()),
                         ["--backend", "cuda-fp8"])

    def test_kernel_without_its_pythonpath_is_not_run(self):
        self.assertEqual(table.not_run(options(), "flashinfer-0.6.18-fa3"),
                         "not run: no --pythonpath flashinfer-0.6=PATH given for "
                         "flashinfer-0.6.18-fa3")
        self.assertIsNone(table.not_run(options(), "vllm-triton-mla"))

    def test_deadline(self):
        late = options(deadline=5, started=time.time() - 10)
        self.assertEqual(table.not_run(late, "vllm-triton-mla"),
                         "not run: the table's deadline of 5 s had passed")


REPORT = {
    "verdict": "fail",
    "results": [
        {"comparison": "kernel", "pass": False,
         "metrics": {"rel_l2": 0.02, "lse_max_abs": 0.5, "nonfinite_mismatches": 3}},
        {"comparison": "kernel", "pass": True,
         "metrics": {"rel_l2": 0.001, "lse_max_abs": 0.01, "nonfinite_mismatches": 0}},
        {"comparison": "total", "pass": True,
         "metrics": {"rel_l2": 0.07, "lse_max_abs": 0.2, "nonfinite_mismatches": 9}},
    ],
    "integrity": [],
    "diagnosis": [{"step": 0, "layer": 1, "comparison": "kernel",
                   "summary": "explained by p-e4m3"}],
    "timing": {"backend_seconds": 1.5},
    "backend_description": {
        "adapter": "sglang-triton-mla", "device": "NVIDIA H200", "torch": "2.11.0",
        "kernel": {"package": "sglang", "version": "0.5.23", "sha256": "ab", "file": "/x.py",
                   "sha256_matches_release": True, "upstream_commit": "tag v0.5.23",
                   "triton": "3.6.0"},
        "tiles": {"BLOCK_N": 32}},
}


class Summary(unittest.TestCase):
    def test_kernel_comparison_only(self):
        row = table.summarize(REPORT, 1, 2.0, "")
        self.assertEqual(row["kernel_rel_l2"], 0.02)
        self.assertEqual(row["kernel_lse_max_abs"], 0.5)
        self.assertEqual(row["nan_inf"], 3)  # the total comparison's 9 are not the kernel's
        self.assertEqual(row["backend_seconds"], 1.5)
        self.assertEqual(row["diagnosis"], ["step 0 layer 1 kernel: explained by p-e4m3"])
        self.assertEqual(row["provenance"]["version"], "0.5.23")
        self.assertEqual(row["provenance"]["tiles"], {"BLOCK_N": 32})
        self.assertNotIn("file", row["provenance"])

    def test_markdown_rows(self):
        run = {**table.summarize(REPORT, 1, 2.0, ""), "kernel": "sglang-triton-mla",
               "dump": "a.h5", "command": "kvaudit check a.h5"}
        skipped = table.skipped_row("not run: why", kernel="vllm-triton-mla", dump="a.h5")
        text = table.render_markdown({"command": "kernels_table.py", "date": "today",
                                      "write": "kvdump", "versions": {"triton": "3.6.0"},
                                      "runs": [run, skipped], "bench": []})
        self.assertIn("| sglang-triton-mla | a.h5 | fail | 0.02 | 0.5 | 3 | clean | step 0 "
                      "layer 1 kernel: explained by p-e4m3 | 2.0 (1.5) |", text)
        self.assertIn("| vllm-triton-mla | a.h5 | not run | — | — | — | — | not run: why "
                      "| 0.0 |", text)
        self.assertIn("| triton | 3.6.0 |", text)
        # SGLang's FA3 MLA serves the FP8 cache through a bf16 kernel: a row of evidence
        self.assertIn("| sglang-fa3-mla | SGLang `--attention-backend fa3", text)
        self.assertIn("HeaddimV > 256 requires fp16 and bf16 data type", text)


class Merge(unittest.TestCase):
    """One table from two calls (scripts/gpu-kernels.sh KERNELS_MERGE): the kernels not run now
    keep the earlier run's check and bench rows, and the Markdown says which rows came from it."""

    def test_rows_of_kernels_not_run_now_come_from_the_earlier_table(self):
        row = lambda kernel, dump: {"kernel": kernel, "dump": dump, "verdict": "pass",
                                    "status": 0, "seconds": 1.0, "command": "c"}
        earlier = {"date": "2026-12-05 05:31 UTC", "command": "kernels_table.py --kernels all",
                   "kvaudit_version": "kvaudit 0.1.0", "versions": {"nvidia_smi": "H200, 580"},
                   "runs": [row("cuda-fp8", "a.h5"), row("vllm-triton-mla", "a.h5"),
                            row("flashinfer-0.7.4-fa3", "a.h5")],
                   "bench": [{"kernel": "vllm-triton-mla"}, {"kernel": "cuda-fp8"}]}
        now = {"command": "kernels_table.py --kernels cuda-fp8 flashinfer-0.7.4-fa3",
               "date": "2026-12-05 12:00 UTC", "write": "kvdump", "versions": {},
               "runs": [row("cuda-fp8", "a.h5"), row("flashinfer-0.7.4-fa3", "a.h5")],
               "bench": [{"kernel": "flashinfer-0.7.4-fa3"}]}
        merged = table.merge_earlier(now, earlier, ["cuda-fp8", "flashinfer-0.7.4-fa3"])
        self.assertEqual([r["kernel"] for r in merged["runs"]],
                         ["cuda-fp8", "flashinfer-0.7.4-fa3", "vllm-triton-mla"])
        self.assertEqual([r["kernel"] for r in merged["bench"]],
                         ["flashinfer-0.7.4-fa3", "vllm-triton-mla"])
        self.assertEqual(merged["merged"]["kernels"], ["vllm-triton-mla"])
        text = table.render_markdown({**merged, "bench": []})
        self.assertIn("**Two runs.** The rows of vllm-triton-mla (checks and bench) are from an "
                      "earlier run: `kernels_table.py --kernels all` on 2026-12-05 05:31 UTC "
                      "(kvaudit 0.1.0, H200, 580)", text)


if __name__ == "__main__":
    unittest.main()
