"""JIT-build FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8, FlashMLA PR 54) as a torch
extension, for the flashmla-dense-fp8 adapter. Called by build_dense_fp8.sh.

Compiles only the three files of csrc/extension/sm90/dense_fp8 that the kernel needs:
  pybind.cpp                   FlashMLA's own binding of this kernel alone (fwd_kvcache_mla_fp8,
                               get_mla_decoding_metadata_dense_fp8; enabled by -DNO_PYBIND11=1
                               as in FlashMLA's setup.py): it pulls in no other kernel, so it is
                               used as it is
  flash_fwd_mla_fp8_sm90.cu    the kernel's one instantiation (e4m3 in, bf16 out, head 576)
  flash_fwd_mla_metadata.cu    the split-KV tile scheduler
Env:
  FLASHMLA_DENSE_SRC    the unpacked tarball of pack_dense_fp8.sh (flashmla-dense-fp8/)
  FLASHMLA_CUTLASS      cutlass (a folder holding include/) to compile with
  FLASHMLA_BUILD_DIR    build directory (default /tmp/flashmla_dense_fp8_build)
  MAX_JOBS              parallel compile jobs
"""
import os
import sys
import time

t_start = time.time()
import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

SRC = os.environ.get("FLASHMLA_DENSE_SRC", "")
KERNEL = os.path.join(SRC, "csrc", "extension", "sm90", "dense_fp8")
if not os.path.isdir(KERNEL):
    sys.exit(f"build_dense_fp8.py: FLASHMLA_DENSE_SRC={SRC!r} has no csrc/extension/sm90/dense_fp8")
CUTLASS = os.environ.get("FLASHMLA_CUTLASS", os.path.join(SRC, "cutlass"))
BUILD_DIR = os.environ.get("FLASHMLA_BUILD_DIR", "/tmp/flashmla_dense_fp8_build")
NAME = "flashmla_dense_fp8_sm90"

sources = [os.path.join(KERNEL, name) for name in
           ("pybind.cpp", "flash_fwd_mla_fp8_sm90.cu", "flash_fwd_mla_metadata.cu")]
include_dirs = [os.path.join(SRC, "csrc"), KERNEL, os.path.join(CUTLASS, "include")]
# CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc finds by itself but the host
# compiler of pybind.cpp (it includes cutlass headers) does not.
CCCL = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "include", "cccl")
if os.path.isdir(CCCL):
    include_dirs.append(CCCL)

# FlashMLA's setup.py flags for this extension (C++17, NO_PYBIND11=1), sm90a only, without
# -lineinfo and the sm100 target; the host compiler gets C++20, which recent PyTorch headers
# require (pybind.cpp is the only file that includes them; it comes after torch's own -std).
cxx_flags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations", "-DNO_PYBIND11=1"]
nvcc_flags = [
    "-O3", "-std=c++17", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "--ptxas-options=-v,--register-usage-level=10", "-DNO_PYBIND11=1",
    "-gencode", "arch=compute_90a,code=sm_90a",  # has 'arch': torch adds no arch flags
]

os.makedirs(BUILD_DIR, exist_ok=True)
print(f"[build_dense_fp8.py] torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"cutlass {CUTLASS}, build_dir {BUILD_DIR}, MAX_JOBS {os.environ.get('MAX_JOBS')}",
      flush=True)
t0 = time.time()
module = cpp_extension.load(name=NAME, sources=sources, extra_cflags=cxx_flags,
                            extra_cuda_cflags=nvcc_flags, extra_include_paths=include_dirs,
                            build_directory=BUILD_DIR, with_cuda=True, verbose=True)
so_path = os.path.join(BUILD_DIR, NAME + ".so")
print(f"[build_dense_fp8.py] cpp_extension.load: {time.time() - t0:.1f} s; built {so_path} "
      f"({os.path.getsize(so_path) / 1e6:.1f} MB); entry points: "
      f"{[n for n in ('fwd_kvcache_mla_fp8', 'get_mla_decoding_metadata_dense_fp8') if hasattr(module, n)]}; "
      f"total {time.time() - t_start:.1f} s", flush=True)
