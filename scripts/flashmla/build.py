"""JIT-build FlashMLA's sm90a sparse FP8 decode kernel (subset) as a torch extension.

Called by build.sh.  Compiles only:
  sparse_decode_sm90_only.cpp (here)                         (binding; ours, reuses FlashMLA api/sparse_decode.h)
  csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu   (V3.2 layout, h_q=64)
  csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu  (V3.2 layout, h_q=128)
  csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu (tile-scheduler metadata)
  csrc/smxx/decode/combine/combine.cu                        (split-KV combine)
(+ the two MODEL1 instantiations when FLASHMLA_WITH_MODEL1=1).

Env:
  FLASHMLA_BUILD_DIR   build directory (default /tmp/flashmla_sm90_build; kept outside the
                       repo so that `carry` of .gpu/flashmla does not clobber it)
  FLASHMLA_WITH_MODEL1 also build the MODEL1 (d_qk=512) kernels
  MAX_JOBS             parallel compile jobs (build.sh sets it to nproc)
"""
import os
import sys
import time

t_start = time.time()
import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
# FLASHMLA_SRC: a checkout of deepseek-ai/FlashMLA (checked at 9241ae3e) with its cutlass
# submodule; only its csrc/ is read. The binding is ours (sparse_decode_sm90_only.cpp, here).
SRC = os.environ.get("FLASHMLA_SRC", "")
if not SRC or not os.path.isdir(os.path.join(SRC, "csrc")):
    sys.exit("build.py: set FLASHMLA_SRC to a FlashMLA checkout (with csrc/cutlass)")
CSRC = os.path.join(SRC, "csrc")
BUILD_DIR = os.environ.get("FLASHMLA_BUILD_DIR", "/tmp/flashmla_sm90_build")
WITH_MODEL1 = os.environ.get("FLASHMLA_WITH_MODEL1", "0").lower() in ("1", "true", "yes", "y")
NAME = "flashmla_sparse_sm90_m1" if WITH_MODEL1 else "flashmla_sparse_sm90"

sources = [
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
]
if WITH_MODEL1:
    sources += [
        "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
        "sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
    ]
sources = [os.path.join(HERE, "sparse_decode_sm90_only.cpp")] + [os.path.join(CSRC, s)
                                                                 for s in sources]

include_dirs = [
    CSRC,
    os.path.join(CSRC, "kerutils", "include"),
    os.path.join(CSRC, "sm90"),
    os.path.join(CSRC, "cutlass", "include"),
]

feature_defs = ["-DFLASHMLA_WITH_MODEL1"] if WITH_MODEL1 else []

# Host flags: same as FlashMLA's setup.py (c++20 comes after torch's -std=c++17, so it wins).
cxx_flags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"] + feature_defs

# nvcc flags: FlashMLA's setup.py minus -lineinfo/--source-in-ptx and the sm100 target.
nvcc_flags = [
    "-O3",
    "-std=c++20",
    "-DNDEBUG",
    "-D_USE_MATH_DEFINES",
    "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills",
    # Contains 'arch', so torch adds no TORCH_CUDA_ARCH_LIST flags of its own.
    "-gencode", "arch=compute_90a,code=sm_90a",
] + feature_defs

os.makedirs(BUILD_DIR, exist_ok=True)
print(f"[build.py] torch {torch.__version__} (cuda {torch.version.cuda}), CUDA_HOME={cpp_extension.CUDA_HOME}", flush=True)
print(f"[build.py] name={NAME} build_dir={BUILD_DIR} MAX_JOBS={os.environ.get('MAX_JOBS')}", flush=True)
print(f"[build.py] {len(sources)} sources", flush=True)

t0 = time.time()
mod = cpp_extension.load(
    name=NAME,
    sources=sources,
    extra_cflags=cxx_flags,
    extra_cuda_cflags=nvcc_flags,
    extra_include_paths=include_dirs,
    build_directory=BUILD_DIR,
    with_cuda=True,
    verbose=True,
)
t1 = time.time()
print(f"[build.py] cpp_extension.load (compile+link+import): {t1 - t0:.1f} s", flush=True)

# Per-target compile times from ninja's log (start_ms end_ms mtime target hash).
log = os.path.join(BUILD_DIR, ".ninja_log")
if os.path.exists(log):
    rows = {}
    with open(log) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) >= 4:
                rows[parts[3]] = (int(parts[0]), int(parts[1]))  # last entry per target wins
    for tgt, (s, e) in sorted(rows.items(), key=lambda kv: kv[1][0]):
        print(f"[build.py]   {tgt:45s} {(e - s) / 1000:7.1f} s  (started at +{s / 1000:.1f} s)")

so_path = os.path.join(BUILD_DIR, NAME + ".so")
print(f"[build.py] built {so_path} ({os.path.getsize(so_path) / 1e6:.1f} MB); has sparse_decode_fwd: {hasattr(mod, 'sparse_decode_fwd')}")
print(f"[build.py] total incl. torch import: {time.time() - t_start:.1f} s", flush=True)
