"""One tolerance for float comparisons that must hold on every CPU kind.

Two computations of the same math in a different order (a chunked vs a parallel forward, a cache read vs a fresh
forward) differ by rounding, and how much depends on the machine's kernels: AMX, AVX-512 and AVX2 reduce in different
orders. The error of a reduction grows with the magnitude of its terms, not with the magnitude of its result, so a
fixed `atol` that holds on one machine fails on another (1 of 1024 elements off by 1.07e-5 against 1e-5 on an AMX
Xeon). `assert_close` scales both tolerances to the dtype's machine epsilon and to the largest magnitude compared.

Token identity (greedy decoding in float32) stays the exactness test; this is only for intermediate floats.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close", "tolerance"]

# Units of the dtype's epsilon. float32: rtol 3.1e-5; atol 3.1e-5 x the largest magnitude compared
ULPS = 256


def tolerance(expected: torch.Tensor, dtype: torch.dtype | None = None, ulps: float = ULPS) -> dict[str, float]:
    """{"rtol", "atol"} for comparing against `expected`: `ulps` epsilons of `dtype` (default: expected's), atol also
    times max(1, max |expected|)."""
    dtype = dtype or expected.dtype
    if not dtype.is_floating_point:
        return {"rtol": 0.0, "atol": 0.0}
    eps = torch.finfo(dtype).eps
    finite = expected[torch.isfinite(expected)] if expected.numel() else expected
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return {"rtol": ulps * eps, "atol": ulps * eps * scale}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, ulps: float = ULPS, msg: str | None = None) -> None:
    """`torch.testing.assert_close` with `tolerance(expected)`: equal up to rounding of the same math, any CPU kind.

    Compared in the lower precision of the two dtypes (a bf16 result against a float32 reference is held to bf16's
    epsilon)."""
    low = min((actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).bits if d.is_floating_point else 64)
    tol = tolerance(expected, dtype=low, ulps=ulps)
    torch.testing.assert_close(actual, expected, check_dtype=False, msg=msg, **tol)
