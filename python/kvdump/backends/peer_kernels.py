"""Peer Triton kernel files (vLLM's and SGLang's MLA decode), loaded unmodified from a file.

The upstream files are not part of this repository: scripts/fetch-peer-kernels.sh extracts each
one (and its package's LICENSE, Apache-2.0) from the release wheel on PyPI into
build/peer-kernels/PACKAGE-VERSION/, which is where the adapters look by default
(--kernel-file FILE, or the folder $KVAUDIT_PEER_KERNELS, say otherwise). The file is imported as
it is: its few imports of its own package (vllm.platforms, vllm.triton_utils;
sglang.srt.utils, sglang.srt.environ, sglang.kernels.ops.attention.score_mod) are answered by
small stand-ins placed in sys.modules for the duration of the import only (stub_modules below),
so nothing of the file is edited and its sha256 is the release's. A file whose sha256 differs
from the pinned one still loads; `describe` then says so.
"""

import hashlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass

from .protocol import unsupported


@dataclass(frozen=True)
class PeerKernel:
    package: str  # PyPI name
    version: str  # release
    commit: str  # upstream commit of the release, as the wheel records it
    upstream_path: str  # the file's path in the upstream repository
    wheel_path: str  # the file's path inside the wheel
    sha256: str  # of the file as the release wheel ships it
    entry: str  # the function the adapter calls

    @property
    def file_name(self):
        return os.path.basename(self.wheel_path)

    @property
    def folder(self):
        return f"{self.package}-{self.version}"


VLLM = PeerKernel(
    package="vllm", version="0.34.0",
    commit="62d4bc3c7 (vllm-0.34.0 wheel, vllm/_version.py commit_id g62d4bc3c7)",
    upstream_path="vllm/v1/attention/ops/triton_decode_attention.py",
    wheel_path="vllm/v1/attention/ops/triton_decode_attention.py",
    sha256="c7915ed5afb74e3c56d877791a86850985149dddf37384da6146bfc4eb46f479",
    entry="decode_attention_fwd(..., k_scale, v_scale, is_mla=True)")

SGLANG = PeerKernel(
    package="sglang", version="0.5.23",
    commit="tag v0.5.23 (the sglang-0.5.23 wheel records no commit: sglang/_version.py "
           "commit_id None)",
    upstream_path="python/sglang/kernels/ops/attention/decode_attention.py",
    wheel_path="sglang/kernels/ops/attention/decode_attention.py",
    sha256="7a3b66ce3daabbb027efd860411cd9abe4b399b1f2cfc3ed5c6c01731eb9fa0a",
    entry="decode_attention_fwd(..., sm_scale, k_scale, v_scale, has_mla=True, page_size=P)")


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def kernel_file(peer, explicit):
    """The path of the peer's file: --kernel-file, else $KVAUDIT_PEER_KERNELS or
    build/peer-kernels (relative to the working directory), PACKAGE-VERSION/FILE."""
    if explicit:
        candidates = [explicit]
    else:
        roots = [os.environ.get("KVAUDIT_PEER_KERNELS") or "",
                 os.path.join("build", "peer-kernels")]
        candidates = [os.path.join(r, peer.folder, peer.file_name) for r in roots if r]
    for path in candidates:
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise unsupported(f"{peer.package} {peer.version}: no kernel file {peer.file_name} at "
                      f"{' or '.join(candidates)}; get it with scripts/fetch-peer-kernels.sh "
                      f"(from the {peer.package}=={peer.version} wheel) or pass --kernel-file")


def provenance(peer, path):
    actual = sha256_of(path)
    return {"package": peer.package, "version": peer.version, "upstream_commit": peer.commit,
            "upstream_path": peer.upstream_path, "file": path, "sha256": actual,
            "sha256_matches_release": actual == peer.sha256, "entry_point": peer.entry,
            "changes": "none: loaded unmodified, its own-package imports answered by stand-ins "
                       "(kvdump/backends/peer_kernels.py stub_modules)"}


def module(name, **attributes):
    result = types.ModuleType(name)
    result.__dict__.update(attributes)
    return result


class EnvFlag:
    """Stands in for one of SGLang's envs entries: .get() gives its default."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def cuda_core_count(torch):
    def count(device_index=0):
        if not torch.cuda.is_available():
            return 0
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return count


def stub_modules(peer, torch, triton):
    """{module name: stand-in} for the peer file's imports of its own package. All say: an
    NVIDIA (CUDA) platform, not ROCm, no tuning switches set (their defaults)."""
    if peer is VLLM:
        platform = types.SimpleNamespace(is_rocm=lambda: False)
        return {**packaging_stand_in(), "vllm": module("vllm"),
                "vllm.platforms": module("vllm.platforms", current_platform=platform),
                "vllm.triton_utils": module("vllm.triton_utils", tl=triton.language,
                                            triton=triton)}
    envs = types.SimpleNamespace(SGLANG_MLA_DECODE_TUNE=EnvFlag(False),
                                 SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS=EnvFlag(False),
                                 SGLANG_FORCE_LEAN_GRID_CU_MULT=EnvFlag(1.0))

    def unpack_aux_tensors(score_mod, aux_tensors):
        if score_mod is not None:
            raise ValueError("score_mod is not used by the kvaudit adapter")
        return None, 0, 0, 0

    return {"sglang": module("sglang"), "sglang.srt": module("sglang.srt"),
            "sglang.srt.environ": module("sglang.srt.environ", envs=envs),
            "sglang.srt.utils": module("sglang.srt.utils",
                                       get_device_core_count=cuda_core_count(torch),
                                       is_gfx95_supported=lambda: False,
                                       is_gfx1250_supported=lambda: False,
                                       is_hip=lambda: False),
            "sglang.kernels": module("sglang.kernels"),
            "sglang.kernels.ops": module("sglang.kernels.ops"),
            "sglang.kernels.ops.attention": module("sglang.kernels.ops.attention"),
            "sglang.kernels.ops.attention.score_mod": module(
                "sglang.kernels.ops.attention.score_mod", unpack_aux_tensors=unpack_aux_tensors)}


def release_tuple(text):
    """(3, 6, 0) of '3.6.0+git...': the numeric release part, for comparisons."""
    parts = []
    for word in text.split("+")[0].split("."):
        digits = "".join(c for c in word if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def packaging_stand_in():
    """{} when `packaging` is importable; else a stand-in for `packaging.version.parse`, the one
    use vLLM's file makes of it (a version comparison deciding whether to log a warning)."""
    try:
        import packaging.version  # noqa: F401
        return {}
    except ImportError:
        version = module("packaging.version", parse=release_tuple)
        return {"packaging": module("packaging", version=version), "packaging.version": version}


def load(peer, path, torch):
    """The peer's module, imported from `path` with the stand-ins in place during the import."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as error:
        raise unsupported(f"{peer.package} Triton kernel: triton is not importable ({error})")
    stubs = stub_modules(peer, torch, triton)
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        name = f"kvdump_peer_{peer.package}_{peer.file_name[:-3]}"
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # triton.jit finds its source through the module
        spec.loader.exec_module(loaded)
    except Exception as error:  # noqa: BLE001 - any import failure is a refusal naming it
        raise unsupported(f"{peer.package} {peer.version}: importing {path} failed: "
                          f"{type(error).__name__}: {error}") from None
    finally:
        for stub_name, previous in saved.items():
            if previous is None:
                sys.modules.pop(stub_name, None)
            else:
                sys.modules[stub_name] = previous
    return loaded
