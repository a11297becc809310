"""The tests' tiny offline models, tokenizer and data, built from configs in a fraction of a second (no downloads).

- `make_target(family)`: a tiny random target of one of `FAMILIES` (vocabulary 128: pad 0, bos 1, eos 2).
- `tiny_target()` + `tiny_tokenizer()`: a small random Llama and a character-level ChatML tokenizer with matching ids
  (vocabulary 100: pad 0, eos 1), for the training tests; `random_dataset`, `tiny_training_args` go with them.
- `make_independent()`: a smaller Llama on `make_target`'s vocabulary, an independent assistant model.
- `OracleDrafter`: a drafter whose proposals are right with a chosen probability.
"""

from __future__ import annotations

import itertools
import random

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from moa_hf import MoADrafterModel

__all__ = [
    "FAMILIES",
    "MORE_FAMILIES",
    "SLIDING_FAMILIES",
    "OracleDrafter",
    "make_independent",
    "make_target",
    "random_dataset",
    "sorted_drafter",
    "tiny_target",
    "tiny_tokenizer",
    "tiny_training_args",
]

# ---------------------------------------------------------------------------------------------------------------------
# Targets of several families (vocabulary 128)
# ---------------------------------------------------------------------------------------------------------------------
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

# Targets with sliding-window layers (window 8: shorter than the tests' prompts), kept out of `FAMILIES` (the
# `family` fixture of every other test). "mistral-default" keeps MistralConfig's own default window (4096).
_S, _F, _W = "sliding_attention", "full_attention", {"sliding_window": 8}
SLIDING_FAMILIES = {
    "mistral-sliding": (MistralConfig, MistralForCausalLM, _W),  # every layer slides
    "mistral-default": (MistralConfig, MistralForCausalLM, {}),
    "qwen2-sliding": (Qwen2Config, Qwen2ForCausalLM, {**_W, "use_sliding_window": True, "max_window_layers": 1}),
    "phi3-sliding": (Phi3Config, Phi3ForCausalLM, _W),  # every layer slides
    "gemma2-sliding": (Gemma2Config, Gemma2ForCausalLM, {**_W, "head_dim": 16}),  # alternating, sliding first
    "gemma3-sliding": (Gemma3TextConfig, Gemma3ForCausalLM, {**_W, "head_dim": 16, "layer_types": [_S, _S, _F]}),
    "cohere2-sliding": (Cohere2Config, Cohere2ForCausalLM, {**_W, "layer_types": [_S, _S, _F]}),
}

# More full-attention families, for the speculative engine's exactness tests.
MORE_FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": None}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16, "layer_types": [_F, _F, _F]}),
}


def make_target(family: str = "llama", seed: int = 0, **overrides):
    config_cls, model_cls, extra = {**FAMILIES, **MORE_FAMILIES, **SLIDING_FAMILIES}[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    config.name_or_path = f"tiny-random-{family}"
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = None  # tests control stopping explicitly
    model.generation_config.pad_token_id = 0
    return model


def make_independent(seed: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    lm = LlamaForCausalLM(config).eval()
    lm.generation_config.num_assistant_tokens = 3
    lm.generation_config.assistant_confidence_threshold = 0.0
    return lm


class OracleDrafter(MoADrafterModel):
    """A drafter whose proposal is the target's greedy token with probability `p_right` (else a wrong one), so that
    every acceptance length is exercised. It runs the real drafter underneath, keeping every cache in use."""

    reference: list[int] = []
    p_right: float = 0.8
    rng: random.Random = random.Random(0)

    def draft_step(self, new_ids, cache):
        logits = super().draft_step(new_ids, cache)
        pos = cache.get_seq_length()  # the drafted token goes to this position
        if pos < len(self.reference):
            right = self.reference[pos]
            token = right if self.rng.random() < self.p_right else (right + 1 + self.rng.randrange(100)) % 128
            logits = torch.full_like(logits, -10.0)
            logits[:, token] = 10.0
        return logits


def sorted_drafter(target, num_blocks: int = 3, seed: int = 0, scale: float = 0.2, **overrides) -> MoADrafterModel:
    """A random sorted MoA drafter (`num_blocks` exits) for `target` in eval mode, its matrices drawn with std `scale`
    (the deeper blocks' zero-initialised output projections too), so that every exit drafts differently."""
    import moa_hf

    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, num_blocks=num_blocks, **overrides)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale)
    return drafter.eval()


