#!/usr/bin/env python3
"""The H200 table of every FP8 MLA kernel people deploy on Hopper, judged on the same dumps:
`kvaudit check --json` of each dump through each kernel, and `kvaudit bench --peer` of each peer
next to cuda-fp8 and the device copy, summarised in reports/kernels-h200.md and .json.

    python3 scripts/kernels_table.py --kvaudit build-gpu/kvaudit --python python3 \\
        --pythonpath flashinfer-0.6=/tmp/site-fi06 --pythonpath flashinfer-0.7=/tmp/site-fi07

Kernels (KERNELS below; add a row to add one): cuda-fp8 (kvaudit's own), FlashInfer 0.6.18 and
0.7.4 (exec:flashinfer-fp8, each with its own PYTHONPATH), vllm-triton-mla, sglang-triton-mla
(this package's adapters; their kernel files from build/peer-kernels, scripts/fetch-peer-
kernels.sh) and flashmla-dense-fp8. Dumps: the shipped datasets/*.h5, and traces `kvaudit synth`
writes into the work folder at 8, 16, 64 and 128 heads, each with the calibrated per-tensor scale
(amax / 448, synth's default), scale 1.0 and scale 0.0733 (not a power of two) (SYNTH_TRACES).
A run that exits 2 or 3 (a kernel refusing a dump, a crash, an adapter missing) is a row with the
last line it printed. Runs go JOBS at a time (the reference uses the CPU; the kernels share the
GPU), each bounded by --timeout.

Per run: verdict, worst kernel rel_l2 and lse error (the kernel comparison: the kernel against the
exact attention on the pool it read), NaN/Inf mismatches, failing integrity findings (where the
kernel's adapter writes the step's rows), the diagnosis lines, the wall time and the backend's own
time. Per peer and bench shape: its median time, cuda-fp8's and the copy's, from one
`kvaudit bench --peer` run each. --render-only JSON re-renders the Markdown.
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_spec = importlib.util.spec_from_file_location(
    "flashinfer_table", os.path.join(REPO, "scripts", "flashinfer_table.py"))
fi_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fi_table)

# name -> (kind, adapter and its arguments, PYTHONPATH key or None). "builtin": a kvaudit backend;
# "exec": python -m kvdump.backends ARGS, run as --backend exec:ARGS[0].
KERNELS = {
    "cuda-fp8": ("builtin", ["cuda-fp8"], None),
    "flashinfer-0.6.18-fa3": ("exec", ["flashinfer-fp8", "--flashinfer-backend", "fa3"],
                              "flashinfer-0.6"),
    "flashinfer-0.7.4-fa3": ("exec", ["flashinfer-fp8", "--flashinfer-backend", "fa3"],
                             "flashinfer-0.7"),
    "vllm-triton-mla": ("exec", ["vllm-triton-mla"], None),
    "sglang-triton-mla": ("exec", ["sglang-triton-mla"], None),
    "flashmla-dense-fp8": ("exec", ["flashmla-dense-fp8"], None),
}
# Deployed kernels that serve an FP8 MLA cache without an FP8 MLA kernel: their row is the evidence,
# read from the released sources (issue 29 asks for the row either way).
NOT_FP8_MLA = {
    "sglang-fa3-mla": (
        "SGLang `--attention-backend fa3 --kv-cache-dtype fp8_e4m3` (sglang 0.5.23 wheel from PyPI, "
        "also 0.5.6 and 0.5.12) runs no FP8 MLA kernel on SM90. The absorbed MLA path casts the "
        "layer's whole latent buffer to q's dtype on every call "
        "(`get_key_buffer(layer.layer_id).to(q.dtype)`, "
        "sglang/srt/layers/attention/flashattention_backend.py lines 1944 and 2350) and calls "
        "sgl-kernel's FA3 `flash_attn_with_kvcache` in bf16 (k_cache = RoPE part, v_cache = "
        "latent, qv = q_nope, no descales); q goes to e4m3 only where `layer.head_dim <= 256` "
        "(line 1428; MLA's is 576). FA3 itself refuses e4m3 for this shape: \"HeaddimV > 256 "
        "requires fp16 and bf16 data type\" and \"q_v is only supported for fp16 and bf16 data "
        "type\" (sgl-attn hopper/flash_api.cpp, sgl-kernel branch 39da714, lines 698-708 and "
        "932-936; the e4m3 instantiations stop at head dims 256/256). The cache is written by a "
        "plain `.to(float8_e4m3fn)` with no scale (mem_cache/memory_pool.py MLATokenToKVPool): the "
        "deployment's FP8 cost is that of a scale of 1.0, which the `scale1` traces above judge. "
        "Not run here: the sglang-kernel 0.4.10 wheel is 373 MB (torch 2.14.1), beyond what the "
        "GPU machine can be given."),
}
# (name, synth arguments): decode traces with a prefill step (one prefix-less request), page 64.
SYNTH_BASE = ["--layers", "2", "--page-size", "64", "--prefix-lens", "0,300,1100,2000",
              "--prefill-tokens", "4,1,1,1", "--decode-steps", "2", "--with-source"]
SCALES = {"amax": [], "scale1": ["--kv-scale", "1.0"], "scale0.0733": ["--kv-scale", "0.0733"]}
SYNTH_TRACES = [(f"synth_h{heads}_{label}.h5", ["--seed", str(heads), "--heads", str(heads),
                                                  *SYNTH_BASE, *extra])
                for heads in (8, 16, 64, 128) for label, extra in SCALES.items()]
BENCH_SHAPES = [{"batch": 64, "context": 4096, "heads": 16, "page_size": 64},
                {"batch": 64, "context": 4096, "heads": 128, "page_size": 64}]
VERSION_KEYS = fi_table.VERSION_KEYS + ("triton",)


# ---------------------------------------------------------------------------------------------
# Reading one report.json


def nonfinite(results):
    """NaN/Inf mismatches of the kernel comparison (metrics.nonfinite_mismatches), summed over
    (step, layer)."""
    return sum(int(r.get("metrics", {}).get("nonfinite_mismatches") or 0) for r in results
               if r.get("comparison") == "kernel")


def kernel_provenance(describe, full):
    """The peer's package, version, commit, file sha256 and tiles from its describe."""
    kernel = full.get("kernel") if isinstance(full, dict) else None
    record = {}
    if isinstance(kernel, dict):
        record = {k: kernel.get(k) for k in ("package", "version", "upstream_commit", "sha256",
                                             "sha256_matches_release", "triton")}
    if isinstance(full, dict) and isinstance(full.get("tiles"), dict):
        record["tiles"] = full["tiles"]
    for key in ("flashinfer", "torch"):
        if describe.get(key):
            record[key] = describe[key]
    return record


