"""LoRA / PEFT helpers for the MoA drafter.

PEFT wraps the drafter without breaking speculative decoding: a `peft.PeftModel` forwards unknown attributes
(`attach`, `generate`, `speculation_stats`, ...) to the drafter, and LoRA layers are injected into the drafter's own
modules, so both the adapted model and the merged one (`merge_and_unload`) work as `assistant_model`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moa_hf import MoADrafterModel

__all__ = ["DEFAULT_LORA_TARGETS", "apply_lora", "merge_lora"]

# Linear layers of the SA, CA and LSA blocks (the embedding / LM head are the target's and stay frozen).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(
    drafter: MoADrafterModel,
    r: int = 16,
    alpha: int | None = None,
    dropout: float = 0.0,
    target_modules: Sequence[str] = DEFAULT_LORA_TARGETS,
    **kwargs,
):
    """`peft.get_peft_model(drafter, LoraConfig(...))` with the drafter's linear layers as targets."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        **kwargs,
    )
    return get_peft_model(drafter, config)


def merge_lora(model) -> MoADrafterModel:
    """Merge LoRA weights into the drafter and return the plain `MoADrafterModel` (still attached if it was)."""
    if isinstance(model, MoADrafterModel):
        return model
    merged = model.merge_and_unload()
    if not isinstance(merged, MoADrafterModel):
        raise TypeError(f"merge_and_unload returned {type(merged).__name__}, expected a MoADrafterModel.")
    return merged
