"""Reading the target's keys/values from vLLM's paged KV cache, one reader per physical layout.

Terms: a *slot* is one token's place in the paged cache, `block * block_size + offset`; a request's *block table*
row maps its position p to block `table[p // block_size]`. Every reader returns what the MoA drafter's LSA reads
from a transformers cache (`moa_hf.modeling.gather_target_kv_at`): per token and layer, key and value joined per
KV head, `[.., L, Hkv * 2 * hd]`, keys after RoPE as the cache stores them.

This module imports torch only: the layouts are tested on synthetic caches without vLLM. Which layout a running
engine uses is decided, and checked by writing known keys/values with vLLM's own cache-writing op, in
`moa_hf.vllm.proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "PagedKVReader", "PagedLayout", "UnsupportedCacheError", "layout_for", "slots_of"]


class UnsupportedCacheError(ValueError):
    """vLLM's KV cache is in a layout, dtype or backend that moa-hf cannot read (the message says which and why)."""


@dataclass(frozen=True)
class PagedLayout:
    """How one attention backend lays a layer's cache out. Every backend read here allocates a layer's cache as
    `[num_blocks, Hkv, block_size, 2 * hd]` (vLLM's logical shape); they differ inside a (block, head)."""

    name: str
    keys_transposed: bool  # keys stored [hd, block_size] per (block, head), values [block_size, hd]: the CPU kernels
    amx_tiles: bool = False  # vLLM's CPU "amx" ISA: keys and values in AMX tiles of 16 rows x 64 bytes (see `read`)

    def block_size(self, cache: torch.Tensor) -> int:
        return cache.shape[2]

    def read(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Keys/values of N tokens at (`blocks`, `offsets`) [N] -> [N, Hkv * 2 * hd], key then value per head."""
        nb, H, bs, hd2 = cache.shape  # [num_blocks, Hkv, block_size, 2*hd]
        hd = hd2 // 2
        N = blocks.shape[0]
        if not self.keys_transposed and not self.amx_tiles:  # key = [..., :hd], value = [..., hd:] of each slot
            return cache[blocks, :, offsets, :].reshape(N, H * hd2)  # [N, H, 2*hd] -> [N, H*2*hd]
        flat = cache.view(nb, H, 2 * bs * hd)  # per (block, head): bs*hd key numbers, then bs*hd value numbers
        keys, values = flat[:, :, : bs * hd], flat[:, :, bs * hd :]
        if self.amx_tiles:
            # keys: for each 16 tokens, rows of dimension pairs, each row the pair of all 16 tokens interleaved:
            # key (t, d) at (t // 16) * 16 * hd + (d // 2) * 32 + (t % 16) * 2 + d % 2
            tiles = keys.reshape(nb, H, bs // 16, hd // 2, 16, 2)  # [nb, H, token tile, dim pair, token, 2 dims]
            keys = tiles[blocks, :, offsets // 16, :, offsets % 16, :].reshape(N, H, hd)  # [N, H, hd/2, 2] -> hd
            # values: for each 16 dimensions, rows of token pairs, each row the pair's 16 dimensions interleaved:
            # value (t, d) at (d // 16) * bs * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
            tiles = values.reshape(nb, H, hd // 16, bs // 2, 16, 2)  # [nb, H, dim tile, token pair, dim, 2 tokens]
            values = tiles[blocks, :, :, offsets // 2, :, offsets % 2].reshape(N, H, hd)  # [N, H, hd/16, 16] -> hd
        else:
            keys = keys.view(nb, H, hd, bs)[blocks, :, :, offsets]  # [N, H, hd] (stored transposed)
            values = values.view(nb, H, bs, hd)[blocks, :, offsets, :]  # [N, H, hd]
        return torch.cat([keys, values], dim=-1).reshape(N, H * hd2)  # [N, H*2*hd]


LAYOUTS = {
    # vLLM's CPU backend, ISAs "vec" and "vec16" (csrc/cpu: keys transposed per block so a query reads them as rows)
    "cpu_vec": PagedLayout("cpu_vec", keys_transposed=True),
    # vLLM's CPU backend, ISA "amx" (bf16 on CPUs with AMX tiles, block size a multiple of 32): derived by writing
    # known keys/values with vLLM's own `cpu_attn_reshape_and_cache(..., "amx")` and checked that way at start-up
    "cpu_amx": PagedLayout("cpu_amx", keys_transposed=False, amx_tiles=True),
    # FlashAttention and Triton attention on GPUs: [num_blocks, Hkv, block_size, 2*hd] read through its logical view
    # (whatever its stride order), key and value halves of the last axis (`kv_cache.transpose(1, 2).split(hd, -1)`)
    "head_major": PagedLayout("head_major", keys_transposed=False),
}

_BACKENDS = {"FLASH_ATTN": "head_major", "TRITON_ATTN": "head_major"}
_CPU_ISAS = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}


def layout_for(backend: str, isa: str | None = None, kv_cache_dtype: str = "auto") -> PagedLayout:
    """The layout of attention backend `backend` (vLLM's `get_name()`; `isa` for the CPU backend); raises
    `UnsupportedCacheError` saying why for any other backend, ISA or a quantised cache."""
    if kv_cache_dtype not in ("auto", None):
        raise UnsupportedCacheError(
            f"The target's KV cache is quantised (kv_cache_dtype={kv_cache_dtype!r}): the drafter's LSA was trained "
            "on the target's unquantised keys/values. Serve without --kv-cache-dtype (or with 'auto')."
        )
    if backend == "CPU_ATTN":
        if isa not in _CPU_ISAS:
            raise UnsupportedCacheError(
                f"vLLM's CPU attention runs with ISA {isa!r} here, whose cache layout moa-hf does not read (it reads "
                f"{', '.join(sorted(_CPU_ISAS))}). Nothing was read."
            )
        return LAYOUTS[_CPU_ISAS[isa]]
    if backend not in _BACKENDS:
        raise UnsupportedCacheError(
            f"vLLM attention backend {backend!r} is not supported by moa-hf's cache readers (supported: CPU_ATTN, "
            f"{', '.join(sorted(_BACKENDS))}). Choose one with --attention-backend."
        )
    return LAYOUTS[_BACKENDS[backend]]


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots [B, n] of `positions` [B, n] (< 0: none, gives -1) of each row of `block_table` [B, max_blocks]."""
    pos = positions.clamp(min=0)
    blocks = block_table.gather(1, (pos // block_size).long())  # [B, n]
    return torch.where(positions >= 0, blocks.long() * block_size + pos % block_size, -1)


class PagedKVReader:
    """Reads every target layer's keys/values at given slots: `reader(slots [B, n]) -> [B, n, L, Hkv*2*hd]`, the
    function `MoADrafterModel.tree_catch_up` takes in place of a transformers cache. Slots < 0 read slot 0 (the
    caller masks them out)."""

    def __init__(self, caches: list[torch.Tensor], layout: PagedLayout, dtype: torch.dtype | None = None):
        if not caches:
            raise UnsupportedCacheError("The target has no attention layer with a KV cache to read.")
        self.caches, self.layout, self.dtype = caches, layout, dtype
        self.block_size = layout.block_size(caches[0])

    def __call__(self, slots: torch.Tensor) -> torch.Tensor:
        B, n = slots.shape
        flat = slots.reshape(-1).clamp(min=0).to(self.caches[0].device)  # [B*n]
        blocks, offsets = flat // self.block_size, flat % self.block_size
        per_layer = [self.layout.read(cache, blocks, offsets) for cache in self.caches]  # L x [B*n, W]
        out = torch.stack(per_layer, dim=1).view(B, n, len(self.caches), -1)  # [B, n, L, W]
        return out if self.dtype is None else out.to(self.dtype)
