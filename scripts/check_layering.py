#!/usr/bin/env python3
"""Checks that #include dependencies follow kvaudit's pipeline, from the command line down to the
codec, and that no file includes itself through a chain (a cycle).

    core  <-  kernels (device code and the pure CPU model of its arithmetic: core only)
    core  <-  format  <-  backend (format, kernels: adapts the kernels to dumps)
                  ^  \\<-  references
                  |  \\<-  verdict
    replay (references, verdict, backend)  <-  report  <-  cli
    tools (kernels, backend, references, verdict)        <-  cli

A folder may include itself and the folders listed for it in ALLOWED, nothing else. Prints every
offending include as FILE:LINE: includes PATH (stage -> stage) and exits 1; exits 0 when clean.
Run from anywhere: paths are taken relative to the repository root (this file's parent folder),
or to the folder given as the only argument.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else __file__).resolve()
if len(sys.argv) <= 1:
    ROOT = ROOT.parent.parent

# stage -> the stages it may include (besides itself)
ALLOWED = {
    "core": set(),
    "format": {"core"},
    "backend": {"core", "format", "kernels"},
    "references": {"core", "format"},
    "kernels": {"core"},
    "verdict": {"core", "format"},
    "replay": {"core", "format", "backend", "references", "verdict"},
    "report": {"core", "format", "backend", "verdict", "replay"},
    "tools": {"core", "format", "backend", "references", "kernels", "verdict"},
    "cli": {"core", "format", "backend", "references", "kernels", "verdict", "replay", "report",
            "tools"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCES = ("*.hpp", "*.cpp", "*.cuh", "*.cu")


def stage_of(path: str):
    parts = path.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] in ("kernels", "references"):
        return parts[0]
    return None


def source_files():
    for top in ("src", "kernels", "references"):
        for pattern in SOURCES:
            yield from (ROOT / top).rglob(pattern)


def main() -> int:
    problems = []
    graph = {}
    for file in sorted(source_files()):
        rel = file.relative_to(ROOT).as_posix()
        stage = stage_of(rel)
        if stage not in ALLOWED:
            problems.append(f"{rel}: not in a known stage (src/<stage>/, kernels/, references/)")
            continue
        graph[rel] = []
        for number, line in enumerate(file.read_text().splitlines(), 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            target = match.group(1)
            graph[rel].append(target)
            target_stage = stage_of(target)
            if target_stage is None or target_stage == stage:
                continue
            if target_stage not in ALLOWED[stage]:
                problems.append(f"{rel}:{number}: includes {target} ({stage} -> {target_stage})")
    problems += find_cycles(graph)
    for problem in problems:
        print(problem)
    print(f"layering: {len(graph)} files, {len(problems)} problem(s)")
    return 1 if problems else 0


def find_cycles(graph):
    """Include cycles between files, each reported once by its chain."""
    state, cycles = {}, []

    def visit(node, chain):
        state[node] = "open"
        for target in graph.get(node, []):
            if state.get(target) == "open":
                cycle = chain[chain.index(target):] + [target] if target in chain else [node, target]
                cycles.append("include cycle: " + " -> ".join(cycle))
            elif target in graph and target not in state:
                visit(target, chain + [target])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    return cycles


if __name__ == "__main__":
    sys.exit(main())
