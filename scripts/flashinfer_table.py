#!/usr/bin/env python3
"""The H200 table of production MLA kernels: `kvaudit check --json` of every dump through every
backend, summarised in reports/flashinfer-h200.md and reports/flashinfer-h200.json.

    python3 scripts/flashinfer_table.py --kvaudit build/kvaudit --python python3 \\
        --pythonpath /path/to/flashinfer-wheels-target

runs, on each dump (the shipped datasets/*.h5 and a whole-model synthetic dump of 78 layers that
`kvaudit synth` writes into the work directory), the backends
  flashinfer-fp8-fa3 / -fa2    python -m kvdump.backends flashinfer-fp8 --flashinfer-backend fa3|fa2
  flashinfer-cast-bf16         ... flashinfer-cast-bf16 (SGLang's cast: no kv_scale)
  flashinfer-cast-bf16-fold    ... flashinfer-cast-bf16 --cast-scale fold (kv_scale kept)
  torch-cuda                   ... torch --device cuda
  cuda-fp8                     kvaudit's own kernel
every exec adapter with its default write, PyTorch's `(new_kv / kv_scale).to(float8_e4m3fn)` as
servers do it (`--write kvdump` etc. with --write). From each report.json it takes the verdict,
the worst kernel rel_l2 and lse error, the failing comparisons, the integrity findings (check and
class, slot counts), the diagnosis findings where report.json has them, and the backend's
description (library versions, GPU, driver, what PyTorch's FP8 cast does past 464); from each dump
(with h5py) how many new KV values a satfinite write saturates. A run that ends with exit status
2 or 3 (an adapter refusing, a crash) is listed with the last line it printed.

--render-only JSON re-renders the Markdown from a saved JSON (the tests use it on fake reports).
"""

import argparse
import datetime
import glob
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WHOLE_MODEL = ("glm5_78layers.h5", ["--seed", "4", "--layers", "78", "--page-size", "1",
                                    "--prefix-lens", "0,40,257,0", "--prefill-tokens", "0,0,3,5",
                                    "--decode-steps", "3", "--with-source"])
# name -> (kind, adapter arguments): "exec" backends run python -m kvdump.backends ARGS.
BACKENDS = {
    "flashinfer-fp8-fa3": ("exec", ["flashinfer-fp8", "--flashinfer-backend", "fa3"]),
    "flashinfer-fp8-fa2": ("exec", ["flashinfer-fp8", "--flashinfer-backend", "fa2"]),
    "flashinfer-cast-bf16": ("exec", ["flashinfer-cast-bf16"]),
    "flashinfer-cast-bf16-fold": ("exec", ["flashinfer-cast-bf16", "--cast-scale", "fold"]),
    "torch-cuda": ("exec", ["torch", "--device", "cuda"]),
    "cuda-fp8": ("builtin", ["cuda-fp8"]),
}
VERSION_KEYS = ("device", "compute_capability", "driver", "driver_cuda", "torch", "torch_cuda",
                "flashinfer", "numpy", "python", "kvdump")


# ---------------------------------------------------------------------------------------------
# Reading one report.json


def worst(results, comparison, key):
    """The largest metric `key` over the results of one comparison (None if there are none)."""
    values = [r.get("metrics", {}).get(key) for r in results
              if r.get("comparison") == comparison]
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def failing_comparisons(results):
    """{comparison: number of failing (step, layer) results}."""
    counts = {}
    for result in results:
        if not result.get("pass", True):
            counts[result.get("comparison", "?")] = counts.get(result.get("comparison", "?"), 0) + 1
    return counts


def integrity_summary(integrity):
    """Failing integrity findings grouped as "check [class]": (findings, slots)."""
    groups = {}
    for finding in integrity:
        if finding.get("pass", True):
            continue
        label = finding.get("check", "?")
        if finding.get("classification"):
            label += f" [{finding['classification']}]"
        findings, slots = groups.get(label, (0, 0))
        groups[label] = (findings + 1, slots + int(finding.get("slot_count") or 0))
    return {label: {"findings": f, "slots": s} for label, (f, s) in sorted(groups.items())}


def diagnosis_lines(report):
    """One line per diagnosis finding (docs/report-schema.md "diagnosis"): where, which
    comparison, and its summary (what explains the failure, or the closest hypothesis)."""
    lines = []
    for finding in report.get("diagnosis", []) or []:
        if not isinstance(finding, dict):
            lines.append(str(finding))
            continue
        where = f"step {finding.get('step', '?')} layer {finding.get('layer', '?')}"
        comparison = finding.get("comparison", "?")
        summary = finding.get("summary") or json.dumps(finding, sort_keys=True)
        lines.append(f"{where} {comparison}: {summary}")
    return lines


def find_describe(description):
    """The adapter's describe object inside report.json's backend_description (it may be nested
    one level down, e.g. under "describe")."""
    if not isinstance(description, dict):
        return {}
    if any(key in description for key in VERSION_KEYS):
        return description
    for value in description.values():
        if isinstance(value, dict) and any(key in value for key in VERSION_KEYS):
            return value
    return {}


