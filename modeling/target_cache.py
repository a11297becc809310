"""Reading the target's cache for the MoA drafter: per-layer keys/values of a transformers cache gathered into
[B, T, L, 2*Hkv*hd] (`gather_target_kv`, by slot `gather_target_kv_at`), which positions a sliding-window layer still
holds (`oldest_held_position`, `held_capacities`, `held_at_reads`), the training-time cycle starts, and what the
LSA reads of the keys/values (`lsa_view`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch and
transformers.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

__all__ = [
    "CONTEXT_CHUNK",
    "context_in_chunks",
    "cycle_starts_from_restarts",
    "first_held",
    "gather_target_kv",
    "gather_target_kv_at",
    "held_at_reads",
    "held_capacities",
    "joined_kv",
    "lsa_view",
    "oldest_held_position",
    "split_target_kv",
]


def first_held(layer) -> int:
    """The position of a target cache layer's first slot: positions it has seen minus positions it holds (0 for a
    full-attention layer; a sliding-window layer, transformers' `DynamicSlidingWindowLayer`, keeps the newest only)."""
    if layer.keys is None:
        return 0
    return layer.get_seq_length() - layer.keys.shape[-2]


def oldest_held_position(target_cache) -> int:
    """The oldest position that every layer of the target's cache still holds: 0 unless a sliding-window (or chunked)
    layer has dropped the positions older than its window. A drafting cycle reads the newest positions, so these are
    only ever the start of a prompt longer than the window (read at the first cycle) or of a read longer than it."""
    return max((first_held(layer) for layer in target_cache.layers), default=0)


def held_capacities(target_cache) -> list[int | None]:
    """How many of the newest positions each layer of a target cache keeps between forward calls: window - 1 for a
    sliding-window (or chunked) layer, as transformers' `DynamicSlidingWindowLayer` does; None (all) otherwise.
    E.g. `held_capacities(DynamicCache(config=target.config))` for the cache `target.generate` builds."""
    return [layer.sliding_window - 1 if getattr(layer, "is_sliding", False) else None for layer in target_cache.layers]


def held_at_reads(read_ends: torch.Tensor, capacities: list[int | None]) -> torch.Tensor:
    """bool [B, T]: whether every layer of the target's cache still held token j when the drafter read it (what
    `oldest_held_position` tells at inference), for training.

    read_ends: [B, T] the target's cache length at the drafting call that reads token j (the end of that read);
    capacities: `held_capacities` of the target's cache. A layer keeping the newest c positions holds j then iff
    j >= read_ends[j] - c.
    """
    windows = [c for c in capacities if c is not None]
    if not windows:
        return torch.ones_like(read_ends, dtype=torch.bool)
    pos = torch.arange(read_ends.shape[1], device=read_ends.device)[None, :]  # [1, T]
    return pos >= read_ends - min(windows)  # [B, T]


def gather_target_kv(target_cache, start: int, end: int) -> torch.Tensor:
    """The target's cached key and value of every layer for positions [start, end): [B, end-start, L, 2*Hkv*hd].

    Keys are taken as the cache holds them (after RoPE); key and value are joined per KV head. Positions are mapped to
    each layer's slots (a sliding-window layer holds only its newest ones, from `oldest_held_position` on).
    """
    per_layer, device = [], None
    for i, layer in enumerate(target_cache.layers):
        first = first_held(layer)  # the position of the layer's slot 0
        if start < first:
            raise ValueError(
                f"Target position {start} is no longer in the cache: layer {i} (sliding window) holds positions "
                f">= {first} only. Read from `oldest_held_position(cache)` on."
            )
        kv = joined_kv(layer.keys[:, :, start - first : end - first], layer.values[:, :, start - first : end - first])
        device = device or kv.device  # a target split over devices: gather on the first layer's
        per_layer.append(kv.to(device))  # [B, T, Hkv*2*hd]
    return torch.stack(per_layer, dim=2)  # [B, T, L, 2*Hkv*hd]


def gather_target_kv_at(target_cache, slots: torch.Tensor) -> torch.Tensor:
    """`gather_target_kv` by slot: the target's cached key and value of every layer at slots `slots` [B, n] of each
    row (full-attention layers: slot = index into `layer.keys[b, :, slot]`), [B, n, L, 2*Hkv*hd]. Slots < 0 read
    slot 0 (garbage for the caller to mask out)."""
    per_layer, device, slots = [], None, slots.clamp(min=0)
    for i, layer in enumerate(target_cache.layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                f"Layer {i} of the target's cache is a sliding-window layer, whose slots are not positions: tree "
                "drafting reads full-attention caches only (build the target's cache as `DynamicCache()`)."
            )
        B, H, _, hd = layer.keys.shape
        index = slots.to(layer.keys.device)[:, None, :, None].expand(B, H, -1, hd)  # [B, Hkv, n, hd]
        kv = joined_kv(layer.keys.gather(2, index), layer.values.gather(2, index))  # [B, n, Hkv*2*hd]
        device = device or kv.device  # a target split over devices: gather on the first layer's
        per_layer.append(kv.to(device))
    return torch.stack(per_layer, dim=2)  # [B, n, L, 2*Hkv*hd]


