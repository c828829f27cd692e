"""The environment stamp every report carries: machine, versions, devices."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import socket
from typing import Any

__all__ = ["package_versions", "environment"]

_PACKAGES = (
    "ffnquant", "torch", "triton", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "bitsandbytes", "numpy",
    "transformers", "compressed-tensors",
)


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape the numbers (None where absent)."""
    return dict(_package_versions())


@functools.cache  # read once per process: every quantization result is stamped with them (a plan makes hundreds)
def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Machine, OS, Python, package versions, CPU and (if any) CUDA device, with a UTC timestamp."""
    import torch

    env: dict[str, Any] = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "packages": package_versions(),
        "cuda_available": bool(torch.cuda.is_available()),
    }
    try:
        import onnxruntime as ort

        env["onnxruntime_available_providers"] = list(ort.get_available_providers())
    except Exception as exc:  # an onnxruntime that fails to import is a fact worth reporting
        env["onnxruntime_available_providers"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    return env
