"""What the trainer counts beside the loss: `TrainingTally` (tokens per target and wall time, kept in checkpoints),
`LossParts` (the loss components of the training logs) and `TopOneAgreement` (the evaluation's top-1 agreement)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

__all__ = ["LossParts", "TopOneAgreement", "TrainingTally", "summed_over_processes"]


def summed_over_processes(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` summed over all processes (`all_reduce` on `device`) when torch.distributed runs, else as they are;
    on the CPU."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        values = values.to(device)
        torch.distributed.all_reduce(values)
    return values.cpu()


class TrainingTally(TrainerCallback, ExportableState):
    """What a run has trained that transformers' `TrainerState` does not keep: the non-padding tokens per target
    (summed over processes) and the wall time, saved in every checkpoint (`stateful_callbacks`) and restored when the
    run resumes from one (`restore_callback_states_from_checkpoint`, on by default in `MoATrainingArguments`). The
    wall time counts the segments that led to the checkpoint, then this one."""

    def __init__(self):
        self.tokens: dict[str, float] = {}
        self.wall_time_s = 0.0  # the earlier segments' (restored from a checkpoint)
        self._started = time.perf_counter()  # a restored tally is made as the resumed loop starts

    def on_train_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall time of the run: the earlier segments and this one so far (seconds)."""
        return self.wall_time_s + time.perf_counter() - self._started

    def count_batch(
        self, inputs: dict[str, torch.Tensor], target_name: str, target_names: list[str], device: torch.device
    ) -> None:
        """Adds the batch's non-padding tokens to target `target_name`'s count, summed over processes (every process
        calls it for each micro-batch)."""
        mask = inputs.get("attention_mask")
        n = mask.sum() if mask is not None else inputs["input_ids"].numel()
        tokens = torch.zeros(len(target_names), dtype=torch.float64)  # [targets] this batch's, this process
        tokens[target_names.index(target_name)] = float(n)
        for name, count in zip(target_names, summed_over_processes(tokens, device).tolist()):
            self.tokens[name] = self.tokens.get(name, 0.0) + count

    def state(self) -> dict:
        return {"args": {}, "attributes": {"tokens": dict(self.tokens), "wall_time_s": self.elapsed()}}


class LossParts:
    """The loss components summed since the last training log, this process: soft CE, feature loss, counted tokens
    and each exit's total loss."""

    def __init__(self, num_exits: int):
        self.sums = torch.zeros(3 + num_exits, dtype=torch.float64)

    def add(
        self, ce: torch.Tensor, feat: torch.Tensor, counted: torch.Tensor, per_exit: Sequence[tuple[torch.Tensor, ...]]
    ) -> None:
        """ce, feat: [N] per counted position (weighted over exits); per_exit: each exit's (total [N], ...)."""
        exit_sums = [float(part[0].detach().sum()) for part in per_exit]
        self.sums += torch.tensor(
            [float(ce.detach().sum()), float(feat.detach().sum()), float(counted.sum()), *exit_sums],
            dtype=torch.float64,
        )

    def pop_logs(self) -> dict[str, float]:
        """`soft_ce`, `feature_loss` and, with several exits, `loss_exit1`, ... per counted token since the last call
        (none when no token was counted), then starts over."""
        if self.sums[2] <= 0:
            return {}
        tokens = self.sums[2]
        logs = {"soft_ce": float(self.sums[0] / tokens), "feature_loss": float(self.sums[1] / tokens)}
        if len(self.sums) > 4:
            for i, value in enumerate(self.sums[3:].tolist(), start=1):
                logs[f"loss_exit{i}"] = float(value / tokens)
        self.sums.zero_()
        return logs


class TopOneAgreement:
    """Evaluation: does the drafter's top-1 token equal the target's next token (the label)? Counted over all counted
    positions and over the first position of each simulated cycle (the first drafted token, which carries most of the
    acceptance length); cheap and far less noisy than an acceptance-length run."""

    def __init__(self):
        self.counts = torch.zeros(4, dtype=torch.float64)  # top-1 hits, positions, first-of-cycle ones

    def reset(self) -> None:
        self.counts.zero_()

    def add(
        self, top: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor, cycle_starts: torch.Tensor | None
    ) -> None:
        """top: [N] the drafter's top-1 token at the counted positions; labels, counted: [B, T]; cycle_starts: [B, T]
        (None: no simulated cycles, every position reads the target's true past)."""
        hits = (top == labels[counted]).double()
        if cycle_starts is None:
            first = torch.ones_like(hits, dtype=torch.bool)
        else:
            pos = torch.arange(counted.shape[1], device=counted.device)
            first = (cycle_starts == pos[None, :])[counted]
        self.counts += torch.tensor(
            [float(hits.sum()), float(hits.numel()), float(hits[first].sum()), float(first.sum())], dtype=torch.float64
        )

    def metrics(self, prefix: str, device: torch.device) -> dict[str, float]:
        """``{prefix}_top1`` and ``{prefix}_top1_first`` over all processes (none when nothing was counted)."""
        counts = summed_over_processes(self.counts.clone(), device)
        if counts[1] <= 0:
            return {}
        first = float(counts[2] / counts[3].clamp(min=1))
        return {f"{prefix}_top1": float(counts[0] / counts[1]), f"{prefix}_top1_first": first}
