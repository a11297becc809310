"""The frozen targets' side of training: each target made frozen and the drafter given its parts for it
(`prepare_targets`), a batch's target states (`batch_target_states`: cached, or one no-grad forward, `run_target`)
and which of the target's keys/values inference still holds when the drafter reads them (`held_target_kv`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from transformers import DynamicCache, PreTrainedModel

from moa_hf.modeling import (
    CACHE_NAME,
    PRIMARY_TARGET,
    TargetStates,
    gather_target_kv,
    held_at_reads,
    held_capacities,
    split_target_kv,
)

from .arguments import MoATrainingArguments
from .cycles import read_ends_of_cycles
from .drafters import DrafterAdapter

__all__ = [
    "accepts_argument",
    "batch_target_states",
    "freeze_targets",
    "held_target_kv",
    "prepare_targets",
    "run_target",
]

logger = logging.getLogger(__name__)


@torch.no_grad()
def run_target(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    target_layer_inference: int = 0,
) -> TargetStates:
    """One no-grad forward of the target with its cache and hidden states; the [B, T, V] logits are not computed
    (only the last position's, where the model supports `logits_to_keep`).

    The cache is a full one (every layer keeps every position, sliding-window layers included: the same outputs);
    which keys/values inference could still read is marked by `held_target_kv`."""
    kwargs = {"logits_to_keep": 1} if accepts_argument(target, "logits_to_keep") else {}
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=True,
        **{CACHE_NAME: DynamicCache()},
        **kwargs,
    )
    cache, hidden = getattr(out, CACHE_NAME), out.hidden_states  # hidden: L+1 x [B, T, d]
    T = input_ids.shape[1]
    n = target_layer_inference
    num_layers = len(hidden) - 1
    tli_kv = None
    if n > 0:
        tli_kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(num_layers - n, num_layers)]
    return TargetStates(
        kv=gather_target_kv(cache, 0, T),
        final_hidden=hidden[-1],
        feature=hidden[num_layers - n] if n > 0 else hidden[-1],
        tli_kv=tli_kv,
    )


def accepts_argument(model: torch.nn.Module, name: str) -> bool:
    """Whether `model`'s forward takes an argument `name`."""
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def batch_target_states(
    inputs: dict[str, torch.Tensor], target: PreTrainedModel, drafter: torch.nn.Module, adapter: DrafterAdapter
) -> TargetStates:
    """The frozen `target`'s states for the batch: cached ones (`states.TargetStatesDataset`) when the batch has them,
    else one no-grad forward of the target (`run_target`)."""
    tli = adapter.target_layer_inference(drafter)
    if "final_hidden" not in inputs:
        return run_target(target, inputs["input_ids"], inputs.get("attention_mask"), target_layer_inference=tli)
    hidden = inputs["final_hidden"]
    kv = inputs.get("target_kv")
    if adapter.needs_target_kv and kv is None:
        raise ValueError(
            f"{type(drafter).__name__} reads the target's keys/values but the cached target states have no "
            "`target_kv`; cache the states with them (`cache_target_states`)."
        )
    if tli == 0:
        return TargetStates(kv=kv, final_hidden=hidden, feature=hidden)
    before_last = inputs.get("tli_hidden")  # [B, T, M, d]: hidden_states[L-n] for n = 1..M
    if before_last is None or before_last.shape[2] < tli:
        have = 0 if before_last is None else before_last.shape[2]
        raise ValueError(
            f"This drafter runs the target's last {tli} layers (target_layer_inference={tli}) but the cached "
            f"target states hold the inputs of the last {have}; cache them with `tli_layers={tli}` "
            f"(`moa train --states` does it for a new folder)."
        )
    num_layers, dtype = kv.shape[2], next(target.parameters()).dtype
    heads = drafter.config.target_num_key_value_heads
    tli_kv = [  # the last N layers' (keys, values) [B, Hkv, T, hd], as the target's cache holds them
        tuple(t.to(dtype) for t in split_target_kv(kv, layer, heads)) for layer in range(num_layers - tli, num_layers)
    ]
    return TargetStates(kv=kv, final_hidden=hidden, feature=before_last[:, :, tli - 1], tli_kv=tli_kv)


def held_target_kv(
    capacities: list[int | None], prompt_lengths: torch.Tensor, cycle_starts: torch.Tensor
) -> torch.Tensor | None:
    """bool [B, T]: whether every layer of a target (`capacities`: the positions each layer keeps, None: all) still
    holds token j's key/value when the drafter reads it at inference (`held_at_reads`): a sliding-window layer has
    dropped prompt positions older than its window by the first read (at the end of the prompt). None when every
    layer holds every position of the batch."""
    T = cycle_starts.shape[1]
    if all(c is None or c >= T for c in capacities):
        return None
    return held_at_reads(read_ends_of_cycles(prompt_lengths, cycle_starts), capacities)


def freeze_targets(targets: Mapping[str, PreTrainedModel], device: torch.device) -> dict[str, list[int | None]]:
    """Puts every target in eval mode with `requires_grad=False` (on `device`, unless it is dispatched over devices)
    and returns {target name: the positions each of its layers keeps (None: all)}."""
    for t in targets.values():
        t.eval()
        t.requires_grad_(False)
        if getattr(t, "hf_device_map", None) is None and t.device != device:
            t.to(device)
    return {name: held_capacities(DynamicCache(config=t.config)) for name, t in targets.items()}


def prepare_targets(
    adapter: DrafterAdapter,
    model: torch.nn.Module,
    drafter: torch.nn.Module,
    targets: Mapping[str, PreTrainedModel],
    args: MoATrainingArguments,
    by_target: Mapping | None,
) -> None:
    """Parts for every target the drafter lacks; with `train_target_parts` (or `freeze_blocks`), everything else
    (the first blocks and what they read) frozen. `model`: the drafter as trained (maybe PEFT-wrapped), `drafter`
    the drafter itself, `by_target`: {target name: training data}."""
    names = list(targets)
    missing = [n for n in names if n != PRIMARY_TARGET and n not in getattr(drafter, "target_names", [n])]
    if missing and model is not drafter and hasattr(model, "get_base_model"):
        raise ValueError(
            f"Add the targets {missing} to the drafter (`drafter.add_target`) before wrapping it with PEFT; or "
            "train without --lora-r."
        )
    added = adapter.add_targets(drafter, targets, lora_rank=args.target_lora_rank)
    if added:
        logger.info("Added parts for target(s) %s (LoRA rank %d).", added, args.target_lora_rank)
    if args.freeze_blocks:
        if args.train_target_parts is not None:
            raise ValueError("freeze_blocks and train_target_parts both choose what trains: give one of them.")
        others = [n for n in names if n != PRIMARY_TARGET]
        params = adapter.train_deeper_blocks(drafter, args.freeze_blocks, others)
        logger.info(
            "Blocks 1..%d frozen; training the deeper blocks and the parts of %s: %d parameters.",
            args.freeze_blocks,
            others,
            sum(p.numel() for p in params),
        )
    name = args.train_target_parts
    if name is None:
        return
    if name not in targets:
        raise ValueError(f"train_target_parts={name!r} is not among the targets {names}.")
    others = sorted(set(by_target or {}) - {name})
    if others:
        raise ValueError(
            f"Training only the parts of target {name!r} takes that target's data only, not that of {others}."
        )
    if model is not drafter and hasattr(model, "get_base_model"):
        raise ValueError("train_target_parts trains the drafter's own per-target parts: do not wrap it in PEFT.")
    params = adapter.train_only_target_parts(drafter, name)
    logger.info("Training only target %r's parts: %d parameters.", name, sum(p.numel() for p in params))
