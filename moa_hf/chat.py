"""One home for what turns a prompt into the target's input and tells where its answer ends: the chat template as one
user turn (`chat_text`, `chat_ids`, `encode_chat`) or a whole conversation (`conversation_ids`) and the EOS ids
`generate` stops at (`eos_token_ids`)."""

from __future__ import annotations

import torch

__all__ = ["ChatTemplateError", "chat_ids", "chat_text", "conversation_ids", "encode_chat", "eos_token_ids"]


class ChatTemplateError(ValueError):
    """The tokenizer cannot encode what was asked (no chat template, or no pad token to batch with)."""


def chat_text(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """`prompt` as one user turn (after a system turn when given) in the tokenizer's chat template, with the
    generation prompt, as text."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("The target's tokenizer has no chat template; use an instruction-tuned target.")
    messages = [{"role": "user", "content": prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_ids(
    tokenizer, prompt: str, system_prompt: str | None = None, raw_without_template: bool = False
) -> list[int]:
    """Token ids of `chat_text` (the template holds the special tokens, so none are added); with
    `raw_without_template`, a tokenizer without a chat template encodes the prompt as plain text instead of raising."""
    if raw_without_template and getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer(prompt)["input_ids"])
    return list(tokenizer(chat_text(tokenizer, prompt, system_prompt), add_special_tokens=False)["input_ids"])


def conversation_ids(tokenizer, turns: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a whole conversation (``[{"role", "content"}, ...]``) in the tokenizer's chat template, with the
    generation prompt for the assistant's next turn unless `add_generation_prompt=False`."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("The target's tokenizer has no chat template; use an instruction-tuned target.")
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_chat(tokenizer, prompts: str | list[str], device: torch.device | str | None = None) -> dict:
    """`input_ids` and `attention_mask` [B, P] of the chat-formatted prompt(s) (one string: B = 1), on `device`;
    several prompts are left-padded to the longest (the tokenizer needs a pad token)."""
    if isinstance(prompts, str):
        enc = tokenizer(chat_text(tokenizer, prompts), return_tensors="pt", add_special_tokens=False)
    else:
        if tokenizer.pad_token_id is None:
            raise ChatTemplateError(
                "The target's tokenizer has no pad token, which batching needs to left-pad its prompts; save the "
                "tokenizer with one (e.g. tokenizer.pad_token = tokenizer.eos_token) or run one prompt at a time."
            )
        texts = [chat_text(tokenizer, p) for p in prompts]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def eos_token_ids(config) -> list[int]:
    """The ids `generate` stops a row at, from a generation config or model config (or a model: its generation
    config): its `eos_token_id` as a list (empty: it stops only at the length)."""
    config = getattr(config, "generation_config", config)
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
