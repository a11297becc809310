"""Config and modeling files of the MoA drafter and its EAGLE-style peer (self-contained: also Hub remote code)."""

from .configuration_eagle import EagleDrafterConfig
from .configuration_moa import MoADrafterConfig, target_signature, unsupported_target_reason
from .drafting import DrafterMixin, RollbackCache, SpeculationStats
from .lookup import LookupSettings, lookup_continuation
from .modeling_eagle import EagleDrafterModel
from .modeling_moa import (
    MoADrafterCache,
    MoADrafterModel,
    MoADrafterOutput,
    MoAPreTrainedModel,
    cycle_starts_from_restarts,
    gather_target_kv,
    split_target_kv,
)

__all__ = [
    "DrafterMixin",
    "EagleDrafterConfig",
    "EagleDrafterModel",
    "LookupSettings",
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "MoAPreTrainedModel",
    "RollbackCache",
    "SpeculationStats",
    "cycle_starts_from_restarts",
    "gather_target_kv",
    "lookup_continuation",
    "split_target_kv",
    "target_signature",
    "unsupported_target_reason",
]
