"""Prompt lookup inside a drafter: drafts copied from earlier in the verified text, at the cost of no forward pass.

Before running its network, a drafter with prompt lookup on looks for the longest suffix n-gram of the verified
text earlier in it (`lookup_max_ngram` down to `lookup_min_ngram` tokens) and, on a match, proposes up to
`lookup_num_tokens` tokens that followed it. The settings are typed fields of the drafter's config (`LookupSettings`
reads them); older checkpoints kept them in their generation config (`pop_legacy_lookup_keys` moves them).

This file ships inside every Hub repo as remote code: it imports only torch and the standard library.
"""

import bisect
from dataclasses import dataclass

import torch

__all__ = [
    "LEGACY_LOOKUP_KEYS",
    "LOOKUP_MAX_NGRAM",
    "LOOKUP_MIN_NGRAM",
    "LookupIndex",
    "LookupSettings",
    "lookup_continuation",
    "pop_legacy_lookup_keys",
]

LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM = 3, 1  # default longest / shortest n-gram matched

# generation-config keys in which older checkpoints kept these settings -> the config field that holds them now
LEGACY_LOOKUP_KEYS = {
    "prompt_lookup_num_tokens": "lookup_num_tokens",
    "max_matching_ngram_size": "lookup_max_ngram",
    "prompt_lookup_min_ngram": "lookup_min_ngram",
    "prompt_lookup_halve_per_ngram": "lookup_halve_per_ngram",
}
_TRANSFORMERS_KEYS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")  # GenerationConfig's own (None: unset)


def _match_tokens(n: int, max_ngram: int, max_tokens: int, halve_per_ngram: bool) -> int:
    """The tokens a match of n tokens proposes: `max_tokens`, halved per token shorter than `max_ngram` when
    `halve_per_ngram` (at least 1)."""
    return max(1, max_tokens >> (max_ngram - n)) if halve_per_ngram else max_tokens


def lookup_continuation(
    ids: torch.Tensor, max_ngram: int, max_tokens: int, min_ngram: int = 1, halve_per_ngram: bool = False
) -> torch.Tensor:
    """Prompt lookup: the tokens that followed an earlier occurrence of the longest suffix n-gram of `ids` [T].

    n runs from `max_ngram` down to `min_ngram`; among the matches of one n the most recent one with `max_tokens`
    tokens after it wins (else the earliest, which has the longest continuation). With `halve_per_ngram` a match of
    n tokens proposes `max_tokens // 2 ** (max_ngram - n)` (at least 1): shorter matches are right less often, so
    they risk fewer verification slots. Returns [<= max_tokens] ids, empty when no n-gram of `ids` ends earlier than
    its last token.
    """
    T = ids.shape[0]
    for n in range(min(max_ngram, T - 1), max(min_ngram, 1) - 1, -1):
        windows = ids[: T - 1].unfold(0, n, 1)  # [T-n, n]: the n-gram starting at i, for i + n <= T - 1
        hits = (windows == ids[T - n :]).all(dim=1).nonzero().flatten()  # [M] starts of matches
        if hits.numel():
            k = _match_tokens(n, max_ngram, max_tokens, halve_per_ngram)
            full = hits[hits + n + k <= T]  # matches followed by k tokens
            start = int(full[-1] if full.numel() else hits[0]) + n
            return ids[start : start + k]
    return ids[:0]


class LookupIndex:
    """`lookup_continuation` over a text that grows, without rescanning it: the start positions of every n-gram
    (`min_ngram` <= n <= `max_ngram`) that ends before the text's last token, kept as the text grows (`extend`, a few
    dictionary updates per new token), so each lookup (`continuation`) is one dictionary read per n. The speculative
    engine keeps one per row and looks up every cycle."""

    def __init__(self, max_ngram: int, min_ngram: int = 1):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.starts = {n: {} for n in range(max(min_ngram, 1), max_ngram + 1)}  # n -> {n-gram: [start, ...]}

    def extend(self, tokens) -> None:
        """Append `tokens` (ints) to the text."""
        old = len(self.tokens)
        self.tokens += tokens
        T = len(self.tokens)
        for n, table in self.starts.items():  # n-grams starting at i count once i + n <= T - 1
            for i in range(max(0, old - n), T - n):
                table.setdefault(tuple(self.tokens[i : i + n]), []).append(i)

    def continuation(self, max_tokens: int, halve_per_ngram: bool = False) -> list[int]:
        """`lookup_continuation(text, max_ngram, max_tokens, min_ngram, halve_per_ngram)`, as a list."""
        T, max_ngram = len(self.tokens), self.max_ngram
        for n in sorted(self.starts, reverse=True):
            hits = self.starts[n].get(tuple(self.tokens[T - n :])) if n <= T - 1 else None
            if hits:  # ascending starts
                k = _match_tokens(n, max_ngram, max_tokens, halve_per_ngram)
                last = bisect.bisect_right(hits, T - n - k) - 1  # the most recent match followed by k tokens
                start = (hits[last] if last >= 0 else hits[0]) + n
                return self.tokens[start : start + k]
        return []


