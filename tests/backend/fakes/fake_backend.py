#!/usr/bin/env python3
"""A misbehaving external backend for kvaudit's exec tests (tests/backend/test_exec_backend.cpp).

    fake_backend.py MODE KVAUDIT [--pidfile FILE]

A proxy in front of `KVAUDIT backend-serve cpu-fp8` (a correct backend): every request goes to it
and every reply comes back, except at step 1 (index 1) of the first layer, where MODE breaks the
protocol or the pool the way a faulty program would (docs/backend-protocol.md):

  crash           exits with status 3 instead of replying
  garbage         replies with a line that is not JSON
  wrong-out-size  leaves out.bin two bytes short
  missing-out     deletes out.bin
  error-internal  replies {"type": "error", "kind": "internal", ...}
  storage-bf16    converts its pool to bf16 (pool_bf16.bin, e4m3 values as bf16 bits) and says so
                  in the reply; then requires that the next step of that layer, and only it,
                  comes with pool_reloaded: true (exits 4 otherwise, naming what it got)
  wrong-slot      moves the first written row that has a free neighbour one slot up (the
                  written slot keeps its old row, the neighbour gets the new one); the served
                  backend is told to re-read its pool at the next step, so the damage stays, as it
                  would in a program whose own write went astray
  sleep           writes its pid to --pidfile and sleeps for ten minutes
  clean           nothing: the proxy alone (it must not change any result)
  diagnose-tiles  the hello reply's describe says "diagnose_tiles": "48x3" (the KV tile and split
                  count p-e4m3-tile replays for this kernel); nothing else changes
  diagnose-tiles-bad  the same with "0x3", which is not a tile

Python standard library only: kvaudit's tests run it with any python3.
"""

import json
import os
import struct
import subprocess
import sys
import time

MODES = ("crash", "garbage", "wrong-out-size", "missing-out", "error-internal", "storage-bf16",
         "wrong-slot", "sleep", "clean", "diagnose-tiles", "diagnose-tiles-bad")
DIAGNOSE_TILES = {"diagnose-tiles": "48x3", "diagnose-tiles-bad": "0x3"}


