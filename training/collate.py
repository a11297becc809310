"""The training batch: `MoADataCollator` right-pads (prompt + response) examples, labels the positions the loss
counts (`IGNORE_INDEX` elsewhere) and pads cached target states alongside."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["IGNORE_INDEX", "MoADataCollator"]

IGNORE_INDEX = -100


@dataclass
class MoADataCollator:
    """Right-pads examples ``{"input_ids", "prompt_length"[, "response_mask", "sample_index", "target_kv",
    "final_hidden", "tli_hidden"]}`` into a training batch (cached target states are padded with zeros to [B, T, ...]).

    Returns ``input_ids`` and ``attention_mask`` [B, T], ``labels`` [B, T] (position i is counted, with label
    input_ids[i+1], when token i+1 is a response token: every token from `prompt_length` on, or, for a conversation
    with a ``response_mask``, every token of an assistant turn; else -100), ``response_mask`` [B, T] (bool) for
    conversations, ``prompt_lengths`` [B] and ``sample_index`` [B]
    (the example's index in the dataset: the seed of its random cycle lengths), and ``target_index`` [B] when the
    examples carry one (which of the trainer's targets produced them).
    """

    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [list(f["input_ids"])[: self.max_length] if self.max_length else list(f["input_ids"]) for f in features]
        width = max(len(s) for s in seqs)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(seqs)
        input_ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((B, width), dtype=torch.long)
        labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
        prompt_lengths = torch.zeros(B, dtype=torch.long)
        conversations = "response_mask" in features[0]
        response = torch.zeros((B, width), dtype=torch.bool) if conversations else None  # [B, T]
        for b, (seq, f) in enumerate(zip(seqs, features)):
            n = len(seq)
            p = min(int(f["prompt_length"]), n)
            input_ids[b, :n] = torch.tensor(seq, dtype=torch.long)
            attention_mask[b, :n] = 1
            if conversations:  # position i is counted when token i+1 is an assistant's
                response[b, :n] = torch.tensor(list(f["response_mask"])[:n], dtype=torch.bool)
                labels[b, : n - 1] = input_ids[b, 1:n].masked_fill(~response[b, 1:n], IGNORE_INDEX)
            else:
                first = max(p - 1, 0)  # position p-1 predicts the first response token
                if n - 1 > first:
                    labels[b, first : n - 1] = input_ids[b, first + 1 : n]
            prompt_lengths[b] = p
        sample_index = torch.tensor([int(f.get("sample_index", -1)) for f in features], dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "prompt_lengths": prompt_lengths,
            "sample_index": sample_index,
        }
        if conversations:
            batch["response_mask"] = response
        if "target_index" in features[0]:
            batch["target_index"] = torch.tensor([int(f["target_index"]) for f in features], dtype=torch.long)
        for key in ("target_kv", "final_hidden", "tli_hidden"):  # cached target states (`states.TargetStatesDataset`)
            if key in features[0]:
                first = features[0][key]
                padded = first.new_zeros(B, width, *first.shape[1:])  # [B, T, ...]
                for b, (seq, f) in enumerate(zip(seqs, features)):
                    padded[b, : len(seq)] = f[key][: len(seq)]
                batch[key] = padded
        return batch