def summarize(report, status, seconds, tail):
    row = fi_table.summarize(report, status, seconds, tail)
    if isinstance(report, dict):
        row["nan_inf"] = nonfinite(report.get("results", []))
        row["backend_seconds"] = (report.get("timing") or {}).get("backend_seconds")
        full = report.get("backend_description") or {}
        row["provenance"] = kernel_provenance(row.get("describe") or {},
                                              fi_table.find_describe(full) or full)
        row.pop("timing", None)
    return row


# ---------------------------------------------------------------------------------------------
# Running


def exec_command(kernel, options):
    _, args, key = KERNELS[kernel]
    python = " ".join(shlex.quote(p) for p in shlex.split(options.python))
    extra = [options.pythonpath[key]] if key and key in options.pythonpath else []
    pythonpath = ":".join([os.path.join(REPO, "python")] + extra)
    adapter = args + (["--write", options.write] if options.write != "server" else [])
    adapter += shlex.split(options.adapter_args.get(kernel, ""))
    return (f"PYTHONPATH={shlex.quote(pythonpath)} {python} -m kvdump.backends "
            + " ".join(shlex.quote(a) for a in adapter))


def backend_arguments(kernel, options):
    kind, args, _ = KERNELS[kernel]
    if kind == "builtin":
        return ["--backend", args[0]]
    return ["--backend", f"exec:{args[0]}", "--backend-command", exec_command(kernel, options)]