def e4m3_value(code):
    """The value of an e4m3fn code (NaN for 0x7F / 0xFF)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8.0 * 2.0 ** -6
    return sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)


def bf16_bits(value):
    """bf16 bits of a value that is one (every e4m3 value is): the high half of its float32."""
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


class Proxy:
    def __init__(self, mode, kvaudit, pidfile):
        self.mode, self.pidfile = mode, pidfile
        self.real = subprocess.Popen([kvaudit, "backend-serve", "cpu-fp8", "--threads", "1"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.session = None
        self.first_layer = None
        self.pools = {}  # layer group -> pool descriptor
        self.expect_reload = None  # layer group whose next step must say pool_reloaded
        self.damaged = None  # layer group whose pool file the proxy changed behind the server

    def forward(self, line):
        self.real.stdin.write(line)
        self.real.stdin.flush()
        return json.loads(self.real.stdout.readline())

    def path(self, descriptor):
        return os.path.join(self.session, descriptor["file"])

    @staticmethod
    def send(message):
        text = message if isinstance(message, str) else json.dumps(message)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def check_reload(self, request):
        group = request["layer"]["group"]
        wanted = self.expect_reload == group
        if request.get("pool_reloaded") is not wanted:
            sys.stderr.write(f"fake_backend: step {request['step']['index']} of {group} came with "
                             f"pool_reloaded {request.get('pool_reloaded')}, expected {wanted}\n")
            sys.exit(4)
        if wanted:
            self.expect_reload = None

    def before_step(self, request):
        """What MODE does instead of forwarding the step (True: the step is answered)."""
        if self.mode == "crash":
            sys.exit(3)
        if self.mode == "garbage":
            self.send("this is not a reply")
            return True
        if self.mode == "error-internal":
            self.send({"type": "error", "kind": "internal", "message": "CUDA error (fake)"})
            return True
        if self.mode == "sleep":
            with open(self.pidfile, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        return False

    def to_bf16(self, request, reply):
        pool = self.pools[request["layer"]["group"]]
        with open(self.path(pool), "rb") as f:
            codes = f.read()
        values = [bf16_bits(e4m3_value(c)) for c in range(256)]
        with open(os.path.join(self.session, "pool_bf16.bin"), "wb") as f:
            f.write(b"".join(struct.pack("<H", values[c]) for c in codes))
        reply["pool"] = {"file": "pool_bf16.bin", "dtype": "bfloat16", "shape": pool["shape"]}
        self.expect_reload = request["layer"]["group"]

    def move_row(self, request, before):
        pool = self.pools[request["layer"]["group"]]
        num_slots, width = pool["shape"]
        with open(self.path(pool), "r+b") as f:
            for slot, old_row in before.items():
                f.seek(slot * width)
                new_row = f.read(width)
                f.seek(slot * width)
                f.write(old_row)
                f.write(new_row)  # into slot + 1
                return

    def written_slots(self, request):
        descriptor = request["inputs"]["new_kv_slots"]
        with open(self.path(descriptor), "rb") as f:
            data = f.read()
        return list(struct.unpack(f"<{len(data) // 4}i", data))

    def rows_before(self, request):
        """For wrong-slot: the old row of the first written slot whose upper neighbour is free."""
        pool = self.pools[request["layer"]["group"]]
        num_slots, width = pool["shape"]
        slots = self.written_slots(request)
        for slot in slots:
            if slot + 1 < num_slots and slot + 1 not in slots:
                with open(self.path(pool), "rb") as f:
                    f.seek(slot * width)
                    return {slot: f.read(width)}
        return {}

    def after_step(self, request, reply, before):
        if self.mode == "wrong-out-size":
            out = self.path(request["outputs"]["out"])
            os.truncate(out, os.path.getsize(out) - 2)
        elif self.mode == "missing-out":
            os.remove(self.path(request["outputs"]["out"]))
        elif self.mode == "storage-bf16":
            self.to_bf16(request, reply)
        elif self.mode == "wrong-slot":
            self.move_row(request, before)
            self.damaged = request["layer"]["group"]

    def step(self, line, request):
        if self.mode == "storage-bf16":
            self.check_reload(request)
        if self.damaged == request["layer"]["group"]:
            self.damaged = None
            request["pool_reloaded"] = True  # the served backend re-reads the damaged pool file
            line = (json.dumps(request) + "\n").encode()
        target = request["step"]["index"] == 1 and request["layer"]["group"] == self.first_layer
        if target and self.before_step(request):
            return
        before = self.rows_before(request) if target and self.mode == "wrong-slot" else {}
        reply = self.forward(line)
        if target and reply.get("type") == "result":
            self.after_step(request, reply, before)
        self.send(reply)

    def run(self):
        for line in sys.stdin.buffer:
            request = json.loads(line)
            kind = request.get("type")
            if kind == "hello":
                self.session = request["session_dir"]
            elif kind == "layer":
                self.first_layer = self.first_layer or request["layer"]["group"]
                self.pools[request["layer"]["group"]] = request["pool"]
            if kind == "step":
                self.step(line, request)
                continue
            reply = self.forward(line)
            if kind == "hello" and self.mode in DIAGNOSE_TILES:
                reply.setdefault("describe", {})["diagnose_tiles"] = DIAGNOSE_TILES[self.mode]
            self.send(reply)
            if kind == "bye":
                return 0
        return 0


def main():
    mode, kvaudit = sys.argv[1], sys.argv[2]
    if mode not in MODES:
        sys.stderr.write(f"fake_backend: unknown mode {mode} (one of {', '.join(MODES)})\n")
        return 2
    pidfile = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--pidfile" else None
    return Proxy(mode, kvaudit, pidfile).run()


if __name__ == "__main__":
    sys.exit(main())
