"""The chain-drafting loop of this library, `draft_chain`: assisted generation's drafting call
(`DrafterMixin.generate`), the chains on a tree drafting state (`DrafterMixin.tree_chain`: what the vLLM proposer
drafts; the engine's `build_tree` at top-k 1 drafts the same tokens, tests/test_tree_drafter.py) and the serving
client's drafting (`moa_hf.serving.client`) all run it.

This file ships inside every Hub repo as remote code: it imports only torch.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Chain", "draft_chain", "sample_multinomial"]


@dataclass
class Chain:
    """What `draft_chain` drafted for B rows: `tokens` [B, n] (row b's chain is its first `lengths[b]`, the token that
    stopped it included), `scores` the [B, V] scores each position's token was picked from, and `ids` the sequences
    it was given followed by `tokens` (None when none were given)."""

    tokens: torch.Tensor
    lengths: list[int]
    scores: list[torch.Tensor]
    ids: torch.Tensor | None = None

    def lists(self) -> list[list[int]]:
        """Each row's chain as Python ints."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths)]


def draft_chain(
    next_logits: Callable[[torch.Tensor | None], torch.Tensor],
    max_tokens: int,
    *,
    eos: torch.Tensor | None = None,
    threshold: float = 0.0,
    min_tokens: int = 0,
    ids: torch.Tensor | None = None,
    process: Callable | None = None,
    sample: Callable | None = None,
) -> Chain:
    """Draft up to `max_tokens` tokens per row of a batch, one drafter call per position for all rows (gpt-fast's
    `decode_n_tokens`, batched): the chain-drafting loop of this library.

    `next_logits(token)` gives the drafter's [B, V] logits of the next token (token None: the first one, after the
    verified tokens; else after the drafted `token` [B, 1]). A position's scores are `process(ids, logits)` (logits
    processors; `ids` [B, T] the sequences so far), with the `eos` tokens masked while fewer than `min_tokens` were
    drafted; its token is their argmax, or `sample(ids, scores)` -> (token [B, 1], its probabilities [B, V] or None).
    A row stops after an `eos` token or, from the `min_tokens`-th token on, after a token whose probability is below
    `threshold`; the loop ends when every row has stopped (one host synchronisation per position)."""
    tokens, scores, stops, done, token = [], [], [], None, None
    check_eos = eos is not None and eos.numel() > 0
    for d in range(max_tokens):
        logits = next_logits(token)  # [B, V]
        if process is not None:
            logits = process(ids, logits)
        if d < min_tokens and check_eos:
            logits[:, eos] = -float("inf")
        probs = None
        if sample is None:
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            token, probs = sample(ids, logits)
        tokens.append(token)
        scores.append(logits)
        if ids is not None:
            ids = torch.cat([ids, token], dim=-1)  # [B, T+d+1]
        stop = torch.isin(token, eos) if check_eos else None  # [B, 1]
        if threshold > 0 and d + 1 >= min_tokens:
            probs = logits.softmax(-1) if probs is None else probs
            low = probs.gather(-1, token) < threshold  # [B, 1]
            stop = low if stop is None else stop | low
        if stop is not None and stop.shape[0] == 1:  # one row: the loop ends at its first stop
            if bool(stop):
                break
        elif stop is not None:
            stops.append((d, stop))
            done = stop if done is None else done | stop
            if bool(done.all()):
                break
    n = len(tokens)
    if ids is not None:
        out = ids[:, ids.shape[1] - n :]  # [B, n]
    else:
        out = torch.cat(tokens, dim=-1) if tokens else torch.zeros(0, 0, dtype=torch.long)  # [B, n]
    lengths = [n] * out.shape[0]
    if stops:  # each row up to its first stop
        stopped = torch.cat([stop for _, stop in stops], dim=1)  # [B, m]
        at = torch.tensor([d + 1 for d, _ in stops], device=out.device)  # [m] the length at each check
        lengths = torch.where(stopped.any(1), at[stopped.int().argmax(1)], n).tolist()
    return Chain(out, lengths, scores, ids)


def sample_multinomial(ids: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_chain`'s `sample` for sampling from the scores: (token [B, 1], probabilities [B, V])."""
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1), probs
