"""`HiddenRecordingCache`: a session's target cache that also keeps the target's final hidden states.

A drafter with `context_final_hidden` reads, for every verified token, the target's post-norm final hidden state
next to its keys/values. The server runs the target (`batching.batched_forward`), so a session of such a drafter
gets this cache: each forward records the hidden states of the positions it fed, and a crop (a rejected draft)
drops them with the keys/values, so the server reads the context of verified positions only, as the
`assistant_model` path does through its hook on the target's decoder.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["HiddenRecordingCache", "record_hidden"]


class HiddenRecordingCache(DynamicCache):
    """A `DynamicCache` with `final_hidden` [P, D]: the target's post-norm final hidden states of positions 0..P-1
    (P = the cache's length once the forward that fed them has recorded them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.final_hidden: torch.Tensor | None = None

    def record(self, start: int, hidden: torch.Tensor) -> None:
        """The hidden states [n, D] of positions start..start+n-1 (a forward fed them); later ones are replaced."""
        kept = self.final_hidden[:start] if self.final_hidden is not None else hidden[:0]
        if kept.shape[0] != start:
            raise RuntimeError(f"hidden states of positions {kept.shape[0]}..{start - 1} were never recorded")
        self.final_hidden = torch.cat([kept, hidden.detach()], dim=0)  # [start+n, D]

    def hidden_between(self, start: int, end: int) -> torch.Tensor:
        """[1, end-start, D]: the recorded hidden states of positions [start, end)."""
        if self.final_hidden is None or self.final_hidden.shape[0] < end:
            have = 0 if self.final_hidden is None else self.final_hidden.shape[0]
            raise RuntimeError(f"hidden states recorded for positions < {have}, asked for {start}..{end - 1}")
        return self.final_hidden[None, start:end]

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.final_hidden is not None:
            self.final_hidden = self.final_hidden[: self.get_seq_length()]


def record_hidden(caches: list, starts: list[int], rows: list[torch.Tensor | None]) -> None:
    """Record each row's hidden states [n_b, D] (None: not asked) into its cache if it is a `HiddenRecordingCache`."""
    for cache, start, hidden in zip(caches, starts, rows):
        if isinstance(cache, HiddenRecordingCache) and hidden is not None:
            cache.record(start, hidden)
