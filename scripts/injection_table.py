#!/usr/bin/env python3
"""Render the injections.tsv that scripts/gpu-verify.sh writes as a Markdown table.

    python3 scripts/injection_table.py OUTDIR/injections.tsv > table.md

One row per (injection, dump): the exit status on each backend, the evidence cuda-fp8 printed
(the first integrity failure for a write fault, else the first divergence, else the verdict), and
whether cpu-fp8 printed the same line (backend names and the sign of a NaN aside).
"""
import csv
import re
import sys


def normalized(evidence):
    return re.sub(r"-nan\b", "nan", evidence.replace("cpu-fp8", "BACKEND").replace("cuda-fp8", "BACKEND"))


def main(path):
    rows = {}
    order = []
    with open(path, newline="") as handle:
        for record in csv.DictReader(handle, delimiter="\t"):
            key = (record["injection"], record["dump"])
            if key not in rows:
                order.append(key)
                rows[key] = {}
            rows[key][record["backend"]] = record
    print("| injection | dump | exit cpu-fp8 | exit cuda-fp8 | evidence (cuda-fp8) | cpu-fp8 printed |")
    print("| --- | --- | ---: | ---: | --- | --- |")
    for key in order:
        cpu, cuda = rows[key].get("cpu-fp8"), rows[key].get("cuda-fp8")
        if cpu is None or cuda is None:
            sys.exit(f"{path}: {key[0]} on {key[1]} lacks a backend")
        evidence = cuda["evidence"]
        shown = (evidence[:160] + "…" if len(evidence) > 160 else evidence).replace("|", "\\|")
        same = "the same" if normalized(cpu["evidence"]) == normalized(evidence) else cpu["evidence"][:160]
        print(f"| {key[0]} | {key[1]} | {cpu['exit']} | {cuda['exit']} | {shown} | {same} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: injection_table.py INJECTIONS_TSV")
    main(sys.argv[1])
