"""Conversions of trained drafters."""

from __future__ import annotations

import copy

from transformers import PreTrainedModel

from moa_hf import MoADrafterModel

__all__ = ["with_own_embeddings"]


def with_own_embeddings(drafter: MoADrafterModel, target: PreTrainedModel) -> MoADrafterModel:
    """A copy of `drafter` (trained with the target's borrowed embedding / LM head) that owns frozen copies of them.

    This is how to get a standalone drafter after training with borrowed embeddings (required under FSDP / ZeRO-3,
    see docs/training.md): the copies are exactly the modules training used.
    """
    if drafter.config.own_embeddings:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.own_embeddings = True
    own = MoADrafterModel(config).to(device=drafter.device, dtype=drafter.dtype)
    missing, unexpected = own.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight", "lm_head.weight"}:
        raise ValueError(f"Unexpected weights when converting: missing {missing}, unexpected {unexpected}.")
    own.copy_embeddings_from(target)
    own.generation_config = copy.deepcopy(drafter.generation_config)
    own.embed_tokens.requires_grad_(False)
    own.lm_head.requires_grad_(False)
    return own
