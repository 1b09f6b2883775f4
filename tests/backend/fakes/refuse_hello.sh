#!/bin/sh
# A backend that refuses every run at hello, as a GPU adapter does on a machine without a GPU
# (docs/backend-protocol.md "hello"): it reads the hello, replies with an `unsupported` error and
# exits 2. For tests/backend/test_exec_backend.cpp.
read -r hello
printf '%s\n' '{"type": "error", "kind": "unsupported", "message": "FP8 MLA needs an SM90 GPU (fake)"}'
exit 2
