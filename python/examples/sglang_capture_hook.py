"""EXAMPLE sitecustomize.py: capture MLA attention in an SGLang server into a kvdump v1 file.

The capture itself is kvdump.sglang_capture (docs/sglang-capture.md: flags, supported SGLang
releases and models, what is recorded, the file:line mapping). SGLang runs the model in worker
processes it starts itself; Python imports a `sitecustomize` module in every process, so copy this
file as sitecustomize.py into a folder on PYTHONPATH, next to kvaudit's python/ folder:

    mkdir -p /tmp/kvhook && cp python/examples/sglang_capture_hook.py /tmp/kvhook/sitecustomize.py
    export PYTHONPATH=/tmp/kvhook:$PWD/python:$PYTHONPATH
    export KVDUMP_SGLANG_LAYERS=3 KVDUMP_SGLANG_PATH=/tmp/r1_L{layer}_rank{rank}.h5
    python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-R1 --tp 8 \
        --attention-backend flashinfer --flashinfer-mla-disable-ragged \
        --kv-cache-dtype fp8_e4m3 --disable-cuda-graph
    kvaudit check /tmp/r1_L3_rank0.h5 --backend none

Without KVDUMP_SGLANG_LAYERS and KVDUMP_SGLANG_PATH it does nothing. With them, it patches
ModelRunner.load_model when SGLang imports it (nothing is imported before), and each worker then
records the layers after its model loads, or logs why it does not.
"""

try:
    from kvdump.sglang_capture import install_from_environment
except ImportError as error:  # kvaudit's python/ folder is not on PYTHONPATH
    import os
    import sys

    if os.environ.get("KVDUMP_SGLANG_LAYERS"):
        print(f"sitecustomize: kvdump capture not installed: {error}", file=sys.stderr)
else:
    install_from_environment()
