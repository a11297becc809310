"""The MoA drafter's chain drafting (assisted generation's drafting calls, `draft_step`): its cache `MoADrafterCache`
(SA keys/values of the tokens fed, the CA memory of the verified ones, the TLI cache, a sorted drafter's deeper blocks)
and `MoAChainDrafting` (the drafter's `chain`): appending the context of newly verified tokens to the CA memory
(`extend`) and one drafting step over new tokens (`decode`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache

from .drafting import RollbackCache
from .sorted_exits import DeepBlock, MoASortedExits, crop_deep

__all__ = ["MoAChainDrafting", "MoADrafterCache"]


class MoADrafterCache(RollbackCache):
    """Everything the drafter keeps between drafting calls; all of it rolls back to any length with `crop`.

    - SA keys/values of every token fed so far (positions 0..seq_length-1).
    - CA memory: CA keys/values of the context vectors of verified tokens (positions 0..context_length-1), and which
      of them hold a context at all (`ca_valid`: a position that a sliding-window layer of the target no longer held
      when it was read has none, and is kept out of the CA's attention).
    - TLI (N > 0): a cache for the target's last N layers: the target's own keys/values for verified positions,
      followed by the ones computed from drafted positions.
    - Sorted drafters (K > 1 blocks): `deep[k-2]` holds block k's SA keys/values, its CA keys/values of the same
      context, and the positions block k has not run on yet (tokens that left at an earlier exit).
    """

    def __init__(self):
        self.tokens = None  # [B, T] the tokens whose SA keys/values are cached
        self.sa_keys = self.sa_values = None  # [B, Hkv, T, hd]
        self.ca_keys = self.ca_values = None  # [B, Hkv, M, hd]
        self.ca_valid: torch.Tensor | None = None  # [M] bool, False: no context for that position; None: all valid
        self.tli: DynamicCache | None = None
        self.tli_verified = 0  # the TLI cache holds the target's own keys/values for positions < tli_verified
        self.cycle_starts: list[int] = []  # per SA position p: its CA read the context of positions < this
        self.contexts: torch.Tensor | None = None  # [B, M, d] the context vectors themselves (`ca_latest_context`)
        self.deep: list[DeepBlock] = []  # blocks 2..K of a sorted drafter

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.sa_keys is None else self.sa_keys.shape[2]

    @property
    def context_length(self) -> int:
        return 0 if self.ca_keys is None else self.ca_keys.shape[2]

    @property
    def tli_length(self) -> int:
        # the TLI cache only fills the target's last N layer slots, so ask the last one
        return self.tli.layers[-1].get_seq_length() if self.tli is not None and self.tli.layers else 0

    def append_self(self, k, v):
        if self.sa_keys is not None:
            k, v = torch.cat([self.sa_keys, k], dim=2), torch.cat([self.sa_values, v], dim=2)
        self.sa_keys, self.sa_values = k, v
        return k, v

    def append_context(self, k, v, valid: torch.Tensor | None = None, context: torch.Tensor | None = None):
        """Append CA keys/values [B, Hkv, T, hd] of the next positions; `valid`: bool [T] (None: all valid);
        `context`: their context vectors [B, T, d], kept for `latest_context` (None: not kept)."""
        if context is not None:
            self.contexts = context if self.contexts is None else torch.cat([self.contexts, context], dim=1)
        if valid is not None and self.ca_valid is None and not bool(valid.all()):
            self.ca_valid = torch.ones(self.context_length, dtype=torch.bool, device=k.device)  # [M]
        if self.ca_valid is not None:
            valid = torch.ones(k.shape[2], dtype=torch.bool, device=k.device) if valid is None else valid
            self.ca_valid = torch.cat([self.ca_valid, valid.to(k.device)])  # [M+T]
        if self.ca_keys is not None:
            k, v = torch.cat([self.ca_keys, k], dim=2), torch.cat([self.ca_values, v], dim=2)
        self.ca_keys, self.ca_values = k, v

    def latest_context(self) -> torch.Tensor | None:
        """[B, 1, d]: the context vector of the newest verified position that has one (None: none kept or none
        yet, which the CA reads as zeros)."""
        if self.contexts is None or self.contexts.shape[1] == 0:
            return None
        if self.ca_valid is None:
            return self.contexts[:, -1:]
        held = self.ca_valid.nonzero()
        return self.contexts[:, int(held[-1]) : int(held[-1]) + 1] if len(held) else None

    def crop_self(self, length: int) -> None:
        """Keep the SA keys/values of positions < `length` only; the CA memory (verified context) stays."""
        if self.sa_keys is not None:
            self.sa_keys, self.sa_values = self.sa_keys[:, :, :length], self.sa_values[:, :, :length]
            self.tokens = self.tokens[:, :length]
            del self.cycle_starts[length:]
        crop_deep(self.deep, self.get_seq_length(), length)

    def sync_tli(self, target_cache, layers: range, end: int) -> None:
        """TLI cache = the target's own keys/values of its `layers` (its last N) for verified positions < end
        (keys/values computed from drafted positions are dropped)."""
        if self.tli is None:
            self.tli = DynamicCache()
        if self.tli_length > self.tli_verified:
            self.tli.crop(self.tli_verified - self.tli_length)
        start = self.tli_verified
        for idx in layers:
            layer = target_cache.layers[idx]
            self.tli.update(layer.keys[:, :, start:end], layer.values[:, :, start:end], idx)
        self.tli_verified = end

    def truncate(self, length: int) -> None:
        """Keep positions < `length` (0 empties the cache)."""
        self.crop_self(length)
        if self.ca_keys is not None:
            self.ca_keys, self.ca_values = self.ca_keys[:, :, :length], self.ca_values[:, :, :length]
        for block in self.deep:
            if block.ca_keys is not None:
                block.ca_keys, block.ca_values = block.ca_keys[:, :, :length], block.ca_values[:, :, :length]
        if self.ca_valid is not None:
            self.ca_valid = self.ca_valid[:length]
        if self.contexts is not None:
            self.contexts = self.contexts[:, :length]
        if self.tli_length > length:
            self.tli.crop(length - self.tli_length)
        self.tli_verified = min(self.tli_verified, length)


class MoAChainDrafting:
    """Chain drafting for a `MoADrafterModel` (the drafter's `chain`). It holds no modules, only what it runs, read at
    each call: `embed(ids)` the token embedding, `rotary` the drafter's RoPE, `layers()` the (SA, CA) layers of blocks
    1..K, `head(hidden)` the float32 logits, `exits` the sorted exits, `tli(h, positions, cache)` the target's last N
    layers (Target Layer Inference)."""

    def __init__(
        self,
        config,
        embed: Callable[[torch.Tensor], torch.Tensor],
        rotary: nn.Module,
        layers: Callable[[], list[tuple[nn.Module, nn.Module]]],
        head: Callable[[torch.Tensor], torch.Tensor],
        exits: MoASortedExits,
        tli: Callable[..., torch.Tensor],
    ):
        self.config = config
        self.embed, self.rotary, self.layers, self.head, self.exits, self.tli = embed, rotary, layers, head, exits, tli

    def new_cache(self) -> MoADrafterCache:
        cache = MoADrafterCache()
        if self.config.num_blocks > 1:
            self.exits.deep_blocks(cache)
        return cache

    def extend(self, cache: MoADrafterCache, context: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Append context vectors [B, T, d] (the drafter's dtype) of the next verified positions to the CA memory of
        `cache` (every block's); `valid`: optional bool [T], False for positions without context (None: all)."""
        start = cache.context_length
        cos, sin = self.rotary(torch.arange(start, start + context.shape[1], device=context.device), context.dtype)
        layers = self.layers()
        kept = context if self.config.ca_latest_context else None  # for `latest_context`
        cache.append_context(*layers[0][1].context_keys_values(context, cos, sin), valid=valid, context=kept)
        for block, (_, ca) in zip(self.exits.deep_blocks(cache), layers[1:]):
            block.append_context(*ca.context_keys_values(context, cos, sin))

    def decode(
        self, new_ids: torch.Tensor, cache: MoADrafterCache, cycle: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the tokens not yet in the SA cache, `new_ids` [B, T]: logits [B, V] for the token after the last one
        and, for a sorted drafter, the exit [B, 1] it left at (None: one block); `cycle`: the drafting cycle (for
        `MoASortedExits.recording_tops`)."""
        past = cache.get_seq_length()
        T = new_ids.shape[1]
        pos = torch.arange(past, past + T, device=new_ids.device)
        h = self.embed(new_ids)  # [B, T, d]
        cos, sin = self.rotary(pos, h.dtype)
        mask = None
        if T > 1:  # causal among the new tokens, all cached ones visible
            mask = torch.arange(past + T, device=h.device)[None, :] <= pos[:, None]  # [T, past+T]
        self_attention, cross_attention = self.layers()[0]
        h = self_attention(h, cos, sin, mask=mask, cache=cache)
        cache.tokens = new_ids if cache.tokens is None else torch.cat([cache.tokens, new_ids], dim=1)
        M = cache.context_length
        cache.cycle_starts += [min(p, M) for p in range(past, past + T)]  # position p reads the context of j < p, < M
        if cache.ca_keys is None:
            B, hkv, hd = h.shape[0], self.config.num_key_value_heads, self.config.head_dim
            cache.ca_keys = cache.ca_values = h.new_zeros(B, hkv, 0, hd)
        if self.config.num_blocks > 1:
            return self.exits.draft(h, past, cos, sin, cache, cycle=cycle)  # [B, V], [B, 1]
        h = h[:, -1:]  # only the last position drafts
        ca_mask = None if cache.ca_valid is None else cache.ca_valid[None, None, None, :]  # [1, 1, 1, M]
        latest = cache.latest_context() if self.config.ca_latest_context else None  # [B, 1, d] or None
        h = cross_attention(h, cos[-1:], sin[-1:], cache.ca_keys, cache.ca_values, mask=ca_mask, latest=latest)
        if self.config.target_layer_inference > 0:
            if cache.tli is None:
                cache.tli = DynamicCache()
            h = self.tli(h, pos[-1:][None], cache.tli)
        return self.head(h)[:, -1], None  # [B, V] float32
