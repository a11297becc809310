"""Config and modeling files of the MoA drafter and its EAGLE-style peer (self-contained: also Hub remote code)."""

from .configuration_eagle import EagleDrafterConfig
from .configuration_moa import MoADrafterConfig, target_signature, unsupported_target_reason
from .modeling_eagle import EagleDrafterModel
from .modeling_moa import (
    MoADrafterCache,
    MoADrafterModel,
    MoADrafterOutput,
    MoAPreTrainedModel,
    SpeculationStats,
    cycle_starts_from_restarts,
    gather_target_kv,
    split_target_kv,
)

__all__ = [
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "EagleDrafterConfig",
    "EagleDrafterModel",
    "MoAPreTrainedModel",
    "SpeculationStats",
    "cycle_starts_from_restarts",
    "gather_target_kv",
    "split_target_kv",
    "target_signature",
    "unsupported_target_reason",
]