def summarize(report, status, seconds, stderr_tail=""):
    """The row of the table for one run."""
    row = {"status": status, "seconds": round(seconds, 1)}
    if not isinstance(report, dict):
        row["verdict"] = {0: "pass", 1: "fail"}.get(status, "error")
        row["error"] = stderr_tail
        return row
    results = report.get("results", [])
    row.update({
        "verdict": report.get("verdict", "?"),
        "kernel_rel_l2": worst(results, "kernel", "rel_l2"),
        "kernel_lse_max_abs": worst(results, "kernel", "lse_max_abs"),
        "total_rel_l2": worst(results, "total", "rel_l2"),
        "failing": failing_comparisons(results),
        "integrity": integrity_summary(report.get("integrity", [])),
        "diagnosis": diagnosis_lines(report),
        "describe": find_describe(report.get("backend_description")),
        "timing": report.get("timing", {}),
    })
    return row


# ---------------------------------------------------------------------------------------------
# Rendering


def number(value, digits=3):
    if value is None:
        return "—"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def environment_table(runs):
    """Versions seen in the runs' descriptions, one row per key (several values are listed)."""
    seen = {}
    for run in runs:
        describe = run.get("describe") or {}
        for key in VERSION_KEYS:
            if describe.get(key) is not None:
                seen.setdefault(key, set()).add(str(describe[key]))
        probe = (describe.get("torch_fp8_cast") or {}).get("past_464")
        if probe:
            seen.setdefault("PyTorch bf16 -> e4m3fn cast past 464", set()).add(probe)
    lines = ["| | |", "| --- | --- |"]
    for key, values in seen.items():
        lines.append(f"| {cell(key)} | {cell(', '.join(sorted(values)))} |")
    return lines


def write_cell(integrity):
    return "<br>".join(f"{label}: {v['findings']} findings, {v['slots']} slots"
                       for label, v in integrity.items()) or "clean"


