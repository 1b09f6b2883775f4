#!/usr/bin/env python3
"""Compares two kvaudit report.json files in everything but what may differ between two runs of the
same check: `timing`, `provenance` (a merged report's names its parts), the dump's `path`
(`dump.sha256` is compared) and the checksum value (a sign-off's `signoff.digest`, a plain
report's `checksum`: it covers the provenance; who signed is compared). Verdict, counts, backend, policy, dump summary, results in order,
integrity findings, steps, notes and first divergence must be equal.

    python3 scripts/same_report.py A.json B.json

Prints nothing and exits 0 when they are the same; otherwise prints, per top-level key that
differs, the first JSON pointer where the two differ and both values, and exits 1. Exit 2 when a
file cannot be read. Used by the Slurm test (scripts/slurm/test-slurm-array.sh) to compare the
merged report of a sharded check with the unsharded one. Standard library only.
"""
import json
import sys

IGNORED = ("timing", "provenance")


def comparable(report):
    report = {key: value for key, value in report.items() if key not in IGNORED}
    if isinstance(report.get("dump"), dict):
        report["dump"] = {key: value for key, value in report["dump"].items() if key != "path"}
    if isinstance(report.get("checksum"), dict):
        report["checksum"] = {key: value for key, value in report["checksum"].items()
                              if key != "value"}
    signoff = report.get("signoff")
    if isinstance(signoff, dict) and isinstance(signoff.get("digest"), dict):
        digest = {key: value for key, value in signoff["digest"].items() if key != "value"}
        report["signoff"] = dict(signoff, digest=digest)
    return report


def first_difference(a, b, pointer):
    """The JSON pointer of the first place a and b differ, with both values; None if equal."""
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return pointer, a, b
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{pointer}/{key}", a.get(key, "<absent>"), b.get(key, "<absent>")
            found = first_difference(a[key], b[key], f"{pointer}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{pointer}/{index}")
            if found:
                return found
        if len(a) != len(b):
            return f"{pointer} (length)", len(a), len(b)
        return None
    return None if a == b else (pointer, a, b)


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: same_report.py A.json B.json", file=sys.stderr)
        return 2
    try:
        reports = [comparable(json.load(open(path))) for path in argv[1:3]]
    except (OSError, ValueError) as error:
        print(f"same_report.py: {error}", file=sys.stderr)
        return 2
    a, b = reports
    differences = 0
    for key in sorted(set(a) | set(b)):
        found = first_difference(a.get(key, "<absent>"), b.get(key, "<absent>"), f"/{key}")
        if found:
            differences += 1
            pointer, x, y = found
            print(f"differs at {pointer}: {json.dumps(x)[:200]} vs {json.dumps(y)[:200]}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
