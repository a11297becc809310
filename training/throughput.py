"""Training throughput: where a step's time goes, train tokens/s and model FLOP utilisation (MFU).

`moa train --profile-steps N` times N optimizer steps after `WARMUP_STEPS` (`StepProfile`), counts the FLOPs of one
training step with torch's per-op FLOP formulas (matrix products and attention of the drafter's forward and
backward, and of the target's forward where it runs in the step), measures a matrix product at the step's
shapes on the same machine, and writes `throughput.json` in the output folder:

    tokens/s = non-padding tokens trained / wall time of the timed steps
    MFU      = FLOPs per token x tokens/s / the measured matmul rate in the step's compute dtype (bf16 under bf16
               autocast), at [padded tokens of a batch, hidden, intermediate]

The parts of a step are wall times of sections of `MoATrainer` (data, target states, simulated cycles, drafter
forward and within it the LSA layer, loss, backward, optimizer); on a GPU every section waits for the device.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from transformers import TrainerCallback

from moa_hf.hardware import hardware_info

__all__ = ["StepProfile", "matmul_rate", "WARMUP_STEPS"]

logger = logging.getLogger(__name__)

WARMUP_STEPS = 2  # optimizer steps before timing starts (first-call costs: kernels, allocator, lazy set-up)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, device="cpu", seconds: float = 0.5):
    """Measured FLOP/s of an [m, k] @ [k, n] matrix product in `dtype` on `device` (torch's current threads)."""
    device = torch.device(device)
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    _synchronize(device)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or runs < 3:
        a @ b
        runs += 1
    _synchronize(device)
    return 2.0 * m * k * n * runs / (time.perf_counter() - start)


class _FlopCount(TorchDispatchMode):
    """FLOPs of the matrix products and attentions run inside (torch's own per-op formulas, `flop_registry`).

    `FlopCounterMode` would do, but its module tracker hooks every module's inputs, which the loss's custom autograd
    functions (a head run on detached chunks inside their forward) do not allow."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_registry.get(_SAME_FORMULA.get(packet, packet))
        if formula is not None:
            if packet in _ATTENTION_OPS:
                args = _heads_expanded(args)
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


_aten = torch.ops.aten
# The CPU's fused attention counts as flash attention does (same leading arguments: [grad_out,] query, key, value).
_SAME_FORMULA = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}
_ATTENTION_OPS = {packet for packet in flop_registry if "_scaled_dot_product_" in str(packet)} | set(_SAME_FORMULA)


def _heads_expanded(args: tuple) -> tuple:
    """Grouped-query attention (`enable_gqa`: fewer key/value heads than query heads) as torch's formulas count it:
    each [batch, heads, seq, dim] argument with fewer heads than the most given as shape-only (meta) tensors with that
    many. The FLOPs are those of the equivalent attention with repeated key/value heads."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    heads = max((t.shape[1] for t in tensors), default=0)
    return tuple(
        torch.empty((a.shape[0], heads, *a.shape[2:]), device="meta")
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != heads
        else a
        for a in args
    )


class StepProfile(TrainerCallback):
    """Times the parts of `steps` optimizer steps (after `WARMUP_STEPS`) of a `MoATrainer`, counts one step's FLOPs,
    then writes `throughput.json` (see the module's docstring) and logs tokens/s and MFU.

    The trainer calls `section(name)` around the parts of a step; outside the timed steps a section costs nothing.
    """

    def __init__(self, steps: int, device: torch.device | str = "cpu"):
        self.steps = int(steps)
        self.device = torch.device(device)
        self.active = False
        self.counting = False  # the step whose FLOPs are counted (before the timed ones)
        self.parts: dict[str, float] = defaultdict(float)
        self.flops = 0.0
        self.flop_tokens = 0
        self.tokens = 0
        self.batch_tokens = 0  # padded tokens of the last batch (the matmul shapes' rows)
        self.result: dict | None = None
        self._start = 0.0
        self._hooks: list = []
        self._counter = None

    # -- sections (called by the trainer) -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def section(self, name: str):
        if not self.active:
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self.parts[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def counting_flops(self):
        """Counts the FLOPs of what runs inside (the step chosen for counting), else does nothing."""
        if not self.counting:
            yield
            return
        counter = _FlopCount()
        with counter:
            yield
        self.flops += counter.total

    def count_tokens(self, inputs: dict[str, torch.Tensor]) -> None:
        if not (self.counting or self.active):  # outside the profile: no host synchronisation on a GPU
            return
        mask = inputs.get("attention_mask")
        n = int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        if self.counting:
            self.flop_tokens += n
        if self.active:
            self.tokens += n
            self.batch_tokens = inputs["input_ids"].numel()

    # -- the LSA layer's time, through hooks installed for the timed steps only ---------------------------------------
    def _hook_lsa(self, drafter: torch.nn.Module) -> None:
        layer = getattr(drafter, "layer_self_attention", None)
        if layer is None:
            return

        def before(module, args):
            _synchronize(self.device)
            module._moa_profile_start = time.perf_counter()

        def after(module, args, output):
            _synchronize(self.device)
            self.parts["drafter forward: LSA layer"] += time.perf_counter() - module._moa_profile_start

        self._hooks = [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the callback -------------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == WARMUP_STEPS - 1:
            self.counting = True
        elif state.global_step == WARMUP_STEPS:
            self.counting = False
            self.active = True
            self._hook_lsa(_drafter_of(kwargs.get("model")))
            _synchronize(self.device)
            self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.active and state.global_step >= WARMUP_STEPS + self.steps:
            _synchronize(self.device)
            wall = time.perf_counter() - self._start
            self.active = False
            self._unhook()
            self.result = self._report(args, wall, _drafter_of(kwargs.get("model")))
            if args.process_index == 0:
                Path(args.output_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.output_dir) / "throughput.json").write_text(json.dumps(self.result, indent=1))
                logger.warning("Training throughput:\n%s", format_profile(self.result))

    def on_train_end(self, args, state, control, **kwargs):
        self._unhook()
        if self.result is None and state.global_step < WARMUP_STEPS + self.steps:
            logger.warning(
                "--profile-steps %d needs at least %d steps (max_steps=%d): nothing was timed.",
                self.steps,
                WARMUP_STEPS + self.steps,
                state.max_steps,
            )

    def _report(self, args, wall: float, drafter) -> dict:
        steps = self.steps
        per_step = {name: 1e3 * t / steps for name, t in sorted(self.parts.items())}
        fwd_bwd = per_step.pop("forward+backward", 0.0)
        inside = sum(v for k, v in per_step.items() if k in _FORWARD_PARTS)
        per_step["backward"] = max(0.0, fwd_bwd - inside)
        per_step["other (clip, optimizer, logging)"] = max(0.0, 1e3 * wall / steps - fwd_bwd - per_step.get("data", 0))
        tokens_per_s = self.tokens / wall
        config = getattr(drafter, "config", None)
        d = getattr(config, "hidden_size", 576)
        inner = getattr(config, "intermediate_size", 4 * d)
        rows = max(64, self.batch_tokens)
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32  # the step's
        rate = matmul_rate(rows, d, inner, dtype, self.device)
        flops_per_token = self.flops / max(1, self.flop_tokens)
        return {
            "steps_timed": steps,
            "seconds_per_step": round(wall / steps, 4),
            "train_tokens_per_second": round(tokens_per_s, 1),
            "ms_per_step": {k: round(v, 1) for k, v in per_step.items()},
            "flops_per_token": round(flops_per_token),
            "matmul_flops_per_second": round(rate),
            "matmul_shape": [rows, d, inner],
            "matmul_dtype": str(dtype).removeprefix("torch."),
            "mfu": round(flops_per_token * tokens_per_s / rate, 4),
            "batch_size": args.per_device_train_batch_size,
            "hardware": hardware_info(self.device),
        }


_FORWARD_PARTS = {"target states", "simulated cycles", "drafter forward", "loss"}  # inside forward+backward


def _drafter_of(model):
    from .drafters import unwrap_model

    return unwrap_model(model) if model is not None else None


def format_profile(result: dict) -> str:
    """The profile as a few aligned lines: ms per step by part, tokens/s, FLOPs per token, MFU."""
    lines = [f"  {name:<36} {ms:>9.1f} ms/step" for name, ms in result["ms_per_step"].items()]
    lines.append(
        f"  {result['train_tokens_per_second']:.0f} train tokens/s, {result['flops_per_token'] / 1e6:.1f} MFLOP/token,"
        " "
        f"{result['matmul_dtype']} matmul {result['matmul_flops_per_second'] / 1e12:.3f} TFLOP/s at "
        f"{result['matmul_shape']}: "
        f"MFU {100 * result['mfu']:.1f}%"
    )
    return "\n".join(lines)
