"""Reading the target's state for the MoA drafter: `TargetStates`, the drafter's one input of it, and a reader per
route that fills it (`CacheReader`: a transformers cache, for chains; `SlotReader`: a tree's slots, for the engine and
vLLM; training's `run_target`); per-layer keys/values of a transformers cache gathered into [B, T, L, 2*Hkv*hd]
(`gather_target_kv`, by slot `gather_target_kv_at`), which positions a sliding-window layer still holds
(`oldest_held_position`, `held_capacities`, `held_at_reads`), the training-time cycle starts, and what the LSA reads
of the keys/values (`lsa_view`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch and
transformers.
"""

import dataclasses
from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import rotate_half

__all__ = [
    "CONTEXT_CHUNK",
    "CacheReader",
    "SlotReader",
    "TargetStates",
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


@dataclasses.dataclass
class TargetStates:
    """The target's state of a run of T tokens: the MoA drafter's one input of it (`MoADrafterModel.compute_context`,
    the LSA), filled by one reader per route (`CacheReader`, `SlotReader`, training's `run_target` and cached states).
    A new signal of the target's state is one field here, one line in each reader and what the LSA does with it.

    kv: [B, T, L, 2*Hkv*hd] every target layer's key and value of each token, joined per KV head (`gather_target_kv`);
        None only where a drafter reads no keys/values (training an EAGLE-style drafter on cached states).
    final_hidden: [B, T, D] the target's post-norm final hidden states (the LSA reads them with
        `context_final_hidden`; training's regression and teacher read them too), or None where nothing reads them.
    held: bool [B, T] or None (all): whether every layer still held token j's key/value when the drafter read it
        (training: a sliding-window layer drops old positions, `held_at_reads`); tokens not held get no context.
    feature: [B, T, D] training's regression target (the post-norm final hidden state; TLI N > 0: the hidden state
        after layer L-N), or None.
    tli_kv: training with TLI N > 0: N (key, value) pairs [B, Hkv, T, hd] of the target's last N layers; else None.

    Every tensor field is per token ([B, T, ...]); `padded` pads them all.
    """

    kv: torch.Tensor | None
    final_hidden: torch.Tensor | None = None
    held: torch.Tensor | None = None
    feature: torch.Tensor | None = None
    tli_kv: list | None = None

    def padded(self, size: int) -> "TargetStates":
        """Every per-token field zero-padded (False for `held`) to `size` tokens: [B, size, ...]."""

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(x.shape[0], size - x.shape[1], *x.shape[2:])], dim=1)

        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: pad(v) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


@dataclasses.dataclass
class CacheReader:
    """The chains' reader (assisted generation, the server, `moa costs`): `reader(start, end)` -> the `TargetStates`
    of positions [start, end) of a transformers cache `cache` (`gather_target_kv`), with the target's final hidden
    states from `final_hidden(start, end)` -> [B, end-start, D] when given (`Attachment.final_hidden`: the hook on the
    target's decoder, `FeatureTap`; the server's `HiddenRecordingCache.hidden_between`)."""

    cache: object
    final_hidden: Callable[[int, int], torch.Tensor] | None = None

    def __call__(self, start: int, end: int) -> TargetStates:
        hidden = None if self.final_hidden is None else self.final_hidden(start, end)  # [B, end-start, D]
        return TargetStates(gather_target_kv(self.cache, start, end), final_hidden=hidden)


@dataclasses.dataclass
class SlotReader:
    """The trees' reader (the engine, vLLM's proposer): `reader(s, e)` -> the `TargetStates` of tokens s..e-1 of a
    tree's `slots` [B, n] (cache slots; < 0: none, read as slot 0 for the caller to mask out).

    kv: a transformers cache (read by `gather_target_kv_at`) or a reader of another engine's cache, slots [B, m] ->
    [B, m, L, 2*Hkv*hd] (vLLM's `PagedKVReader`). final_hidden: None or [B, n, D] the target's final hidden states at
    `slots` (the engine's `SlotCache.hidden_at`, vLLM's `StepTap.hidden_at`)."""

    kv: object
    slots: torch.Tensor
    final_hidden: torch.Tensor | None = None

    def __call__(self, start: int, end: int) -> TargetStates:
        slots = self.slots[:, start:end]  # [B, m]
        kv = self.kv(slots) if callable(self.kv) else gather_target_kv_at(self.kv, slots)  # [B, m, L, W]
        hidden = None if self.final_hidden is None else self.final_hidden[:, start:end]  # [B, m, D]
        return TargetStates(kv, final_hidden=hidden)


CONTEXT_CHUNK = 64  # most target positions per LSA call at inference (see `MoADrafterModel.read_context`)


def context_in_chunks(
    compute_context: Callable[..., torch.Tensor],
    read: Callable[[int, int], TargetStates],
    n: int,
    config,
    first: int | None = None,
) -> list[torch.Tensor]:
    """Context vectors of n tokens in chunks [B, <= CONTEXT_CHUNK, d], from `read(s, e)`: the `TargetStates` of tokens
    s..e-1 (a route's reader), each chunk zero-padded to a power of two (then cut off again). The LSA treats every
    token on its own (attention runs across layers, never across tokens), so it only ever sees a handful of shapes (a
    long prompt costs no new kernel set-up on a CPU), a cycle's few new tokens stay cheap, and memory stays bounded.
    first: the position of token 0 (None: unknown, e.g. slots of a tree)."""
    out = []
    for s in range(0, n, CONTEXT_CHUNK):
        states = read(s, min(n, s + CONTEXT_CHUNK))  # kv [B, m, L, W]
        m = states.kv.shape[1]
        size = min(CONTEXT_CHUNK, 1 << (m - 1).bit_length())  # m rounded up to a power of two
        if m < size:
            states = states.padded(size)  # kv [B, size, L, W]
        pos = None  # positions matter only to un-rotated keys: no tensor built per cycle otherwise
        if first is not None and config.lsa_keys == "unrotated":
            pos = torch.arange(first + s, first + s + size, device=states.kv.device)  # [size]
        out.append(compute_context(states, positions=pos)[:, :m])  # [B, m, d]
    return out
