"""One home for converting a drafter between borrowing the target's embedding and LM head and owning copies of them
(`own_embeddings`): `with_own_embeddings` (a standalone drafter: after training with borrowed ones, for a client that
runs alone) and `without_own_embeddings` (a lean drafter to publish)."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

__all__ = ["EMBEDDING_MODULES", "with_own_embeddings", "without_own_embeddings"]

EMBEDDING_MODULES = ("embed_tokens", "lm_head")  # a drafter's own copies of the target's embedding and LM head


def with_own_embeddings(drafter: torch.nn.Module, target: PreTrainedModel):
    """A copy of `drafter` (trained with the target's borrowed embedding / LM head) that owns frozen copies of them;
    `drafter` itself when it owns them already.

    This is how to get a standalone drafter after training with borrowed embeddings (required under FSDP / ZeRO-3,
    see docs/training.md): the copies are exactly the modules training used.
    """
    if drafter.config.own_embeddings:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.own_embeddings = True
    own = type(drafter)(config).to(device=drafter.device, dtype=drafter.dtype)
    missing, unexpected = own.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or set(missing) != {f"{name}.weight" for name in EMBEDDING_MODULES}:
        raise ValueError(f"Unexpected weights when converting: missing {missing}, unexpected {unexpected}.")
    own.copy_embeddings_from(target)
    own.generation_config = copy.deepcopy(drafter.generation_config)
    own.embed_tokens.requires_grad_(False)
    own.lm_head.requires_grad_(False)
    return own


def without_own_embeddings(drafter: torch.nn.Module):
    """A copy of `drafter` without its own embedding and LM head copies (it then borrows the target's); `drafter`
    itself when it has none."""
    if not drafter.config.own_embeddings:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.own_embeddings = False
    param = next(drafter.parameters())
    lean = type(drafter)(config).to(device=param.device, dtype=param.dtype)
    state = {k: v for k, v in drafter.state_dict().items() if k.split(".")[0] not in EMBEDDING_MODULES}
    lean.load_state_dict(state, strict=True)
    lean.generation_config = copy.deepcopy(drafter.generation_config)
    return lean
