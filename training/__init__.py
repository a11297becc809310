"""moa_hf.training: on-policy training of MoA drafters (data generation, Trainer, evaluation, CLI).

Exports are imported lazily, so `moa --help` and the other subcommands do not pay for `transformers.Trainer`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    # arguments / trainer
    "MoATrainingArguments": "arguments",
    "MoATrainer": "trainer",
    "MoADataCollator": "collate",
    "TargetStates": "states",
    "IGNORE_INDEX": "collate",
    "run_target": "targets",
    "staircase_restarts": "cycles",
    "draw_cycle_lengths": "cycles",
    "sa_curriculum_mask": "cycles",
    # losses
    "chunked_soft_cross_entropy": "losses",
    "feature_loss": "losses",
    # evaluation
    "AcceptanceEvalCallback": "evaluation",
    "measure_acceptance": "evaluation",
    # data
    "build_dataset": "data",
    "build_chat_dataset": "data",
    "load_prompts": "data",
    "format_prompts": "data",
    "check_not_spec_bench": "data",
    "SpecBenchPromptsError": "data",
    "default_prompts": "data",
    "written_briefs": "data",
    "written_prompts": "data",
    # conversion
    "with_own_embeddings": "convert",
    # PEFT
    "apply_lora": "peft_utils",
    "merge_lora": "peft_utils",
    "DEFAULT_LORA_TARGETS": "peft_utils",
    "TargetStatesDataset": "states",
    "cache_target_states": "states",
    "load_target_states": "states",
    # drafters: one training adapter per drafter class
    "ADAPTERS": "drafters",
    "DrafterAdapter": "drafters",
    "adapter_for": "drafters",
    "build_for_kind": "drafters",
    "drafter_kind": "drafters",
    "unwrap_drafter": "drafters",
    "build_independent": "builders",
    "frequent_tokens": "builders",
    "init_from_target_layer": "builders",
}

__all__ = [
    "ADAPTERS",
    "AcceptanceEvalCallback",
    "DEFAULT_LORA_TARGETS",
    "DrafterAdapter",
    "IGNORE_INDEX",
    "MoADataCollator",
    "MoATrainer",
    "MoATrainingArguments",
    "SpecBenchPromptsError",
    "TargetStates",
    "TargetStatesDataset",
    "adapter_for",
    "apply_lora",
    "build_chat_dataset",
    "build_dataset",
    "build_for_kind",
    "build_independent",
    "cache_target_states",
    "check_not_spec_bench",
    "chunked_soft_cross_entropy",
    "default_prompts",
    "drafter_kind",
    "draw_cycle_lengths",
    "feature_loss",
    "format_prompts",
    "frequent_tokens",
    "init_from_target_layer",
    "load_prompts",
    "load_target_states",
    "measure_acceptance",
    "merge_lora",
    "written_briefs",
    "written_prompts",
    "run_target",
    "sa_curriculum_mask",
    "staircase_restarts",
    "unwrap_drafter",
    "with_own_embeddings",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moa_hf.training' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs
    from moa_hf.offline_prompts import default_prompts

    from .arguments import MoATrainingArguments
    from .builders import build_independent, frequent_tokens, init_from_target_layer
    from .collate import IGNORE_INDEX, MoADataCollator
    from .convert import with_own_embeddings
    from .cycles import draw_cycle_lengths, sa_curriculum_mask, staircase_restarts
    from .data import SpecBenchPromptsError, build_dataset, check_not_spec_bench, format_prompts, load_prompts
    from .drafters import ADAPTERS, DrafterAdapter, adapter_for, build_for_kind, drafter_kind, unwrap_drafter
    from .evaluation import AcceptanceEvalCallback, measure_acceptance
    from .losses import chunked_soft_cross_entropy, feature_loss
    from .peft_utils import DEFAULT_LORA_TARGETS, apply_lora, merge_lora
    from .states import TargetStates, TargetStatesDataset, cache_target_states, load_target_states
    from .targets import run_target
    from .trainer import MoATrainer
