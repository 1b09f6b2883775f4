#!/usr/bin/env python3
"""A bench peer for kvaudit's tests (tests/tools/test_bench_peer.cpp): speaks the external backend
protocol's bench session (docs/backend-protocol.md "bench") without a GPU. Its "kernel" takes
10 us per request of the case (median_us = 10 * batch, min_us = 9 * batch) and it cannot run a
case with page_size 1 (an `unsupported` reply). It checks the requests it gets: a hello without
a model, bench requests with the fields the document lists (exit 3 naming what is missing).

Python standard library only.
"""

import json
import sys

CASE_KEYS = ("name", "kind", "batch", "context", "num_heads", "page_size", "pool_slots", "q_len",
             "kv_dtype")


def reply(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    for line in sys.stdin:
        request = json.loads(line)
        kind = request["type"]
        if kind == "hello":
            if "model" in request:
                sys.stderr.write("fake_peer: a bench session's hello has no model\n")
                return 3
            reply({"type": "hello", "version": 1, "capabilities": ["bench"],
                   "describe": {"library": "fake-peer 1.0"}})
        elif kind == "bench":
            case = request["case"]
            missing = [key for key in CASE_KEYS if key not in case]
            missing += [key for key in ("warmup", "iterations", "flush_l2") if key not in request]
            if missing:
                sys.stderr.write(f"fake_peer: bench request without {missing}\n")
                return 3
            if case["page_size"] == 1:
                reply({"type": "error", "kind": "unsupported", "message": "page_size 1 (fake)"})
            else:
                reply({"type": "bench", "median_us": 10.0 * case["batch"],
                       "min_us": 9.0 * case["batch"], "samples": request["iterations"],
                       "method": "fake"})
        elif kind == "bye":
            reply({"type": "bye"})
            return 0
        else:
            reply({"type": "error", "kind": "bad_input", "message": f"{kind}: not in a bench session"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
