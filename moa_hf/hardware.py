"""One home for describing the machine a measurement ran on (`moa bench`, `moa tune`, the serving benchmarks,
`moa train`): `hardware_info` as a JSON-able dict, `hardware_summary` as one line, `cpu_flags` the instruction sets
that change a CPU figure; and `keep_freed_memory`, the allocator setting the CPU training commands run with."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from pathlib import Path

import torch

__all__ = [
    "cpu_flags",
    "cpu_name",
    "emulated_bf16_warning",
    "fast_dtype",
    "hardware_info",
    "hardware_summary",
    "keep_freed_memory",
    "native_bf16",
]

# The CPU flags that change what a figure means: matrix units (AMX), native bf16, AVX-512, AVX2
FIGURE_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one, else what `platform` says)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpu


def cpu_flags() -> list[str]:
    """Which of `FIGURE_FLAGS` this CPU has (from /proc/cpuinfo; empty where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [flag for flag in FIGURE_FLAGS if flag in have]
    return []


def native_bf16(cpu: bool = True) -> bool:
    """Whether bf16 compute is native here: on the CPU (`cpu=True`) AVX-512 bf16 or AMX; else the CUDA device."""
    if not cpu:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return any(flag in cpu_flags() for flag in ("avx512_bf16", "amx_bf16"))


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype speculative decoding (and training) runs fastest in on `device`: bf16 where bf16 compute is native
    (`native_bf16`), else float32. On a CPU without AVX-512 bf16 or AMX, torch's bf16 matrix products of many rows
    take a fallback path: on an AVX2-only AMD EPYC (2 threads, torch 2.13) a [2048, 576] @ [576, 1536] product took
    3.6 s in bf16 against 53 ms in float32, and verifying drafted tokens grows with their number."""
    return torch.bfloat16 if native_bf16(cpu=torch.device(device).type != "cuda") else torch.float32


def emulated_bf16_warning(dtype: torch.dtype | None, device: str | torch.device = "cpu") -> str | None:
    """Why `dtype` is a poor choice on `device` (a sentence naming the fix), or None: bf16 on a CPU without native
    bf16 (see `fast_dtype`)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or native_bf16():
        return None
    flags = " ".join(cpu_flags()) or "none of " + ", ".join(FIGURE_FLAGS)
    return (
        f"bfloat16 on this CPU ({cpu_name()}; flags: {flags}) has no native bf16 (AVX-512 bf16 or AMX): its matrix "
        "products take a fallback 45-70x slower than float32. Pass dtype='float32' (or `moa_hf.fast_dtype()`)."
    )


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system (Linux only).

    A training step on a CPU allocates and frees activations of tens of MB each, many times; by default glibc maps
    each of them anew and unmaps it when freed, so every step pays page faults that zero-fill them again (half the
    LSA's forward time on a 2-core EPYC, measured). This raises the mmap threshold to its maximum (32 MiB) and the trim
    threshold so the heap keeps its pages. Process-wide: called by the `moa train` / `moa data` commands, never on
    import. Returns whether it took effect."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters (malloc.h)
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        return False


def hardware_info(device: torch.device | str = "cpu") -> dict:
    """cpu model, cores, torch and python versions, device ("cpu" or the CUDA device name) and torch threads."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count() or 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": name,
        "threads": torch.get_num_threads(),
    }


def hardware_summary() -> str:
    """`2 x NVIDIA H100 ...` where CUDA is available, else `CPU (<model>, <its FIGURE_FLAGS>, <n> threads)`."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    flags = " ".join(cpu_flags()) or "no AVX2"
    return f"CPU ({cpu_name()}, {flags}, {torch.get_num_threads()} threads)"
