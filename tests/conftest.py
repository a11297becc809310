"""Shared fixtures: tiny random targets of several families, built from configs (no downloads)."""

import random

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from moa_hf import MoADrafterModel

torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core machine

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 16}),
}


def make_target(family: str = "llama", seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config.name_or_path = f"tiny-random-{family}"
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None  # tests control stopping explicitly
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def llama_target():
    return make_target("llama")


class OracleDrafter(MoADrafterModel):
    """A drafter whose proposal is the target's greedy token with probability `p_right` (else a wrong one), so that
    every acceptance length is exercised. It runs the real drafter underneath, keeping every cache in use."""

    reference: list[int] = []
    p_right: float = 0.8
    rng: random.Random = random.Random(0)

    def _decode(self, new_ids, cache):
        logits = super()._decode(new_ids, cache)
        pos = cache.get_seq_length()  # the drafted token goes to this position
        if pos < len(self.reference):
            right = self.reference[pos]
            token = right if self.rng.random() < self.p_right else (right + 1 + self.rng.randrange(100)) % 128
            logits = torch.full_like(logits, -10.0)
            logits[:, token] = 10.0
        return logits
