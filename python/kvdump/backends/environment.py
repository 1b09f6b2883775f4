"""What an adapter runs on, for hello's `describe`: library versions, device, driver and CUDA.

Also the optional imports every adapter needs, turned into `unsupported` errors that name what is
missing (never an ImportError traceback), and a probe of what PyTorch's float -> e4m3fn cast does
at the edges of the format on the adapter's device (it changed between PyTorch releases: older
ones give the NaN code past 464, newer ones saturate to 448), so that reports show which
behaviour the write path had.
"""

import importlib.metadata
import platform

import numpy as np

from .protocol import unsupported

TORCH_HINT = "pip install 'kvaudit-kvdump[torch]' (or any torch >= 2.1)"
FLASHINFER_HINT = "pip install flashinfer-python (0.6.18 and 0.7.4 were checked)"


def import_torch():
    try:
        import torch
    except ImportError as error:
        raise unsupported(f"torch is not installed ({error}); {TORCH_HINT}") from None
    except OSError as error:  # installed without its shared libraries
        raise unsupported(f"torch cannot be loaded ({error})") from None
    if not hasattr(torch, "float8_e4m3fn"):
        raise unsupported(f"torch {torch.__version__} has no float8_e4m3fn; {TORCH_HINT}")
    return torch


def import_flashinfer():
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401 - the wrapper lives here
    except ImportError as error:
        raise unsupported(f"flashinfer is not installed ({error}); {FLASHINFER_HINT}") from None
    except OSError as error:
        raise unsupported(f"flashinfer cannot be loaded ({error})") from None
    return flashinfer


def resolve_device(torch, requested):
    """torch.device for --device (None: cuda when available, else cpu)."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise unsupported(f"no CUDA device: torch {torch.__version__} (CUDA "
                          f"{torch.version.cuda or 'none'}) sees no GPU")
    return torch.device(requested)


def package_version():
    try:
        return importlib.metadata.version("kvaudit-kvdump")
    except importlib.metadata.PackageNotFoundError:
        return "source tree (not installed)"


def driver_version():
    """The NVIDIA kernel driver's version from /proc, or None."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            words = f.readline().split()
    except OSError:
        return None
    numbers = [w for w in words if w[:1].isdigit() and "." in w]
    return numbers[0] if numbers else None


def cast_probe(torch, device):
    """Codes PyTorch's bf16 -> float8_e4m3fn cast gives on `device` at the format's edges."""
    values = [448.0, 464.0, 480.0, 512.0, float("inf"), float("nan")]
    x = torch.tensor(values, dtype=torch.bfloat16, device=device)
    codes = x.to(torch.float8_e4m3fn).view(torch.uint8).cpu().tolist()
    probe = {f"{v:g}": f"0x{c:02X}" for v, c in zip(values, codes)}
    overflow = {0x7E: "saturates to 448", 0x7F: "gives the NaN code"}.get(codes[3], "other")
    return {"codes": probe, "past_464": overflow}


def describe_environment(torch=None, device=None, flashinfer=None):
    describe = {"kvdump": package_version(), "python": platform.python_version(),
                "numpy": np.__version__}
    if torch is not None:
        describe["torch"] = torch.__version__
        describe["torch_cuda"] = torch.version.cuda
    if flashinfer is not None:
        describe["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    if device is None or device.type == "cpu":
        describe["device"] = f"cpu ({platform.machine()})"
        return describe
    props = torch.cuda.get_device_properties(device)
    describe["device"] = props.name
    describe["compute_capability"] = f"{props.major}.{props.minor}"
    describe["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    describe["driver"] = driver_version()
    try:
        api = torch._C._cuda_getDriverVersion()  # e.g. 12080: the CUDA version the driver serves
        describe["driver_cuda"] = f"{api // 1000}.{api % 1000 // 10}"
    except (AttributeError, RuntimeError):
        pass
    return describe