def target_as_drafter(target, noise: float = 0.0) -> MoADrafterModel:
    """A MoA drafter that is its target: Target Layer Inference over all L layers, and SA and CA that add nothing
    (their output projections zero), so its feature is the token's embedding and TLI runs the whole target on it
    with the target's keys/values of the verified tokens (its TLI memory) and its own of the drafted ones. Every
    token it drafts is the target's greedy one exactly where that memory lines up with the target's cache.
    `noise` > 0 draws those projections with that std instead (seed 0): a drafter that is often, not always, right."""
    import moa_hf

    drafter = moa_hf.build_drafter(target, target_layer_inference=target.config.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for linear in (
            drafter.self_attention.self_attn.o_proj,
            drafter.self_attention.mlp.down_proj,
            drafter.cross_attention.attn.o_proj,
            drafter.cross_attention.mlp.down_proj,
        ):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * noise)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return drafter.eval()


# ---------------------------------------------------------------------------------------------------------------------
# A character-level chat tokenizer and a matching Llama (vocabulary 100), random data, training arguments
# ---------------------------------------------------------------------------------------------------------------------
_SPECIALS = ("<pad>", "<|im_end|>", "<|im_start|>")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(whitespace_runs: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (printable ASCII + newline, 100 tokens) with a ChatML chat template.

    Ids: 0 <pad>, 1 <|im_end|> (eos), 2 <|im_start|>, then the characters, last <unk>. `whitespace_runs`: 28 more
    tokens (vocabulary 128), runs of 2 to 4 spaces and newlines, one token each, as a BPE tokenizer merges whitespace:
    text then no longer maps to ids one to one ("\n" then " " re-encode as "\n ").
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    runs = ["".join(r) for n in (2, 3, 4) for r in itertools.product(" \n", repeat=n)] if whitespace_runs else []
    vocab = {tok: i for i, tok in enumerate([*_SPECIALS, *chars, "<unk>", *runs])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    split = r"[ \n]{1,4}|[\s\S]" if whitespace_runs else r"[\s\S]"  # longest whitespace run, else one character
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_target(
    seed: int = 0,
    vocab_size: int = 100,
    hidden_size: int = 64,
    num_hidden_layers: int = 3,
    initializer_range: float = 0.02,
    logit_scale: float = 1.0,
    **overrides,
) -> LlamaForCausalLM:
    """A small random Llama (eval mode, fp32) matching `tiny_tokenizer`'s ids (eos 1, pad 0).

    `logit_scale` multiplies the LM head's weights: the same greedy continuations with peakier next-token
    distributions (a random Llama with a small `initializer_range` is nearly uniform over its vocabulary).
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def random_dataset(n: int = 16, seed: int = 0, vocab: int = 100):
    """Random (prompt, response) token sequences of varied lengths, as `moa data` writes them (no generation)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows, prompt_lengths = [], []
    for _ in range(n):
        p = int(torch.randint(3, 9, (1,), generator=g))
        r = int(torch.randint(10, 24, (1,), generator=g))
        rows.append(torch.randint(3, vocab, (p + r,), generator=g).tolist())
        prompt_lengths.append(p)
    return datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": prompt_lengths})


def tiny_training_args(tmp_path, **overrides):
    """`MoATrainingArguments` for a few quick CPU steps in `tmp_path/out` (no saving, no reporting)."""
    from moa_hf.training import MoATrainingArguments

    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        eval_num_prompts=0,
    )
    kwargs.update(overrides)
    return MoATrainingArguments(**kwargs)
