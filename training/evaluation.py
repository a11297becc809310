"""Acceptance-length evaluation during training: greedy speculative decoding on held-out prompts."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, TrainerCallback

from moa_hf.bench import acceptance_length, count_forward_calls
from moa_hf.modeling import PRIMARY_TARGET

from .drafters import adapter_for, unwrap_model

__all__ = ["AcceptanceEvalCallback", "assisted_outputs", "measure_acceptance", "measure_acceptance_by_exit"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def assisted_outputs(
    target: PreTrainedModel, drafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id=None
) -> list[tuple[list[int], int]]:
    """Greedy `target.generate(..., assistant_model=drafter)` on each prompt (batch 1, the drafter as it is set up):
    (the whole output's token ids, the target's forward calls) per prompt."""
    runs = []
    for ids in prompt_ids:
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=target.device)  # [1, P]
        with count_forward_calls(target) as counter:
            out = target.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=drafter,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_token_id,
            )
        runs.append((out[0].tolist(), counter.calls))
    return runs


@torch.no_grad()
def measure_acceptance(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    *,
    target_name: str | None = None,
    exit: int | None = None,
) -> dict[str, float]:
    """Greedy `target.generate(..., assistant_model=drafter)` on each prompt (batch 1); pooled acceptance length.

    Returns ``acceptance_length`` (`moa_hf.bench.acceptance_length`: new tokens per target call, pooled over all
    prompts), ``acceptance_cycles`` (the target's calls) and ``acceptance_tokens`` (the new tokens). The drafter's
    adapter (`drafters.ADAPTERS`) prepares it: a MoA/EAGLE drafter is attached to `target` and runs with the library's
    default speculation settings (`default_generation_config`: 5 tokens, threshold 0.3; no prompt lookup), not its
    tuned ones, so that the points of a learning curve stay comparable and measure the network alone.

    target_name: the drafter's parts of that target (a drafter serving several targets; None: chosen by `attach`).
    exit: a drafter with several blocks drafts every token from this exit (1-based; None: as it does by default,
    with adaptive depth when it has `exit_thresholds`, else from its last exit).
    """
    base = unwrap_model(drafter)
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.config.get_text_config().pad_token_id
    was_training = base.training
    base.eval()
    try:
        with adapter_for(base).generating(base, target, target_name=target_name, exit=exit):
            runs = assisted_outputs(target, base, prompt_ids, max_new_tokens, pad)
    finally:
        base.train(was_training)
    total = float(sum(len(out) - len(ids) for (out, _), ids in zip(runs, prompt_ids)))
    cycles = float(sum(calls for _, calls in runs))
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


def measure_acceptance_by_exit(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    *,
    target_name: str | None = None,
) -> dict[str, dict[str, float]]:
    """`measure_acceptance` for every fixed exit (``"exit1"`` ... ``"exitK"``) and, when the drafter has exit
    thresholds for the target (`exit_thresholds_for`), for adaptive depth (``"adaptive"``)."""
    base = unwrap_model(drafter)
    num_exits = adapter_for(base).num_exits(base)
    run = functools.partial(measure_acceptance, target, base, prompt_ids, max_new_tokens, target_name=target_name)
    results = {f"exit{i}": run(exit=i) for i in range(1, num_exits + 1)}
    if num_exits > 1 and base.exit_thresholds_for(target_name) is not None:  # that target's own, or the shared ones
        results["adaptive"] = run(exit=None)
    return results


class AcceptanceEvalCallback(TrainerCallback):
    """Logs the drafter's mean acceptance length on held-out prompts, on `evaluate` and every `every_n_steps` steps.

    Args:
        target: the target model (the drafter is attached to it), or {target name: model} for a drafter serving
            several targets.
        prompts: prompt strings (formatted with `tokenizer`'s chat template) or token-id lists, for every target; or
            {target name: prompts} (targets without prompts are not measured).
        tokenizer: needed for string prompts.
        max_new_tokens: tokens generated per prompt.
        every_n_steps: also measure every N optimizer steps (None: only on evaluate).
        trainer: when given, metrics are logged through `trainer.log` (reporting integrations see them);
            otherwise they are appended to `state.log_history`.
        each_exit: a drafter with several blocks: also measure every fixed exit (and adaptive depth when it has exit
            thresholds) on the final evaluation (`"final"`: once training reached `max_steps`), on every measurement
            (`"always"`) or `"never"`.
        context_ablation: also measure with the drafter's context vectors zeroed
            (``eval_acceptance_length_no_context``: what the drafter accepts without the target's state; MoA).
    Metrics: ``eval_acceptance_length`` (plus cycles/tokens counts: pooled over the targets), per target
    ``eval_{name}_acceptance_length`` (when there are several targets or the one is not the primary target), per exit
    the same keys ending in ``_exit{i}`` / ``_adaptive``. Under DDP each process generates for its share of the
    prompts and the counts are summed.
    """

    def __init__(
        self,
        target: PreTrainedModel | Mapping[str, PreTrainedModel],
        prompts: Sequence[str] | Sequence[Sequence[int]] | Mapping[str, Sequence],
        tokenizer=None,
        max_new_tokens: int = 64,
        every_n_steps: int | None = None,
        trainer=None,
        chat_template: bool = True,
        each_exit: str = "final",
        context_ablation: bool = False,
    ):
        targets = dict(target) if isinstance(target, Mapping) else {PRIMARY_TARGET: target}
        by_target = dict(prompts) if isinstance(prompts, Mapping) else {name: prompts for name in targets}
        unknown = sorted(set(by_target) - set(targets))
        if unknown:
            raise ValueError(f"Held-out prompts for {unknown}, which are not among the targets {list(targets)}.")
        if each_exit not in ("final", "always", "never"):
            raise ValueError(f"each_exit must be 'final', 'always' or 'never', got {each_exit!r}.")
        self.prompt_sets = {  # name -> (target, token-id prompts), in the targets' order
            name: (targets[name], self._token_ids(by_target[name], tokenizer, chat_template))
            for name in targets
            if name in by_target
        }
        self.target = next(iter(targets.values()))
        self.prompt_ids = [ids for _, prompt_ids in self.prompt_sets.values() for ids in prompt_ids]
        self.max_new_tokens = max_new_tokens
        self.every_n_steps = every_n_steps
        self.trainer = trainer
        self.each_exit = each_exit
        self.context_ablation = context_ablation
        self.history: list[dict[str, float]] = []  # one entry per measurement: metrics, step, tokens, wall time
        self.measure_time_s = 0.0  # spent measuring (the acceptance runs themselves)
        self._t0: float | None = None

    @staticmethod
    def _token_ids(prompts, tokenizer, chat_template: bool) -> list[list[int]]:
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], str):
            if tokenizer is None:
                raise ValueError("String prompts need a tokenizer: pass `tokenizer=` (or token-id lists).")
            from .data import format_prompts

            prompts = format_prompts(tokenizer, prompts, chat_template=chat_template)
        return [list(p) for p in prompts]

    @staticmethod
    def _my_share(prompt_ids: list[list[int]]) -> list[list[int]]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            return prompt_ids[rank::world]
        return prompt_ids

    def measure(self, drafter, each_exit: bool = False) -> dict[str, float]:
        """The acceptance metrics of `drafter` now (keys prefixed with ``eval_``; see the class docstring); with
        `each_exit`, also those of every exit of a drafter with several blocks."""
        base = unwrap_model(drafter)
        each_exit = each_exit and adapter_for(base).num_exits(base) > 1
        named = len(self.prompt_sets) > 1 or any(name != PRIMARY_TARGET for name in self.prompt_sets)
        metrics: dict[str, float] = {}
        pooled = {"acceptance_tokens": 0.0, "acceptance_cycles": 0.0}
        for name, (target, prompt_ids) in self.prompt_sets.items():
            mine = self._my_share(prompt_ids)
            raw = measure_acceptance(target, base, mine, self.max_new_tokens, target_name=name)
            pooled = {k: v + raw[k] for k, v in pooled.items()}
            prefix = f"eval_{name}_" if named else "eval_"
            if named:
                metrics.update({f"{prefix}{k}": v for k, v in raw.items()})
            if each_exit:
                by_exit = measure_acceptance_by_exit(target, base, mine, self.max_new_tokens, target_name=name)
                metrics.update({f"{prefix}acceptance_length_{k}": v["acceptance_length"] for k, v in by_exit.items()})
        if self.context_ablation:
            ablated = {"acceptance_tokens": 0.0, "acceptance_cycles": 0.0}
            with adapter_for(base).context_ablated(base):
                for name, (target, prompt_ids) in self.prompt_sets.items():
                    raw = measure_acceptance(
                        target, base, self._my_share(prompt_ids), self.max_new_tokens, target_name=name
                    )
                    ablated = {k: v + raw[k] for k, v in ablated.items()}
            length = acceptance_length(ablated["acceptance_tokens"], ablated["acceptance_cycles"])
            metrics["eval_acceptance_length_no_context"] = 0.0 if length is None else length
        length = acceptance_length(pooled["acceptance_tokens"], pooled["acceptance_cycles"])
        metrics.update(
            {
                "eval_acceptance_length": 0.0 if length is None else length,
                "eval_acceptance_cycles": pooled["acceptance_cycles"],
                "eval_acceptance_tokens": pooled["acceptance_tokens"],
            }
        )
        return metrics

    def on_train_begin(self, args, state, control, **kwargs):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def _measure_and_report(self, state, model, each_exit: bool) -> dict[str, float]:
        """Measure `model` now and record it; the point's wall time is taken before measuring."""
        start = time.perf_counter()
        wall = start - self._t0 if self._t0 is not None else None
        metrics = self.measure(model, each_exit=each_exit)
        self.measure_time_s += time.perf_counter() - start
        self._report(state, metrics, wall)
        return metrics

    def _report(self, state, metrics: dict[str, float], wall: float | None) -> None:
        tokens = int(state.num_input_tokens_seen or 0)
        self.history.append({**metrics, "step": state.global_step, "tokens": tokens, "wall_time_s": wall})
        if self.trainer is not None:
            self.trainer.log(dict(metrics))
        else:
            state.log_history.append({**metrics, "step": state.global_step})
        logger.info("step %d: acceptance length %.3f", state.global_step, metrics["eval_acceptance_length"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and model is not None and state.global_step % self.every_n_steps == 0:
            self._measure_and_report(state, model, each_exit=self.each_exit == "always")

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        if model is None or not self.prompt_ids:
            return
        final = state.max_steps > 0 and state.global_step >= state.max_steps
        each_exit = self.each_exit == "always" or (self.each_exit == "final" and final)
        result = self._measure_and_report(state, model, each_exit)
        if metrics is not None:
            metrics.update(result)
