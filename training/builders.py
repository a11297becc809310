"""Initialisations of fresh drafters for a target: an independent small LM (the target's first layers), a target
layer's weights, a reduced draft vocabulary. Which drafter `moa train --kind` builds: `drafters.py`."""

from __future__ import annotations

from collections import Counter

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

__all__ = ["build_independent", "frequent_tokens", "init_from_target_layer"]


def _decoder_layers(target: PreTrainedModel) -> torch.nn.ModuleList:
    layers = getattr(target.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} has no `layers` in its decoder; cannot copy a target layer.")
    return layers


def _copy_matching(dst: torch.nn.Module, src: torch.nn.Module) -> int:
    """Copy every parameter of `src` whose name and shape match one of `dst`; the number copied."""
    own = dict(dst.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, p in src.named_parameters():
            if name in own and own[name].shape == p.shape:
                own[name].copy_(p.to(own[name].dtype))
                copied += 1
    return copied


def init_from_target_layer(drafter: torch.nn.Module, target: PreTrainedModel, layer: int = -1) -> int:
    """Start the drafter's decoder layers from the target's decoder layer `layer` (same width): MoA's SA layer and
    its CA layer's attention/MLP/norms; an EAGLE-style drafter's decoder layer. Returns the tensors copied."""
    src = _decoder_layers(target)[layer]
    copied = 0
    if hasattr(drafter, "self_attention") and hasattr(drafter, "cross_attention"):  # MoA
        copied += _copy_matching(drafter.self_attention, src)
        ca = drafter.cross_attention
        copied += _copy_matching(ca.attn, src.self_attn)
        copied += _copy_matching(ca.mlp, src.mlp)
        copied += _copy_matching(ca.input_layernorm, src.input_layernorm)
        copied += _copy_matching(ca.post_attention_layernorm, src.post_attention_layernorm)
    else:
        for module in drafter.modules():
            if module is not drafter and hasattr(module, "self_attn") and hasattr(module, "mlp"):
                copied += _copy_matching(module, src)
    if copied == 0:
        raise ValueError("No drafter weight matched the target layer's names and shapes; nothing was copied.")
    return copied


def frequent_tokens(dataset, size: int, vocab_size: int, responses_only: bool = True) -> torch.Tensor:
    """The `size` most frequent token ids [size] of a `moa data` dataset's responses (the target's own outputs),
    ties broken by id; padded with the lowest unused ids when the data has fewer distinct tokens."""
    counts: Counter = Counter()
    for ex in dataset:
        ids = ex["input_ids"]
        if responses_only and "response_mask" in ex:  # a conversation: every assistant turn
            ids = [i for i, m in zip(ids, ex["response_mask"]) if m]
        elif responses_only:
            ids = ids[int(ex["prompt_length"]) :]
        counts.update(int(i) for i in ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        used = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in used][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def build_independent(target: PreTrainedModel, num_layers: int = 2) -> PreTrainedModel:
    """A small standalone causal LM of the target's family: the target's embedding, its first `num_layers` decoder
    layers, final norm and head (tied like the target's), all copied, the embedding/head frozen; then distilled as an
    ordinary assistant."""
    cfg = AutoConfig.for_model(**target.config.to_dict())
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in target.state_dict().items() if k in model.state_dict()}, strict=False
    )
    if any(not k.endswith("lm_head.weight") for k in missing):
        raise ValueError(f"Could not initialise the independent LM from the target: missing {missing}.")
    model.get_input_embeddings().requires_grad_(False)  # the target's (tied) embedding/head stay as they are
    model.generation_config.num_assistant_tokens = 5
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.3
    return model
