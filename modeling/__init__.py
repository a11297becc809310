"""The MoA drafter's config and modeling files (self-contained: they also ship as Hub remote code)."""

from .configuration_moa import MoADrafterConfig, target_signature, unsupported_target_reason
from .modeling_moa import (
    MoADrafterCache,
    MoADrafterModel,
    MoADrafterOutput,
    MoAPreTrainedModel,
    SpeculationStats,
    cycle_starts_from_restarts,
    gather_target_kv,
)

__all__ = [
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "MoAPreTrainedModel",
    "SpeculationStats",
    "cycle_starts_from_restarts",
    "gather_target_kv",
    "target_signature",
    "unsupported_target_reason",
]