@dataclass(frozen=True)
class LookupSettings:
    """A drafter's prompt lookup settings (the `lookup_*` fields of its config).

    Args:
        num_tokens: the most tokens one lookup proposes (0: lookup off); transformers' `num_assistant_tokens` (the
            draft length of the cycle) caps it.
        max_ngram: the longest suffix n-gram matched.
        min_ngram: the shortest n-gram match that drafts by lookup (1: any earlier occurrence of the last token);
            shorter matches leave the cycle to the network.
        halve_per_ngram: a match one token shorter than `max_ngram` proposes half of `num_tokens`, two shorter a
            quarter, ... (at least 1): short matches are right less often, so they risk fewer verification slots.
    """

    num_tokens: int = 0
    max_ngram: int = LOOKUP_MAX_NGRAM
    min_ngram: int = LOOKUP_MIN_NGRAM
    halve_per_ngram: bool = False

    def __post_init__(self):
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"lookup_{name} must be an integer, got {value!r}")
        if not isinstance(self.halve_per_ngram, bool):
            raise ValueError(f"lookup_halve_per_ngram must be True or False, got {self.halve_per_ngram!r}")
        if self.num_tokens < 0:
            raise ValueError(f"lookup_num_tokens must be >= 0 (0 turns prompt lookup off), got {self.num_tokens}")
        if self.min_ngram < 1:
            raise ValueError(f"lookup_min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(
                f"lookup_max_ngram ({self.max_ngram}) must be >= lookup_min_ngram ({self.min_ngram}); lower "
                "lookup_min_ngram or raise lookup_max_ngram"
            )

    @classmethod
    def from_config(cls, config) -> "LookupSettings":
        """The settings in a drafter config's `lookup_*` fields (raises `ValueError` for invalid ones)."""
        return cls(
            num_tokens=config.lookup_num_tokens,
            max_ngram=config.lookup_max_ngram,
            min_ngram=config.lookup_min_ngram,
            halve_per_ngram=config.lookup_halve_per_ngram,
        )

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0

    def index(self) -> LookupIndex:
        """An empty `LookupIndex` for these settings (`propose` takes it in place of the ids)."""
        return LookupIndex(self.max_ngram, self.min_ngram)

    def propose(
        self, ids: "torch.Tensor | LookupIndex", max_new_tokens: int, min_new_tokens: int, eos: torch.Tensor
    ) -> torch.Tensor | None:
        """The tokens [n] that lookup proposes after the verified `ids` [T] (or the text of a `LookupIndex`), or
        None (no match): at most `max_new_tokens`, up to and including the first `eos` token (or before it while
        fewer than `min_new_tokens` were drafted)."""
        if max_new_tokens <= 0:
            return None
        num = self.num_tokens
        budget = num if self.halve_per_ngram else min(num, max_new_tokens)  # halving: the longest match's share
        if isinstance(ids, LookupIndex):
            tokens = torch.tensor(ids.continuation(budget, self.halve_per_ngram), dtype=torch.long, device=eos.device)
        else:
            tokens = lookup_continuation(ids, self.max_ngram, budget, self.min_ngram, self.halve_per_ngram)
        tokens = tokens[:max_new_tokens]  # then the cycle's cap
        if eos.numel() and tokens.numel():
            at_eos = torch.isin(tokens, eos).nonzero().flatten()
            if at_eos.numel():  # stop at the first end-of-sequence token, or before it while it is still banned
                first = int(at_eos[0])
                tokens = tokens[: first + 1] if first >= min_new_tokens else tokens[:first]
        return tokens if tokens.numel() else None


def pop_legacy_lookup_keys(generation_config) -> dict:
    """Remove the prompt lookup keys older drafters kept in their generation config; return their values as config
    fields ({"lookup_num_tokens": ...}, unset ones left out).

    transformers' own keys (`prompt_lookup_num_tokens`, `max_matching_ngram_size`, which mean transformers' prompt
    lookup decoding) are reset to None, the invented ones deleted.
    """
    fields = {}
    for key, name in LEGACY_LOOKUP_KEYS.items():
        value = getattr(generation_config, key, None)
        if key in _TRANSFORMERS_KEYS:
            setattr(generation_config, key, None)
        elif hasattr(generation_config, key):
            delattr(generation_config, key)
        if value is not None:
            fields[name] = bool(value) if name == "lookup_halve_per_ngram" else int(value)
    return fields