def run(command, timeout):
    started = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        status, output = 124, f"timed out after {timeout} s"
    return status, output, time.time() - started


def last_line(output):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


def not_run(options, kernel):
    """Why a kernel is not run at all (its PYTHONPATH not given, the deadline passed), or None."""
    key = KERNELS[kernel][2]
    if key and key not in options.pythonpath:
        return f"not run: no --pythonpath {key}=PATH given for {kernel}"
    if options.deadline and time.time() - options.started > options.deadline:
        return f"not run: the table's deadline of {options.deadline} s had passed"
    return None


def skipped_row(reason, **where):
    print(f"skip {where} {reason}", flush=True)
    return {**where, "status": None, "verdict": "error", "error": reason, "seconds": 0.0,
            "command": ""}


def run_check(options, kernel, dump):
    if (reason := not_run(options, kernel)) is not None:
        return skipped_row(reason, kernel=kernel, dump=os.path.basename(dump))
    base = os.path.join(options.work, "check", kernel, os.path.basename(dump)[:-3])
    os.makedirs(os.path.dirname(base), exist_ok=True)
    report_path = base + ".json"
    if os.path.exists(report_path):
        os.remove(report_path)
    command = [options.kvaudit, "check", dump, *backend_arguments(kernel, options), "--json",
               report_path]
    status, output, seconds = run(command, options.timeout)
    with open(base + ".log", "w", encoding="utf-8") as log:
        log.write(output)
    report = None
    if os.path.exists(report_path):
        with open(report_path, encoding="utf-8") as f:
            report = json.load(f)
    row = summarize(report, status, seconds, last_line(output))
    row.update({"kernel": kernel, "dump": os.path.basename(dump),
                "command": " ".join(shlex.quote(c) for c in command)})
    print(f"check {kernel:24} {row['dump']:28} exit {status} {row['verdict']:5} kernel rel_l2 "
          f"{fi_table.number(row.get('kernel_rel_l2'))} ({seconds:.1f} s)", flush=True)
    return row


