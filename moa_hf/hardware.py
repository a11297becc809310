"""One home for describing the machine a measurement ran on (`moa bench`, `moa tune`, the serving benchmarks,
`moa train`): `hardware_info` as a JSON-able dict, `hardware_summary` as one line."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import torch

__all__ = ["cpu_name", "hardware_info", "hardware_summary"]


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one, else what `platform` says)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpu


def hardware_info(device: torch.device | str = "cpu") -> dict:
    """cpu model, cores, torch and python versions, device ("cpu" or the CUDA device name) and torch threads."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count() or 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": name,
        "threads": torch.get_num_threads(),
    }


def hardware_summary() -> str:
    """`2 x NVIDIA H100 ...` where CUDA is available, else `CPU (<model>, <n> threads)`."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({cpu_name()}, {torch.get_num_threads()} threads)"