def verdict_table(runs):
    lines = ["| backend | dump | verdict | kernel rel_l2 | kernel lse max abs "
             "| failing comparisons | write / integrity findings | diagnosis |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        if run.get("verdict") == "error":
            lines.append(f"| {run['backend']} | {run['dump']} | error (exit {run['status']}) | — "
                         f"| — | — | {cell(run.get('error', ''))} | — |")
            continue
        failing = ", ".join(f"{k} ×{v}" for k, v in sorted(run.get("failing", {}).items()))
        diagnosis = "<br>".join(cell(line) for line in run.get("diagnosis", [])) or "—"
        lines.append(
            f"| {run['backend']} | {run['dump']} | {run['verdict']} | "
            f"{number(run.get('kernel_rel_l2'))} | {number(run.get('kernel_lse_max_abs'))} | "
            f"{failing or 'none'} | {cell(write_cell(run.get('integrity', {})))} | {diagnosis} |")
    return lines


def dump_table(dumps):
    lines = ["| dump | layers | steps | values written | past 448 × kv_scale (satfinite: ±448) "
             "| past 464 × kv_scale (a non-saturating cast: NaN) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, info in dumps.items():
        if not info:
            lines.append(f"| {name} | — | — | — | — | — |")
            continue
        lines.append(f"| {name} | {info['layers']} | {info['steps']} | {info['written']} | "
                     f"{info['past_448']} | {info['past_464']} |")
    return lines


def render_markdown(table):
    runs = table["runs"]
    out = ["# Production MLA kernels on the H200: kvaudit check per backend and dump", "",
           f"Produced by `{table['command']}` on {table['date']} "
           f"({table.get('kvaudit_version', 'kvaudit')}). Exec adapters write with "
           f"`--write {table['write']}`; every run is `kvaudit check DUMP --backend ... --json`.",
           "", "## Versions", ""]
    out += environment_table(runs)
    out += ["", "## Verdicts, kernel error, write findings and diagnosis", "",
            "kernel rel_l2 and lse: the worst (step, layer) of the kernel comparison (backend vs "
            "the exact attention on the pool it read); write findings: failing integrity checks "
            "with their class, summed over steps and layers.", ""]
    out += verdict_table(runs)
    if table.get("dumps"):
        out += ["", "## What the dumps ask of a write", ""]
        out += dump_table(table["dumps"])
    out += ["", "## Commands", ""]
    out += [f"- `{run['backend']}` on `{run['dump']}`: `{run['command']}`" for run in runs]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Running


def backend_arguments(name, options):
    kind, args = BACKENDS[name]
    if kind == "builtin":
        return ["--backend", args[0]]
    python = " ".join(shlex.quote(part) for part in shlex.split(options.python))
    pythonpath = ":".join([os.path.join(REPO, "python")] + options.pythonpath)
    adapter = args + (["--write", options.write] if options.write != "server" else [])
    command = (f"PYTHONPATH={shlex.quote(pythonpath)} {python} -m kvdump.backends "
               + " ".join(shlex.quote(a) for a in adapter))
    return ["--backend", f"exec:{name}", "--backend-command", command]


def run_check(options, backend, dump, work):
    report_path = os.path.join(work, backend, os.path.basename(dump).replace(".h5", ".json"))
    os.makedirs(os.path.dirname(report_path), exist_ok=True)
    if os.path.exists(report_path):
        os.remove(report_path)
    command = [options.kvaudit, "check", dump, *backend_arguments(backend, options), "--json",
               report_path]
    started = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        status, output = 124, f"timed out after {options.timeout} s"
    seconds = time.time() - started
    with open(report_path.replace(".json", ".log"), "w", encoding="utf-8") as log:
        log.write(output)
    report = None
    if os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    row = summarize(report, status, seconds, tail)
    row.update({"backend": backend, "dump": os.path.basename(dump),
                "command": " ".join(shlex.quote(c) for c in command)})
    print(f"{backend:27} {os.path.basename(dump):24} exit {status}  {row['verdict']:5}  "
          f"kernel rel_l2 {number(row.get('kernel_rel_l2'))}  ({seconds:.1f} s)", flush=True)
    return row


def dump_demands(path):
    """How many new KV values of a dump a satfinite write saturates, and past 464 (h5py)."""
    try:
        import h5py
        import numpy as np
    except ImportError:
        return None
    sys.path.insert(0, os.path.join(REPO, "python"))
    from kvdump import float32_from_bf16_bits

    info = {"layers": 0, "steps": 0, "written": 0, "past_448": 0, "past_464": 0}
    with h5py.File(path, "r") as f:
        scales = {name: np.float32(g.attrs["kv_scale"]) for name, g in f["layers"].items()}
        info["layers"], info["steps"] = len(scales), len(f["steps"])
        for step in f["steps"].values():
            for name, scale in scales.items():
                data = step[name]["new_kv"]
                x = data[()]
                x = float32_from_bf16_bits(x) if x.dtype == np.uint16 else x.astype(np.float32)
                q = np.abs(x / scale)
                info["written"] += int(x.size)
                info["past_448"] += int(np.count_nonzero(q > 448))
                info["past_464"] += int(np.count_nonzero(q > 464))
    return info


def collect_dumps(options, work):
    dumps = [] if options.whole_model_only else (
        list(options.dumps) or sorted(glob.glob(os.path.join(REPO, "datasets", "*.h5"))))
    if not options.no_whole_model:
        name, args = WHOLE_MODEL
        path = os.path.join(work, name)
        if not os.path.exists(path):
            subprocess.run([options.kvaudit, "synth", "--out", path, *args], check=True)
        dumps.append(path)
    return dumps


def kvaudit_version(binary):
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True,
                              timeout=60).stdout.strip() or "kvaudit"
    except (OSError, subprocess.TimeoutExpired):
        return "kvaudit"


def run_all(options):
    work = options.work
    os.makedirs(work, exist_ok=True)
    dumps = collect_dumps(options, work)
    table = {"command": " ".join(shlex.quote(a) for a in sys.argv), "write": options.write,
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "kvaudit_version": kvaudit_version(options.kvaudit),
             "dumps": {os.path.basename(d): dump_demands(d) for d in dumps}, "runs": []}
    for dump in dumps:
        for backend in options.backends:
            table["runs"].append(run_check(options, backend, dump, work))
            save(table, options.out, quiet=True)  # a table so far survives an interrupted run
    return table


def save(table, out, quiet=False, render=None):
    """OUT.json and OUT.md (rendered by `render`, this table's render_markdown by default)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write((render or render_markdown)(table))
    if not quiet:
        print(f"wrote {out}.md and {out}.json")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvaudit", default=os.path.join(REPO, "build", "kvaudit"))
    parser.add_argument("--python", default="python3",
                        help="the interpreter with torch (and flashinfer) for the exec adapters")
    parser.add_argument("--pythonpath", action="append", default=[],
                        help="extra PYTHONPATH entries, e.g. where the flashinfer wheels were "
                             "installed with pip install --target (repeatable)")
    parser.add_argument("--dumps", nargs="*", default=[],
                        help="dumps to check (default: datasets/*.h5)")
    parser.add_argument("--no-whole-model", action="store_true",
                        help="skip the 78-layer synthetic dump")
    parser.add_argument("--whole-model-only", action="store_true",
                        help="only the 78-layer synthetic dump (e.g. after the shipped ones)")
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--write", default="server", choices=("server", "saturate", "kvdump"),
                        help="the exec adapters' write rule (default server: PyTorch's cast)")
    parser.add_argument("--work", default=os.path.join(REPO, "build", "flashinfer-table"),
                        help="where reports, logs and the synthetic dump go")
    parser.add_argument("--out", default=os.path.join(REPO, "reports", "flashinfer-h200"),
                        help="output path without extension (.md and .json are written)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per kvaudit run")
    parser.add_argument("--render-only", metavar="JSON",
                        help="re-render the Markdown of a saved table and print it")
    return parser.parse_args(argv)


def main(argv=None):
    options = parse_args(argv)
    if options.render_only:
        with open(options.render_only, encoding="utf-8") as f:
            sys.stdout.write(render_markdown(json.load(f)))
        return 0
    save(run_all(options), options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