def run_bench(options, kernel, shape):
    if (reason := not_run(options, kernel)) is not None:
        return skipped_row(reason, kernel=kernel, **shape)
    name = f"{kernel}_b{shape['batch']}_c{shape['context']}_h{shape['heads']}_p{shape['page_size']}"
    path = os.path.join(options.work, "bench", name + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    command = [options.kvaudit, "bench", "--gpu-only", "--no-cast",
               "--batch", str(shape["batch"]), "--context", str(shape["context"]),
               "--heads", str(shape["heads"]), "--page-size", str(shape["page_size"]),
               "--peer", f"exec:{KERNELS[kernel][1][0]}",
               "--peer-command", exec_command(kernel, options), "--json", path]
    status, output, seconds = run(command, options.timeout)
    with open(path[:-5] + ".log", "w", encoding="utf-8") as log:
        log.write(output)
    row = {"kernel": kernel, **shape, "status": status, "seconds": round(seconds, 1),
           "command": " ".join(shlex.quote(c) for c in command)}
    bench = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            bench = json.load(f)
    if not isinstance(bench, dict) or not bench.get("cases"):
        row["error"] = last_line(output)
    else:
        case = bench["cases"][0]
        peer = case.get("peer") or {}
        row.update({"peer_us": peer.get("median_us"), "peer_outcome": peer.get("outcome"),
                    "peer_message": peer.get("message"), "peer_method": peer.get("method"),
                    "cuda_fp8_us": (case.get("fp8") or {}).get("median_us"),
                    "peer_copy_ratio": peer.get("copy_ratio"),
                    "fp8_copy_ratio": case.get("fp8_copy_ratio"),
                    "copy_gbps": (bench.get("copy") or {}).get("gbps_read_plus_written"),
                    "device": bench.get("device")})
    print(f"bench {name:48} exit {status} peer {fi_table.number(row.get('peer_us'))} us, "
          f"cuda-fp8 {fi_table.number(row.get('cuda_fp8_us'))} us ({seconds:.1f} s)", flush=True)
    return row


def make_dumps(options):
    dumps = list(options.dumps) or sorted(
        os.path.join(REPO, "datasets", n) for n in os.listdir(os.path.join(REPO, "datasets"))
        if n.endswith(".h5"))
    if options.no_synth:
        return dumps
    folder = os.path.join(options.work, "dumps")
    os.makedirs(folder, exist_ok=True)
    for name, args in SYNTH_TRACES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            done = subprocess.run([options.kvaudit, "synth", "--out", path, *args],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"synth {name} failed: {last_line(done.stdout + done.stderr)}", flush=True)
                continue
        dumps.append(path)
    return dumps


def tool_versions(options):
    """Device, driver, CUDA, torch, triton and the Python packages the runs used."""
    probe = ("import json, torch\n"
             "v = {'torch': torch.__version__, 'torch_cuda': torch.version.cuda}\n"
             "try:\n import triton; v['triton'] = triton.__version__\nexcept Exception as e:\n"
             " v['triton'] = 'not importable: %s' % e\n"
             "if torch.cuda.is_available():\n"
             " v['device'] = torch.cuda.get_device_name(0)\n"
             "print(json.dumps(v))\n")
    versions = {"python_platform": platform.platform()}
    try:
        done = subprocess.run(shlex.split(options.python) + ["-c", probe], capture_output=True,
                              text=True, timeout=120)
        versions.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as error:
        versions["torch"] = f"probe failed: {error}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        versions["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        versions["nvidia_smi"] = "not available"
    return versions


def run_all(options):
    os.makedirs(options.work, exist_ok=True)
    table = {"command": " ".join(shlex.quote(a) for a in sys.argv), "write": options.write,
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "kvaudit_version": fi_table.kvaudit_version(options.kvaudit),
             "versions": tool_versions(options), "pythonpath": options.pythonpath,
             "runs": [], "bench": [], "not_fp8_mla": NOT_FP8_MLA}
    dumps = make_dumps(options)
    jobs = [(k, d) for d in dumps for k in options.kernels]
    order = {(k, os.path.basename(d)): i for i, (k, d) in enumerate(jobs)}
    with concurrent.futures.ThreadPoolExecutor(options.jobs) as pool:
        futures = [pool.submit(run_check, options, *job) for job in jobs]
        for future in concurrent.futures.as_completed(futures):
            table["runs"].append(future.result())
            table["runs"].sort(key=lambda r: order[(r["kernel"], r["dump"])])
            save(table, options.out, quiet=True)  # a table so far survives a timeout
    if not options.no_bench:  # one at a time, after the checks: timings share nothing
        for kernel in options.kernels:
            if KERNELS[kernel][0] == "exec":
                for shape in BENCH_SHAPES:
                    table["bench"].append(run_bench(options, kernel, shape))
                    save(table, options.out, quiet=True)
    return table


# ---------------------------------------------------------------------------------------------
# Rendering


def merge_earlier(table, earlier, kernels):
    """Takes the rows of every kernel this run did not run from an earlier table (check rows and
    bench rows), in the earlier order after this run's, and records which rows came from which run
    (`merged`): one table when one call cannot carry every kernel's files."""
    kept = [k for k in dict.fromkeys(r["kernel"] for r in earlier.get("runs", []))
            if k not in kernels]
    table["runs"] += [r for r in earlier.get("runs", []) if r["kernel"] in kept]
    table["bench"] += [r for r in earlier.get("bench", []) if r["kernel"] in kept]
    table["merged"] = {"kernels": kept, "date": earlier.get("date"),
                       "command": earlier.get("command"),
                       "kvaudit_version": earlier.get("kvaudit_version"),
                       "versions": earlier.get("versions")}
    return table


def merged_lines(table):
    merged = table.get("merged")
    if not merged or not merged.get("kernels"):
        return []
    device = (merged.get("versions") or {}).get("nvidia_smi", "?")
    return ["", f"**Two runs.** The rows of {', '.join(merged['kernels'])} (checks and bench) are "
            f"from an earlier run: `{merged['command']}` on {merged['date']} "
            f"({merged.get('kvaudit_version')}, {device}); every other row is from the run "
            "above. Each run's bench ratios are against `cuda-fp8` timed in that run."]


def provenance_lines(runs):
    seen = {}
    for run in runs:
        record = run.get("provenance")
        if record and run["kernel"] not in seen:
            seen[run["kernel"]] = record
    lines = ["| kernel | package, version, commit, file sha256, tiles |", "| --- | --- |"]
    for kernel, record in seen.items():
        lines.append(f"| {kernel} | {fi_table.cell(json.dumps(record, sort_keys=True))} |")
    return lines


def check_lines(runs):
    lines = ["| kernel | dump | verdict | kernel rel_l2 | kernel lse max abs | NaN/Inf | "
             "integrity (kernel's writes) | diagnosis | wall s (backend s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        if run.get("verdict") == "error":
            state = "not run" if run["status"] is None else f"error (exit {run['status']})"
            lines.append(f"| {run['kernel']} | {run['dump']} | {state} | — | "
                         f"— | — | — | {fi_table.cell(run.get('error', ''))} | "
                         f"{run['seconds']} |")
            continue
        diagnosis = "<br>".join(fi_table.cell(line) for line in run.get("diagnosis", [])) or "—"
        lines.append(
            f"| {run['kernel']} | {run['dump']} | {run['verdict']} | "
            f"{fi_table.number(run.get('kernel_rel_l2'))} | "
            f"{fi_table.number(run.get('kernel_lse_max_abs'))} | {run.get('nan_inf', 0)} | "
            f"{fi_table.cell(fi_table.write_cell(run.get('integrity', {})))} | {diagnosis} | "
            f"{run['seconds']} ({fi_table.number(run.get('backend_seconds'))}) |")
    return lines


def bench_lines(bench):
    lines = ["| kernel | batch × context, heads, page | peer µs | cuda-fp8 µs | "
             "peer / cuda-fp8 | peer % copy | cuda-fp8 % copy | copy GB/s | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in bench:
        shape = f"{row['batch']} × {row['context']}, {row['heads']}, {row['page_size']}"
        peer, fp8 = row.get("peer_us"), row.get("cuda_fp8_us")
        ratio = peer / fp8 if isinstance(peer, (int, float)) and fp8 else None
        pct = [f"{100 * r:.0f}%" if isinstance(r, (int, float)) else "—"
               for r in (row.get("peer_copy_ratio"), row.get("fp8_copy_ratio"))]
        note = row.get("error") or row.get("peer_message") or row.get("peer_method") or ""
        lines.append(f"| {row['kernel']} | {shape} | {fi_table.number(peer)} | "
                     f"{fi_table.number(fp8)} | {fi_table.number(ratio)} | {pct[0]} | {pct[1]} | "
                     f"{fi_table.number(row.get('copy_gbps'), 4)} | {fi_table.cell(note)} |")
    return lines


def render_markdown(table):
    out = ["# FP8 MLA kernels on the H200: kvaudit check and bench per kernel and dump", "",
           f"Produced by `{table['command']}` on {table['date']} "
           f"({table.get('kvaudit_version', 'kvaudit')}); exec adapters write with "
           f"`--write {table['write']}`. Regenerate on the GPU machine with "
           "`bash scripts/gpu-kernels.sh OUTDIR` (docs/peer-kernels.md: what to carry).", "",
           ] + merged_lines(table)[1:] + ([""] if table.get("merged") else []) + [
           "## Versions", "", "| | |", "| --- | --- |"]
    for key, value in sorted((table.get("versions") or {}).items()):
        out.append(f"| {fi_table.cell(key)} | {fi_table.cell(value)} |")
    for key, value in sorted((table.get("pythonpath") or {}).items()):
        out.append(f"| PYTHONPATH {fi_table.cell(key)} | {fi_table.cell(value)} |")
    out += ["", "## Kernels", ""] + provenance_lines(table["runs"])
    out += ["", "## Accuracy: kvaudit check", "",
            "kernel rel_l2 and lse: the worst (step, layer) of the kernel comparison (the kernel "
            "against the exact attention on the pool it read).", ""]
    out += check_lines(table["runs"])
    out += ["", "## Deployed without an FP8 MLA kernel", "", "| kernel | evidence |",
            "| --- | --- |"]
    out += [f"| {name} | {fi_table.cell(text)} |" for name, text in NOT_FP8_MLA.items()]
    if table.get("bench"):
        out += ["", "## Time: kvaudit bench --peer (same run: peer, cuda-fp8, device copy)", ""]
        out += bench_lines(table["bench"])
    out += ["", "## Commands", ""]
    out += [f"- `{r['kernel']}` on `{r['dump']}`: `{r['command']}`" for r in table["runs"]]
    out += [f"- bench `{r['kernel']}`: `{r['command']}`" for r in table.get("bench", [])]
    return "\n".join(out) + "\n"


def save(table, out, quiet=False):
    fi_table.save(table, out, quiet, render=render_markdown)


def pythonpath_entry(text):
    key, sep, path = text.partition("=")
    if not sep or not key or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=PATH")
    return key, path


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="kernels: " + ", ".join(KERNELS))
    parser.add_argument("--kvaudit", default=os.path.join(REPO, "build-gpu", "kvaudit"))
    parser.add_argument("--python", default="python3",
                        help="the interpreter with torch and triton for the exec adapters")
    parser.add_argument("--pythonpath", action="append", type=pythonpath_entry, default=[],
                        metavar="KEY=PATH",
                        help="a PYTHONPATH entry for the kernels of KEY (flashinfer-0.6, "
                             "flashinfer-0.7), repeatable; a kernel whose KEY is not given is a "
                             "row saying so")
    parser.add_argument("--adapter-args", action="append", type=pythonpath_entry, default=[],
                        metavar="KERNEL=ARGS",
                        help="more arguments for a kernel's adapter, e.g. "
                             "flashmla-dense-fp8='--flashmla-module /tmp/x.so' (repeatable)")
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--dumps", nargs="*", default=[],
                        help="dumps to check instead of datasets/*.h5 (the synth traces are "
                             "checked too unless --no-synth)")
    parser.add_argument("--no-synth", action="store_true", help="skip the synth traces")
    parser.add_argument("--no-bench", action="store_true", help="skip kvaudit bench --peer")
    parser.add_argument("--write", default="kvdump", choices=("server", "saturate", "kvdump"),
                        help="the exec adapters' write of each step's rows (default kvdump: "
                             "kvdump v1's exact rule, so that the pool every kernel reads is the "
                             "reference's; none of the peer kernels writes the cache itself)")
    parser.add_argument("--deadline", type=int, default=0, metavar="SECONDS",
                        help="start no run after this many seconds (0: none); later runs are "
                             "rows saying so")
    parser.add_argument("--jobs", type=int, default=4, help="checks run at once (default 4)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per kvaudit run")
    parser.add_argument("--work", default=os.path.join(REPO, "build", "kernels-table"))
    parser.add_argument("--out", default=os.path.join(REPO, "reports", "kernels-h200"),
                        help="output path without extension (.md and .json are written)")
    parser.add_argument("--merge-with", metavar="JSON",
                        help="an earlier table whose rows of the kernels not run now are kept "
                             "(marked as that run's)")
    parser.add_argument("--render-only", metavar="JSON",
                        help="re-render the Markdown of a saved table and print it")
    options = parser.parse_args(argv)
    options.pythonpath = dict(options.pythonpath)
    options.adapter_args = dict(options.adapter_args)
    options.started = time.time()
    return options


def main(argv=None):
    options = parse_args(argv)
    if options.render_only:
        with open(options.render_only, encoding="utf-8") as f:
            sys.stdout.write(render_markdown(json.load(f)))
        return 0
    table = run_all(options)
    if options.merge_with:
        with open(options.merge_with, encoding="utf-8") as f:
            table = merge_earlier(table, json.load(f), options.kernels)
    save(table, options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