def joined_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keys and values [B, Hkv, T, hd] -> [B, T, Hkv*2*hd], key and value joined per KV head."""
    return torch.cat([keys, values], dim=-1).transpose(1, 2).flatten(2)  # [B, Hkv, T, 2*hd] -> [B, T, Hkv*2*hd]


def split_target_kv(
    target_kv: torch.Tensor, layer: int, num_key_value_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `gather_target_kv` for one layer: (keys, values), each [B, Hkv, T, hd] as the cache holds them
    (e.g. to run the target's last layers on cached states, Target Layer Inference)."""
    B, T = target_kv.shape[:2]
    kv = target_kv[:, :, layer].view(B, T, num_key_value_heads, -1).transpose(1, 2)  # [B, Hkv, T, 2*hd]
    keys, values = kv.chunk(2, dim=-1)  # 2 x [B, Hkv, T, hd]
    return keys.contiguous(), values.contiguous()


def cycle_starts_from_restarts(restart: torch.Tensor) -> torch.Tensor:
    """start(i) = the last restart position <= i, for a bool [B, T] tensor of restart points (position 0 included).

    A position i may read the target's state of tokens j < start(i) only (at inference, a cycle starts at the
    token the target has just produced, whose own target state does not exist yet).
    """
    B, T = restart.shape
    pos = torch.arange(T, device=restart.device).expand(B, T)
    marks = torch.where(restart, pos, torch.zeros_like(pos))
    return torch.cummax(marks, dim=1).values  # [B, T]


def lsa_view(config, target_kv: torch.Tensor, positions: torch.Tensor | None, target_rotary=None) -> torch.Tensor:
    """What a MoA drafter's LSA reads of the target's keys/values [B, T, L, Hkv*2*hd] (`config.lsa_layers`,
    `lsa_keys`): [B, T, L', W'] with L' the layers read and W' = Hkv*2*hd (keys and values) or Hkv*hd (values only).
    `lsa_keys="unrotated"` undoes the target's RoPE (`target_rotary`: its rotary embedding) at `positions` [B, T]."""
    c = config
    if c.lsa_layers is not None:
        target_kv = target_kv[:, :, c.lsa_layers]  # [B, T, L', Hkv*2*hd]
    if c.lsa_keys == "rotated":
        return target_kv
    kv = target_kv.unflatten(-1, (c.target_num_key_value_heads, 2, c.target_head_dim))  # [B, T, L', Hkv, 2, hd]
    keys, values = kv.unbind(-2)  # 2 x [B, T, L', Hkv, hd]
    if c.lsa_keys == "none":
        return values.flatten(-2)  # [B, T, L', Hkv*hd]
    if positions is None:
        raise ValueError(
            "lsa_keys='unrotated' undoes the target's RoPE at each token's position: pass `positions` "
            "(this drafting path does not know them)."
        )
    cos, sin = target_rotary(positions.expand(target_kv.shape[:2]), torch.float32)  # [B, T, hd]
    cos, sin = cos[:, :, None, None], sin[:, :, None, None]  # [B, T, 1, 1, hd]
    keys = (keys.float() * cos - rotate_half(keys.float()) * sin).to(values.dtype)  # rotation by -position
    return torch.stack([keys, values], dim=-2).flatten(-3)  # [B, T, L', Hkv*2*hd]


CONTEXT_CHUNK = 64  # most target positions per LSA call at inference (see `MoADrafterModel.read_context`)


def context_in_chunks(
    compute_context: Callable[..., torch.Tensor],
    gather: Callable[[int, int], torch.Tensor],
    n: int,
    config,
    first: int | None = None,
    target_hidden: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Context vectors of n tokens in chunks [B, <= CONTEXT_CHUNK, d], from `gather(s, e)`: their target keys/values
    [B, e-s, L, W] of tokens s..e-1, each chunk zero-padded to a power of two (then cut off again). The LSA treats
    every token on its own (attention runs across layers, never across tokens), so it only ever sees a handful of
    shapes (a long prompt costs no new kernel set-up on a CPU), a cycle's few new tokens stay cheap, and memory stays
    bounded.
    first: the position of token 0 (None: unknown, e.g. slots of a tree). target_hidden: [B, n, D] the target's final
    hidden states of the n tokens (`context_final_hidden`)."""
    out = []
    for s in range(0, n, CONTEXT_CHUNK):
        kv = gather(s, min(n, s + CONTEXT_CHUNK))  # [B, m, L, W]
        m = kv.shape[1]
        size = min(CONTEXT_CHUNK, 1 << (m - 1).bit_length())  # m rounded up to a power of two
        hidden = None if target_hidden is None else target_hidden[:, s : s + m]  # [B, m, D]
        if m < size:
            kv = torch.cat([kv, kv.new_zeros(kv.shape[0], size - m, *kv.shape[2:])], dim=1)  # [B, size, L, W]
            if hidden is not None:
                hidden = F.pad(hidden, (0, 0, 0, size - m))  # [B, size, D]
        pos = None  # positions matter only to un-rotated keys: no tensor built per cycle otherwise
        if first is not None and config.lsa_keys == "unrotated":
            pos = torch.arange(first + s, first + s + size, device=kv.device)  # [size]
        out.append(compute_context(kv, positions=pos, target_hidden=hidden)[:, :m])  # [B, m, d]
    return out
