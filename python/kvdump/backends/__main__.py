"""`python -m kvdump.backends NAME [options]`: serve one adapter over kvaudit's backend protocol
on standard input / output (docs/backend-protocol.md), until `bye` or the end of input.

kvaudit starts this command (`kvaudit check DUMP --backend exec:NAME --backend-command CMD`).
Standard output carries replies only: the real descriptor 1 is kept for them and descriptor 1 is
pointed at standard error, so that anything else that prints (a library, a compiler FlashInfer
runs) cannot corrupt the protocol. Exit status: 0 after bye; 2 when the hello cannot be read or
is refused (after an `unsupported` error reply naming what is missing), or for a usage error.
"""

import argparse
import os
import sys

from . import ADAPTERS, adapter_class
from .faults import FAULTS
from .protocol import Server
from .writes import WRITE_RULES

EPILOG = "planted faults (--fault, repeatable; for tests):\n" + "\n".join(
    f"  {name:19} {stage:8} {text}" for name, (stage, text) in FAULTS.items())


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m kvdump.backends",
        description="Serve an MLA kernel to kvaudit over its external-backend protocol "
                    "(docs/backend-protocol.md). `python -m kvdump.backends ADAPTER --help` "
                    "lists an adapter's options and the planted faults.")
    adapters = parser.add_subparsers(dest="adapter", metavar="ADAPTER", required=True)
    for name, (_, _, line) in ADAPTERS.items():
        sub = adapters.add_parser(name, help=line, description=line, epilog=EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_options(sub, name)
    return parser


def add_common_options(parser, adapter):
    flashinfer = adapter.startswith("flashinfer")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda[:N] (default: cuda when available, else cpu)"
                        if not flashinfer else "cuda[:N] (default cuda)")
    parser.add_argument("--write", choices=list(WRITE_RULES), default="server",
                        help="how new KV rows are written into the FP8 pool: server = PyTorch's "
                             "(new_kv / kv_scale).to(float8_e4m3fn) with new_kv in bf16, as "
                             "SGLang does it (default); saturate = the same clamped to +-448 "
                             "first; kvdump = kvdump v1's rule (fp32 division, RNE, satfinite)")
    parser.add_argument("--fault", action="append", choices=list(FAULTS), default=[],
                        metavar="FAULT", help="plant a wrong convention (list below)")
    if flashinfer:
        parser.add_argument("--flashinfer-backend", choices=("fa3", "fa2"), default="fa3",
                            help="FlashInfer's MLA backend (default fa3)")
    if adapter == "flashmla-sparse":
        parser.add_argument("--flashmla-module", default=None, metavar="FILE.so",
                            help="an extension built from FlashMLA's sources with "
                                 "sparse_decode_fwd (default: the installed flash_mla package)")
    if adapter == "flashmla-dense-fp8":
        add_flashmla_dense_options(parser)
    if adapter.endswith("triton-mla"):
        parser.add_argument("--kernel-file", default=None, metavar="FILE.py",
                            help="the peer's kernel file (default: $KVAUDIT_PEER_KERNELS or "
                                 "build/peer-kernels, PACKAGE-VERSION/FILE, as "
                                 "scripts/fetch-peer-kernels.sh puts it)")
        parser.add_argument("--num-kv-splits", type=positive_int, default=0, metavar="N",
                            help="KV splits of every entry (default: the server's own policy)")
        parser.add_argument("--triton-interpreter", action="store_true",
                            help="run the kernel on the CPU under Triton's interpreter "
                                 "(TRITON_INTERPRET=1, --device cpu), with its bf16 tl.dot and "
                                 "bf16 / fp8 roundings corrected (kvdump/backends/"
                                 "triton_interpreter.py); describe says so. Slow: a model of the "
                                 "GPU run for diagnosis, not a GPU result")
    if adapter == "vllm-triton-mla":
        parser.add_argument("--lse-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                            help="the lse buffer's dtype: bfloat16 as vLLM's TritonMLAImpl "
                                 "allocates it (q.dtype, default), or float32")
    if adapter == "flashinfer-cast-bf16":
        parser.add_argument("--cast-scale", choices=("none", "fold"), default="none",
                            help="none: the cast ignores kv_scale, as SGLang's did (default); "
                                 "fold: apply kv_scale outside the kernel")


def add_flashmla_dense_options(parser):
    parser.add_argument("--flashmla-module", required=True, metavar="FILE.so",
                        help="the extension scripts/flashmla/build_dense_fp8.sh builds (holds "
                             "fwd_kvcache_mla_fp8 and get_mla_decoding_metadata_dense_fp8)")
    parser.add_argument("--flashmla-caller", choices=("vllm", "sglang"), default="vllm",
                        help="whose call to copy: vllm = q * (1 / q_scale) clamped to +-448 then "
                             "e4m3, descale_q = q_scale, descale_k = kv_scale (default); sglang "
                             "= q.to(float8_e4m3fn), descale_q = descale_k = 1")
    parser.add_argument("--q-scale", type=float, default=1.0, metavar="S",
                        help="vLLM's per-tensor q_scale (1.0 unless the checkpoint has one)")
    parser.add_argument("--prefill", choices=("causal", "refuse"), default="causal",
                        help="causal: run a prefill step through the kernel's causal multi-row "
                             "path, requests grouped by rows (default); refuse: answer it "
                             "unsupported")
def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def reply_stream():
    """A binary stream on the real standard output; descriptor 1 then points at stderr."""
    sys.stdout.flush()
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(reply_fd, "wb", buffering=0)


def main(argv=None):
    options = build_parser().parse_args(argv)
    cls = adapter_class(options.adapter)
    server = Server(make_adapter=lambda: cls(options), requests=sys.stdin.buffer,
                    replies=reply_stream())
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
