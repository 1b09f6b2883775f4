#!/usr/bin/python3
"""Holds report.json to its schema, docs/report.schema.json (ctest -R report_schema).

    check_report_schema.py SOURCE_DIR [--kvaudit BIN --tmp DIR]

1. The schema is a valid JSON Schema (draft 2020-12).
2. Every committed report.json (`git ls-files`, else every report.json under reports/ and tests/)
   validates against it.
3. The schema can fail: a committed report with a required key removed, with a value of the
   wrong type, and with an unknown key must each be refused (a schema that accepts anything would
   pass step 2).
4. The prose document agrees: every key the schema names appears in docs/report-schema.md (as
   `key`, or "key" in a JSON-like listing), and the document names the schema file as the authority.
5. With --kvaudit, fresh reports from this build validate: `kvaudit check` of shipped dumps (a
   passing sign-off run, a run with unmeasured sites, a failing kernel with its first divergence
   and diagnosis), a shard's part (--shard I/N --json, with
   its `shard` block) and the `kvaudit merge` of two parts, so that a key the writer gains or
   changes without the schema fails here.
Exits 0 when all hold, 1 naming every failure. Needs python3-jsonschema (scripts/setup.sh tests).
"""
import argparse
import copy
import json
import pathlib
import shutil
import subprocess
import sys

SCHEMA = "docs/report.schema.json"
PROSE = "docs/report-schema.md"


def committed_reports(source):
    try:
        listed = subprocess.run(["git", "-C", str(source), "ls-files", "*report.json"],
                                check=True, capture_output=True, text=True).stdout.split()
        files = [source / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:  # not a git checkout: every report.json under reports/ and tests/
        files = sorted(p for d in ("reports", "tests") for p in (source / d).rglob("report.json"))
    return files


def errors_of(validator, document):
    return sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))


def describe(error):
    return "/" + "/".join(str(p) for p in error.absolute_path) + ": " + error.message[:200]


def validate_files(validator, files, failures):
    for path in files:
        found = errors_of(validator, json.loads(path.read_text()))
        for error in found[:5]:
            failures.append(f"{path}: {describe(error)}")
        print(f"{'ok' if not found else 'INVALID'}: {path}")


# Each planted error, and a check that the schema refuses it.
def planted_errors(report):
    missing = copy.deepcopy(report)
    del missing["verdict"]
    wrong_type = copy.deepcopy(report)
    wrong_type["counts"]["failed"] = "0"
    unknown = copy.deepcopy(report)
    unknown["timing"]["wall_seconds"] = 1.0
    return [("a required key removed (/verdict)", missing),
            ("a value of the wrong type (/counts/failed a string)", wrong_type),
            ("an unknown key (/timing/wall_seconds)", unknown)]


def check_schema_can_fail(validator, sample, failures):
    for what, document in planted_errors(json.loads(sample.read_text())):
        found = errors_of(validator, document)
        if not found:
            failures.append(f"the schema accepts {what} in {sample}")
        else:
            print(f"refused as expected: {what}: {describe(found[0])}")


def schema_keys(node, keys):
    if isinstance(node, dict):
        keys.update(node.get("properties", {}))
        for value in node.values():
            schema_keys(value, keys)
    elif isinstance(node, list):
        for value in node:
            schema_keys(value, keys)
    return keys


def check_prose(source, schema, failures):
    prose = (source / PROSE).read_text()
    for key in sorted(schema_keys(schema, set())):
        if f"`{key}`" not in prose and f'"{key}"' not in prose:
            failures.append(f"{PROSE} does not name the key `{key}` of {SCHEMA}")
    if SCHEMA.split("/")[-1] not in prose:
        failures.append(f"{PROSE} does not point to {SCHEMA}")


# Runs a command; an unexpected exit status is a failure (and the rest still runs, so that a
# report the reader refuses is also validated against the schema).
def run(command, expect, failures):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode not in expect:
        failures.append(f"{' '.join(command)}: exit {result.returncode}\n{result.stderr[-2000:]}")


def fresh_reports(source, kvaudit, tmp, failures):
    shutil.rmtree(tmp, ignore_errors=True)  # nothing left from an earlier run
    tmp.mkdir(parents=True)
    datasets = source / "datasets"
    run([kvaudit, "keygen", "--out", str(tmp / "key")], {0}, failures)
    signoff = ["--signoff", "--signed-by", "schema test", "--model", "GLM-5", "--signing-key",
               str(tmp / "key")]
    run([kvaudit, "check", str(datasets / "glm5_page1.h5"), "--threads", "2", *signoff,
         "--report", str(tmp / "glm5_page1")], {0}, failures)
    run([kvaudit, "check", str(datasets / "page64_nan.h5"), "--threads", "2", "--backend",
         "cpu-fp8", "--report", str(tmp / "page64_nan")], {0, 1}, failures)
    # A failing kernel (an injected scale mismatch): first divergence, diagnosis findings.
    run([kvaudit, "check", str(datasets / "glm5_page1.h5"), "--threads", "2", "--backend",
         "cpu-fp8", "--inject", "scale-mismatch", "--report", str(tmp / "scale_mismatch")], {1},
        failures)
    parts = []
    for index in range(2):
        part = tmp / f"part-{index}.json"
        run([kvaudit, "check", str(datasets / "saturated_page16.h5"), "--threads", "2",
             "--shard", f"{index}/2", "--json", str(part)], {0, 1}, failures)
        parts.append(str(part))
    run([kvaudit, "merge", *parts, "--json", str(tmp / "merged.json")], {0, 1}, failures)
    written = [tmp / "glm5_page1/report.json", tmp / "page64_nan/report.json",
               tmp / "scale_mismatch/report.json", *map(pathlib.Path, parts), tmp / "merged.json"]
    for path in written:
        if not path.exists():
            failures.append(f"{path}: not written by its command")
    return [path for path in written if path.exists()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path)
    parser.add_argument("--kvaudit", help="a kvaudit binary: also validate fresh reports")
    parser.add_argument("--tmp", type=pathlib.Path, help="where the fresh reports go")
    args = parser.parse_args()
    try:
        import jsonschema  # python3-jsonschema
    except ImportError:
        print("check_report_schema: python3-jsonschema is not installed "
              "(scripts/setup.sh tests installs it)", file=sys.stderr)
        return 1

    schema = json.loads((args.source / SCHEMA).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    failures = []
    committed = committed_reports(args.source)
    if not committed:
        failures.append("no committed report.json found")
    validate_files(validator, committed, failures)
    if committed:
        check_schema_can_fail(validator, committed[0], failures)
    check_prose(args.source, schema, failures)
    if args.kvaudit:
        fresh = fresh_reports(args.source, args.kvaudit, args.tmp, failures)
        validate_files(validator, fresh, failures)
    for failure in failures:
        print(f"check_report_schema: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
