"""Tiny offline models for tests and examples: a character-level chat tokenizer and a small random Llama target.

Nothing here is downloaded; everything is built from a config in a fraction of a second.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["random_dataset", "tiny_target", "tiny_tokenizer", "tiny_training_args"]

_SPECIALS = ("<pad>", "<|im_end|>", "<|im_start|>")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (printable ASCII + newline, 100 tokens) with a ChatML chat template.

    Ids: 0 <pad>, 1 <|im_end|> (eos), 2 <|im_start|>, then the characters, last <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*_SPECIALS, *chars, "<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
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
    from .arguments import MoATrainingArguments

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
