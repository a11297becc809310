"""Config and modeling files of the MoA drafter and its EAGLE-style peer (self-contained: also Hub remote code)."""

from .configuration_eagle import EagleDrafterConfig
from .configuration_moa import (
    PRIMARY_TARGET,
    MoADrafterConfig,
    fixed_exit_thresholds,
    target_signature,
    tli_unsupported_reason,
    unsupported_target_reason,
)
from .drafting import CACHE_NAME, DrafterMixin, RollbackCache, SpeculationStats, cache_argument, target_fingerprint
from .lookup import LookupSettings, lookup_continuation
from .modeling_eagle import EagleDrafterModel
from .modeling_moa import MoABlock, MoADrafterCache, MoADrafterModel, MoADrafterOutput, MoAPreTrainedModel
from .target_cache import (
    CacheReader,
    SlotReader,
    TargetStates,
    cycle_starts_from_restarts,
    gather_target_kv,
    gather_target_kv_at,
    held_at_reads,
    held_capacities,
    oldest_held_position,
    split_target_kv,
)
from .target_parts import MoATargetParts

__all__ = [
    "CACHE_NAME",
    "PRIMARY_TARGET",
    "CacheReader",
    "DrafterMixin",
    "EagleDrafterConfig",
    "EagleDrafterModel",
    "LookupSettings",
    "MoABlock",
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "MoAPreTrainedModel",
    "MoATargetParts",
    "RollbackCache",
    "SlotReader",
    "SpeculationStats",
    "TargetStates",
    "cache_argument",
    "cycle_starts_from_restarts",
    "fixed_exit_thresholds",
    "gather_target_kv",
    "gather_target_kv_at",
    "held_at_reads",
    "held_capacities",
    "oldest_held_position",
    "lookup_continuation",
    "split_target_kv",
    "target_fingerprint",
    "target_signature",
    "tli_unsupported_reason",
    "unsupported_target_reason",
]
