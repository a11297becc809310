"""Acceptance-length evaluation during training: greedy speculative decoding on held-out prompts."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, TrainerCallback

from moa_hf.bench import acceptance_length, count_forward_calls

from .drafters import adapter_for, unwrap_model

__all__ = ["AcceptanceEvalCallback", "measure_acceptance"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def measure_acceptance(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
) -> dict[str, float]:
    """Greedy `target.generate(..., assistant_model=drafter)` on each prompt (batch 1); pooled acceptance length.

    Returns ``acceptance_length`` (`moa_hf.bench.acceptance_length`: new tokens per target call, pooled over all
    prompts), ``acceptance_cycles`` (the target's calls) and ``acceptance_tokens`` (the new tokens). The drafter's
    adapter (`drafters.ADAPTERS`) prepares it: a MoA/EAGLE drafter is attached to `target` if it is not already and
    runs with the library's default speculation settings (`default_generation_config`: 5 tokens, threshold 0.3; no
    prompt lookup), not its tuned ones, so that the points of a learning curve stay comparable and measure the
    network alone.
    """
    base = unwrap_model(drafter)
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.config.get_text_config().pad_token_id
    total, cycles = 0.0, 0.0
    was_training = base.training
    base.eval()
    try:
        with adapter_for(base).generating(base, target):
            for ids in prompt_ids:
                input_ids = torch.tensor([list(ids)], dtype=torch.long, device=target.device)  # [1, P]
                with count_forward_calls(target) as counter:
                    out = target.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        assistant_model=base,
                        do_sample=False,
                        max_new_tokens=max_new_tokens,
                        pad_token_id=pad,
                    )
                total, cycles = total + out.shape[1] - input_ids.shape[1], cycles + counter.calls
    finally:
        base.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        sums = torch.tensor([total, cycles], dtype=torch.float64, device=target.device)
        torch.distributed.all_reduce(sums)
        total, cycles = float(sums[0]), float(sums[1])
    length = acceptance_length(total, cycles)
    return {
        "acceptance_length": 0.0 if length is None else length,
        "acceptance_cycles": cycles,
        "acceptance_tokens": total,
    }


class AcceptanceEvalCallback(TrainerCallback):
    """Logs the drafter's mean acceptance length on held-out prompts, on `evaluate` and every `every_n_steps` steps.

    Args:
        target: the target model (the drafter is attached to it).
        prompts: prompt strings (formatted with `tokenizer`'s chat template) or token-id lists.
        tokenizer: needed for string prompts.
        max_new_tokens: tokens generated per prompt.
        every_n_steps: also measure every N optimizer steps (None: only on evaluate).
        trainer: when given, metrics are logged through `trainer.log` (reporting integrations see them);
            otherwise they are appended to `state.log_history`.
    Metrics: ``eval_acceptance_length`` (plus cycles/tokens counts). Under DDP each process generates for its share
    of the prompts and the counts are summed.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        tokenizer=None,
        max_new_tokens: int = 64,
        every_n_steps: int | None = None,
        trainer=None,
        chat_template: bool = True,
    ):
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], str):
            if tokenizer is None:
                raise ValueError("String prompts need a tokenizer: pass `tokenizer=` (or token-id lists).")
            from .data import format_prompts

            prompts = format_prompts(tokenizer, prompts, chat_template=chat_template)
        self.target = target
        self.prompt_ids = [list(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.every_n_steps = every_n_steps
        self.trainer = trainer
        self.history: list[dict[str, float]] = []  # one entry per measurement: metrics, step, tokens, wall time
        self._t0: float | None = None

    def _my_prompts(self) -> list[list[int]]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            return self.prompt_ids[rank::world]
        return self.prompt_ids

    def measure(self, drafter) -> dict[str, float]:
        """The acceptance metrics of `drafter` now (keys prefixed with ``eval_``)."""
        raw = measure_acceptance(self.target, drafter, self._my_prompts(), self.max_new_tokens)
        return {f"eval_{k}": v for k, v in raw.items()}

    def on_train_begin(self, args, state, control, **kwargs):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def _report(self, state, metrics: dict[str, float]) -> None:
        wall = time.perf_counter() - self._t0 if self._t0 is not None else None
        tokens = int(state.num_input_tokens_seen or 0)
        self.history.append({**metrics, "step": state.global_step, "tokens": tokens, "wall_time_s": wall})
        if self.trainer is not None:
            self.trainer.log(dict(metrics))
        else:
            state.log_history.append({**metrics, "step": state.global_step})
        logger.info("step %d: acceptance length %.3f", state.global_step, metrics["eval_acceptance_length"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and model is not None and state.global_step % self.every_n_steps == 0:
            self._report(state, self.measure(model))

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        if model is None or not self.prompt_ids:
            return
        result = self.measure(model)
        if metrics is not None:
            metrics.update(result)
        self._report(state, result)
