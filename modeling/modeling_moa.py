"""Mixture-of-Attentions (MoA) drafter for speculative decoding (Zimmer et al., ICLR 2025, arXiv 2410.03804).

Per drafting cycle (the target has verified tokens 0..n-1 and cached keys/values for 0..n-2):
  1. LSA: for each newly verified token, attention across the target's L layers over that layer's cached key/value,
     mean over layers, projection -> one context vector per token; CA keys/values of it are appended to the CA cache.
     (A sliding-window layer keeps only its newest positions: those it dropped, e.g. the start of a prompt longer
     than its window, read at the first cycle, are left out of the CA memory; see `read_context`.)
  2. per drafted token: embedding -> SA (causal, own KV cache) -> CA (queries attend to verified context only)
     -> [TLI: the target's last N layers with the target's own cache] -> the target's LM head.

Sorted drafters (S2D, Sorted Speculative Decoding, arXiv 2407.01955), `num_blocks` K > 1: K stacked SA + CA blocks
(block 1 the paper's `self_attention` + `cross_attention`, then `blocks`), every CA reading the same context vectors,
with an exit after each block into the shared head; training takes the loss at every exit (`forward(exits="all")`),
so the first k blocks are a drafter of their own. While drafting, a token leaves at the first exit k < K whose top
probability clears `exit_thresholds[k-1]` (else at exit K; `_adaptive_exits`): cheap exits draft the easy tokens.
Each block keeps its own keys/values; a block skipped by tokens that left earlier first catches up on them from the
stored outputs of the block before (`_DeepBlock.pending`), so every exit drafts exactly what `forward` gives there.
One drafter serves several targets (a model and its fine-tunes): each extra target has parts of its own
(`MoATargetParts`: its LSA input projection and low-rank deltas on the blocks' linear layers), selected by `attach`
from the target's weights fingerprint (`select_target`, `add_target`).

The drafting runtime shared with the EAGLE drafter (target hooks, the `generate` that assisted generation calls, the
drafting loop, statistics, the tree drafting state) is in drafting.py, prompt lookup in lookup.py. The tree drafting
API (`tree_start`, `tree_catch_up`, `tree_step`, ...; for the engine of custom_generate/) drafts the same tokens as
the chain, node by node, for left-padded batches.

This file ships inside every Hub repo as remote code: it imports only torch, transformers and its sibling files.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import rotate_half

from .configuration_moa import (
    PRIMARY_TARGET,
    MoADrafterConfig,
    check_exit_thresholds,
    tli_unsupported_reason,
    unsupported_target_reason,
)
from .drafting import (
    CACHE_NAME,
    DrafterMixin,
    DraftingSession,
    LayerKV,
    RollbackCache,
    TargetTap,
    TreeState,
    _weights_difference,
    decoder_of,
    register_hooks,
)
from .drafting import target_fingerprint as _fingerprint

__all__ = [
    "MoABlock",
    "MoADrafterModel",
    "MoALinear",
    "MoALoRA",
    "MoATargetParts",
    "MoAPreTrainedModel",
    "MoADrafterCache",
    "MoADrafterOutput",
    "MoATreeState",
    "cycle_starts_from_restarts",
    "gather_target_kv",
    "gather_target_kv_at",
    "held_at_reads",
    "held_capacities",
    "oldest_held_position",
    "split_target_kv",
]


# -------------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------------
class MoARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # norms in fp32
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MoARotaryEmbedding(nn.Module):
    """Plain RoPE: cos/sin for integer positions."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., T, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, hd]; cos/sin [B, T, hd] or [T, hd]
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class MoALinear(nn.Linear):
    """`nn.Linear` plus the low-rank delta of the drafter's active target, if it has one (`MoATargetParts`):
    y = x W^T + (x A^T) B^T. `delta` = (A [r, in], B [out, r]) is a plain reference set by `select_target`."""

    delta: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.delta is not None:
            a, b = self.delta
            y = y + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
        return y


class MoAMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.gate_proj = MoALinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = MoALinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = MoALinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoAAttention(nn.Module):
    """Grouped-query attention whose queries and keys/values may come from different streams (self or cross)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = MoALinear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = MoALinear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = MoALinear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = MoALinear(num_heads * head_dim, hidden_size, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        return _rope(q, cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        return _rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # q [B, H, Tq, hd], k/v [B, Hkv, Tk, hd], mask bool [B or 1, 1, Tq, Tk] (True = visible) or None (all visible)
        gqa = self.num_heads != self.num_kv_heads
        if q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # one drafted token on a CPU: half-precision SDPA is several times slower there than float32 (one query,
            # 300 keys: 168 vs 50 us with the casts), and float32 is the more exact of the two
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
            y = y.to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        B, H, T, hd = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))  # [B, T, H*hd] -> [B, T, d]


class MoADecoderLayer(nn.Module):
    """Pre-norm decoder layer (attention + gated MLP). Used for SA (causal) and LSA (across target layers)."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps, act):
        super().__init__()
        self.input_layernorm = MoARMSNorm(hidden_size, eps)
        self.self_attn = MoAAttention(hidden_size, num_heads, num_kv_heads, head_dim)
        self.post_attention_layernorm = MoARMSNorm(hidden_size, eps)
        self.mlp = MoAMLP(hidden_size, intermediate_size, act)

    def forward(self, h, cos, sin, mask=None, cache: "MoADrafterCache | None" = None):
        x = self.input_layernorm(h)
        q = self.self_attn.queries(x, cos, sin)
        k, v = self.self_attn.keys_values(x, cos, sin)
        if cache is not None:
            k, v = cache.append_self(k, v)
        h = h + self.self_attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoACrossAttentionLayer(nn.Module):
    """CA: queries from the SA stream, keys/values from the context vectors of verified tokens.

    One RMSNorm (same weights) normalises both streams, as in the authors' code. A learned null key/value is always
    visible, so a query with no verified context yet (the very first draft) still has a well-defined attention.
    """

    def __init__(self, config: MoADrafterConfig):
        super().__init__()
        d, hkv, hd = config.hidden_size, config.num_key_value_heads, config.head_dim
        self.input_layernorm = MoARMSNorm(d, config.rms_norm_eps)
        self.attn = MoAAttention(d, config.num_attention_heads, hkv, hd)
        self.null_key = nn.Parameter(torch.zeros(hkv, 1, hd))
        self.null_value = nn.Parameter(torch.zeros(hkv, 1, hd))
        self.post_attention_layernorm = MoARMSNorm(d, config.rms_norm_eps)
        self.mlp = MoAMLP(d, config.intermediate_size, config.hidden_act)

    def context_keys_values(self, context, cos, sin):
        return self.attn.keys_values(self.input_layernorm(context), cos, sin)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask=None):
        # h [B, T, d]; ctx_k/ctx_v [B, Hkv, M, hd]; mask bool [B, 1, T, M] or None (all M visible)
        B, T, _ = h.shape
        q = self.attn.queries(self.input_layernorm(h), cos, sin)
        k = torch.cat([self.null_key.to(ctx_k.dtype).expand(B, -1, -1, -1), ctx_k], dim=2)  # [B, Hkv, 1+M, hd]
        v = torch.cat([self.null_value.to(ctx_v.dtype).expand(B, -1, -1, -1), ctx_v], dim=2)
        if mask is not None:
            mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)  # [B, 1, T, 1+M]
        h = h + self.attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoABlock(nn.Module):
    """Blocks 2..K of a sorted drafter (block 1 is the drafter's `self_attention` + `cross_attention`): SA over the
    previous block's output, then CA over the same verified context vectors (its own keys/values of them).

    Its output projections (`o_proj`, `down_proj`) start at zero where no checkpoint sets them (`_init_weights`), so a
    block added to a trained drafter is the identity on the residual stream: every exit first equals the one before.
    """

    def __init__(self, config: MoADrafterConfig):
        super().__init__()
        c = config
        self.self_attention = MoADecoderLayer(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            c.hidden_act,
        )
        self.cross_attention = MoACrossAttentionLayer(c)
        for linear in (
            self.self_attention.self_attn.o_proj,
            self.self_attention.mlp.down_proj,
            self.cross_attention.attn.o_proj,
            self.cross_attention.mlp.down_proj,
        ):
            linear.zero_init = True


class MoALoRA(nn.Module):
    """One low-rank delta of an extra target on a shared linear layer: A [r, in] (small random), B [out, r] (zero at
    first, so a new target drafts as the primary one until trained); the layer adds (x A^T) B^T."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))


class MoATargetParts(nn.Module):
    """What a drafter keeps per extra target (`MoADrafterModel.add_target`): its own LSA input projection (targets
    differ in the keys/values the LSA reads; [W, lsa_hidden] as the primary's, or [W, W] starting as the identity
    when the primary reads them directly) and, with `lora_rank` r > 0, a `MoALoRA` for every linear layer of the
    shared SA/CA blocks (`lora`, keyed by the layer's name with "." -> "__")."""

    def __init__(self, kv_width: int, lsa_hidden_size: int, linears: dict[str, nn.Linear], lora_rank: int):
        super().__init__()
        self.lsa_in_proj = nn.Linear(kv_width, lsa_hidden_size, bias=False)
        self.lsa_in_proj.identity_init = kv_width == lsa_hidden_size
        self.lora = nn.ModuleDict(
            {
                name.replace(".", "__"): MoALoRA(linear.in_features, linear.out_features, lora_rank)
                for name, linear in (linears.items() if lora_rank > 0 else ())
            }
        )

    def delta(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of the shared linear layer `name`, or None (no delta)."""
        lora = self.lora[name.replace(".", "__")] if name.replace(".", "__") in self.lora else None
        return None if lora is None else (lora.A, lora.B)


# -------------------------------------------------------------------------------------------------------------------
# Target states, cache, output
# ---------------------------------------------------------------------------------------------------------------------
def _first_held(layer) -> int:
    """The position of a target cache layer's first slot: positions it has seen minus positions it holds (0 for a
    full-attention layer; a sliding-window layer, transformers' `DynamicSlidingWindowLayer`, keeps the newest only)."""
    if layer.keys is None:
        return 0
    return layer.get_seq_length() - layer.keys.shape[-2]


def oldest_held_position(target_cache) -> int:
    """The oldest position that every layer of the target's cache still holds: 0 unless a sliding-window (or chunked)
    layer has dropped the positions older than its window. A drafting cycle reads the newest positions, so these are
    only ever the start of a prompt longer than the window (read at the first cycle) or of a read longer than it."""
    return max((_first_held(layer) for layer in target_cache.layers), default=0)


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
        first = _first_held(layer)  # the position of the layer's slot 0
        if start < first:
            raise ValueError(
                f"Target position {start} is no longer in the cache: layer {i} (sliding window) holds positions "
                f">= {first} only. Read from `oldest_held_position(cache)` on."
            )
        kv = _joined_kv(layer.keys[:, :, start - first : end - first], layer.values[:, :, start - first : end - first])
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
        kv = _joined_kv(layer.keys.gather(2, index), layer.values.gather(2, index))  # [B, n, Hkv*2*hd]
        device = device or kv.device  # a target split over devices: gather on the first layer's
        per_layer.append(kv.to(device))
    return torch.stack(per_layer, dim=2)  # [B, n, L, 2*Hkv*hd]


def _joined_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
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


CONTEXT_CHUNK = 64  # most target positions per LSA call at inference (see `MoADrafterModel.read_context`)


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
        self.deep: list[_DeepBlock] = []  # blocks 2..K of a sorted drafter

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

    def append_context(self, k, v, valid: torch.Tensor | None = None):
        """Append CA keys/values [B, Hkv, T, hd] of the next positions; `valid`: bool [T] (None: all valid)."""
        if valid is not None and self.ca_valid is None and not bool(valid.all()):
            self.ca_valid = torch.ones(self.context_length, dtype=torch.bool, device=k.device)  # [M]
        if self.ca_valid is not None:
            valid = torch.ones(k.shape[2], dtype=torch.bool, device=k.device) if valid is None else valid
            self.ca_valid = torch.cat([self.ca_valid, valid.to(k.device)])  # [M+T]
        if self.ca_keys is not None:
            k, v = torch.cat([self.ca_keys, k], dim=2), torch.cat([self.ca_values, v], dim=2)
        self.ca_keys, self.ca_values = k, v

    def crop_self(self, length: int) -> None:
        """Keep the SA keys/values of positions < `length` only; the CA memory (verified context) stays."""
        if self.sa_keys is not None:
            self.sa_keys, self.sa_values = self.sa_keys[:, :, :length], self.sa_values[:, :, :length]
            self.tokens = self.tokens[:, :length]
            del self.cycle_starts[length:]
        _crop_deep(self.deep, self.get_seq_length(), length)

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
        if self.tli_length > length:
            self.tli.crop(length - self.tli_length)
        self.tli_verified = min(self.tli_verified, length)


@dataclass
class _Pending:
    """Inputs of slots a deeper block has not run on yet, with what that block needs to run them: x [B, n, d] (the
    previous block's outputs), the SA mask [B or 1, 1, n, S] over slots (columns beyond a block's length are never
    visible to these rows), RoPE cos/sin [(B,) n, hd], and the CA mask [B or 1, 1, n, M] over the context they saw."""

    x: torch.Tensor
    sa_mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ca_mask: torch.Tensor

    @property
    def size(self) -> int:
        return self.x.shape[1]

    def first(self, n: int) -> "_Pending":
        cut = (self.sa_mask[..., :n, :], self.cos[..., :n, :], self.sin[..., :n, :], self.ca_mask[..., :n, :])
        return _Pending(self.x[:, :n], *cut)

    def rows(self, rows: torch.Tensor) -> "_Pending":
        return _Pending(self.x[rows], self.sa_mask[rows], self.cos[rows], self.sin[rows], self.ca_mask[rows])


def _fit(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A bool mask [..., S] cut or padded with False to [..., width]."""
    if mask.shape[-1] >= width:
        return mask[..., :width]
    return torch.cat([mask, mask.new_zeros(*mask.shape[:-1], width - mask.shape[-1])], dim=-1)


@dataclass
class _DeepBlock:
    """Block k >= 2 of a sorted drafter while drafting: SA keys/values of the slots it ran on (a prefix of the slots
    block k-1 ran on), CA keys/values of the verified context, and the pending slots (block k-1 ran, block k not:
    tokens that left at an earlier exit), which it runs before any later slot that goes this deep."""

    kv: LayerKV = field(default_factory=LayerKV)
    ca_keys: torch.Tensor | None = None  # [B, Hkv, M, hd]
    ca_values: torch.Tensor | None = None
    pending: list[_Pending] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if self.kv.keys is None else self.kv.keys.shape[2]

    def append_context(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.ca_keys is not None:
            k, v = torch.cat([self.ca_keys, k], dim=2), torch.cat([self.ca_values, v], dim=2)
        self.ca_keys, self.ca_values = k, v

    def take(self, n: int) -> None:
        """Keep the first n pending slots."""
        kept = []
        for p in self.pending:
            if n <= 0:
                break
            kept.append(p if p.size <= n else p.first(n))
            n -= p.size
        self.pending = kept


def _crop_deep(deep: list[_DeepBlock], first_length: int, length: int) -> None:
    """Keep slots < `length` in every deeper block; `first_length`: block 1's slot count after the same crop.
    Block k's pending slots are [len_k, len_{k-1}): cropping keeps the first min(len_{k-1}, length) - len_k'."""
    done = first_length
    for block in deep:
        kept = min(block.length, length)
        block.take(min(done, length) - kept)
        block.kv.crop(kept)
        done = kept


@dataclass
class MoATreeState(TreeState):
    """The MoA drafter's tree drafting state: `TreeState` (block 1's SA cache, one layer), the CA memory of the
    verified tokens: CA keys/values [B, Hkv, M, hd] of the target states read at each verified token's `prev_slots`,
    and `ca_valid` [B, M] (False for padding and tokens without a previous target state: never attended); for a
    sorted drafter the deeper blocks' own (`deep`, as in `MoADrafterCache`). The exit (1-based) each evaluation
    left at: `root_exits` [B] of the roots of the latest `tree_catch_up`, `node_exits` [B, k] of the nodes of the
    latest `tree_step` (the engine counts the tokens each proposed, `EngineStats.exit_counts`)."""

    ca_keys: torch.Tensor
    ca_values: torch.Tensor
    ca_valid: torch.Tensor
    root_exits: torch.Tensor
    node_exits: torch.Tensor
    deep: list[_DeepBlock] = field(default_factory=list)  # blocks 2..K of a sorted drafter

    def append_context(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Append CA keys/values [B, Hkv, n, hd] with their validity [B, n]."""
        self.ca_keys = torch.cat([self.ca_keys, k], dim=2)  # [B, Hkv, M+n, hd]
        self.ca_values = torch.cat([self.ca_values, v], dim=2)
        self.ca_valid = torch.cat([self.ca_valid, valid], dim=1)  # [B, M+n]

    def end_tree(self) -> None:
        super().end_tree()
        _crop_deep(self.deep, self.num_verified, self.num_verified)

    def map_slots(self, fn) -> None:
        if self.deep:
            raise ValueError("Re-laying the slots of a sorted drafter's deeper blocks is not supported: use exit 1.")
        super().map_slots(fn)
        self.ca_keys, self.ca_values, self.ca_valid = fn(self.ca_keys, 2), fn(self.ca_values, 2), fn(self.ca_valid, 1)

    @classmethod
    def concat_rows(cls, states: list["MoATreeState"]) -> "MoATreeState":
        for s in states:
            s.node_exits = s.node_exits[:, :0]  # [B, 0]: the exits of the last tree step are not carried over
        return super().concat_rows(states)

    @staticmethod
    def _concat_field(name: str, values: list):
        if name == "deep" and not any(values):
            return []
        return TreeState._concat_field(name, values)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        rows = rows.to(self.valid.device)
        for block in self.deep:
            block.kv.select_rows(rows)
            if block.ca_keys is not None:
                block.ca_keys, block.ca_values = block.ca_keys[rows], block.ca_values[rows]
            block.pending = [p.rows(rows) for p in block.pending]


@dataclass
class MoADrafterOutput(ModelOutput):
    """`logits`: [B, T, V] (None if not asked); `hidden_states`: the drafter's feature [B, T, d] (the predicted
    post-norm final hidden state of the target, or with TLI N > 0 the predicted activation after layer L-N);
    `final_hidden_states`: with N > 0, the target's final-norm output after its last N layers; `exit_logits` /
    `exit_hidden_states`: one per block of a sorted drafter (the last ones are `logits` / `hidden_states`)."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    final_hidden_states: torch.Tensor | None = None
    past_key_values: MoADrafterCache | None = None
    exit_logits: tuple[torch.Tensor, ...] | None = None  # sorted drafters: [B, T, V] per exit, exit 1 first
    exit_hidden_states: tuple[torch.Tensor, ...] | None = None  # [B, T, d] per block


def _full_attention_rotary(decoder: nn.Module) -> Callable | None:
    """The target's RoPE of its full-attention layers, which Target Layer Inference runs (`tli_unsupported_reason`):
    `decoder.rotary_emb`, with `layer_type="full_attention"` where it has one RoPE per layer type (Gemma 3)."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type="full_attention")
    return rotary


@dataclass
class _Attachment:
    """References to the target's modules the drafter borrows (plain references: not submodules, never saved)."""

    target: nn.Module
    embed: nn.Module
    lm_head: nn.Module
    tli_layers: list
    final_norm: nn.Module | None
    rotary: Callable | None
    tap: TargetTap
    handles: list


# -------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
class MoAPreTrainedModel(PreTrainedModel):
    config_class = MoADrafterConfig
    config: MoADrafterConfig
    base_model_prefix = "moa"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MoADecoderLayer", "MoACrossAttentionLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        """Initial values of the parameters a checkpoint did not set (transformers' `init` functions leave loaded
        ones alone): deeper blocks' output projections start at zero, an extra target's parts as the primary's."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "zero_init", False):
                init.zeros_(module.weight)
            elif getattr(module, "identity_init", False):
                init.eye_(module.weight)
            else:
                init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, std)
        elif isinstance(module, MoARMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MoACrossAttentionLayer):
            init.normal_(module.null_key, 0.0, std)
            init.zeros_(module.null_value)
        elif isinstance(module, MoARotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, MoALoRA):
            init.normal_(module.A, 0.0, module.A.shape[1] ** -0.5)
            init.zeros_(module.B)


class MoADrafterModel(DrafterMixin, MoAPreTrainedModel, GenerationMixin):
    """The MoA drafter. Attach it to its target, then pass it as `assistant_model` to `target.generate`.

    ```python
    drafter = MoADrafterModel.from_pretrained(path).attach(target)
    out = target.generate(**inputs, assistant_model=drafter)
    print(drafter.speculation_stats.mean_accepted_length)
    ```
    """

    supports_prompt_lookup = True  # verified context is read from the target's cache, so skipped cycles cost nothing
    records_exits = True  # `_decode` records the exit of every token it drafts (`record_exits`)

    def __init__(self, config: MoADrafterConfig):
        super().__init__(config)
        c = config
        self.self_attention = MoADecoderLayer(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            c.hidden_act,
        )
        self.cross_attention = MoACrossAttentionLayer(c)
        lsa_head_dim = c.lsa_hidden_size // c.lsa_num_attention_heads
        self.lsa_in_proj = (
            nn.Linear(c.target_kv_width, c.lsa_hidden_size, bias=False)
            if c.lsa_hidden_size != c.target_kv_width
            else None
        )
        self.layer_self_attention = MoADecoderLayer(
            c.lsa_hidden_size,
            c.lsa_num_attention_heads,
            c.lsa_num_key_value_heads,
            lsa_head_dim,
            c.lsa_intermediate_size,
            c.rms_norm_eps,
            c.hidden_act,
        )
        self.Ekv2E = nn.Linear(c.lsa_hidden_size, c.hidden_size, bias=True)  # authors' name for the LSA projection
        self.rotary_emb = MoARotaryEmbedding(c.head_dim, c.rope_theta)
        self.lsa_rotary_emb = MoARotaryEmbedding(lsa_head_dim, 10000.0)
        if c.own_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.target_hidden_size)
            self.lm_head = nn.Linear(c.target_hidden_size, c.vocab_size, bias=False)
        if c.draft_vocab_size is not None:  # a reduced head over the `draft_ids` tokens
            self.draft_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("draft_ids", torch.arange(c.draft_vocab_size), persistent=True)  # [V'] full ids
        if c.num_blocks > 1:  # S2D: blocks 2..K, an exit after each
            self.blocks = nn.ModuleList(MoABlock(c) for _ in range(c.num_blocks - 1))
        if c.extra_targets:
            self.target_parts = nn.ModuleDict(
                {name: self._new_parts(int(spec.get("lora_rank", 0))) for name, spec in c.extra_targets.items()}
            )
        self._active_target = PRIMARY_TARGET
        self._exit_override: list[float] | None = None  # `override_exit_thresholds`
        self._exit_tops: list[dict] | None = None  # `recording_exit_tops`
        self._attachment: _Attachment | None = None
        self._session: DraftingSession | None = None
        self.post_init()
        self.generation_config = self.default_generation_config(self.generation_config)

    # ----------------------------------------------------------------------------------------------------------------
    # Sorted blocks and several targets (S2D)
    # -----------------------------------------------------------------------------------------------------------------
    def block_layers(self) -> list[tuple[MoADecoderLayer, MoACrossAttentionLayer]]:
        """(SA, CA) of blocks 1..K: block 1 is `self_attention` + `cross_attention`, then `blocks`."""
        deeper = [(b.self_attention, b.cross_attention) for b in getattr(self, "blocks", None) or ()]
        return [(self.self_attention, self.cross_attention), *deeper]

    def keep_first_block(self) -> "MoADrafterModel":
        """Drop blocks 2..K of a sorted drafter: it then drafts every token at exit 1, exactly as the full drafter
        does with thresholds that leave every token there (block 1 keeps the one-block drafter's modules). For
        engines that draft at one exit only (vLLM's proposer)."""
        if self.config.num_blocks > 1:
            del self.blocks
            self.config.num_blocks = 1
            self.config.exit_thresholds = None
            for spec in (self.config.extra_targets or {}).values():
                spec.pop("exit_thresholds", None)
        return self

    def _shared_linears(self) -> dict[str, MoALinear]:
        """The linear layers of the SA/CA blocks, which an extra target's low-rank deltas adapt."""
        return {
            name: m
            for name, m in self.named_modules()
            if isinstance(m, MoALinear) and name.split(".")[0] in ("self_attention", "cross_attention", "blocks")
        }

    def _new_parts(self, lora_rank: int) -> MoATargetParts:
        c = self.config
        return MoATargetParts(c.target_kv_width, c.lsa_hidden_size, self._shared_linears(), lora_rank)

    @property
    def target_names(self) -> list[str]:
        """The targets this drafter serves: `PRIMARY_TARGET` ("main") first, then `config.extra_targets`."""
        return [PRIMARY_TARGET, *(self.config.extra_targets or {})]

    @property
    def active_target(self) -> str:
        return self._active_target

    def select_target(self, name: str) -> None:
        """Draft (and train, see `forward`'s `target_name`) with the parts of target `name`: its LSA input projection
        and low-rank deltas; "main" (`PRIMARY_TARGET`): the shared weights alone. `attach` selects by fingerprint."""
        self._check_target_name(name)
        parts = self.target_parts[name] if name != PRIMARY_TARGET else None
        for layer_name, linear in self._shared_linears().items():
            linear.delta = parts.delta(layer_name) if parts is not None else None  # plain references, not submodules
        self._active_target = name

    def _check_target_name(self, name: str) -> None:
        if name not in self.target_names:
            known = ", ".join(f"{n!r} ({path})" for n, path in self._target_paths().items())
            raise ValueError(
                f"Unknown target {name!r}: this drafter serves {known}. Add one with "
                "`drafter.add_target(name, model)`."
            )

    def _target_paths(self) -> dict[str, str | None]:
        """{name: target_name_or_path} of every target the drafter serves, the primary first."""
        extra = {n: spec.get("target_name_or_path") for n, spec in (self.config.extra_targets or {}).items()}
        return {PRIMARY_TARGET: self.config.target_name_or_path, **extra}

    @contextlib.contextmanager
    def using_target(self, name: str | None):
        """`with drafter.using_target(name):` the parts of `name` inside (None: the active ones), the previous
        selection restored after."""
        previous = self._active_target
        self.select_target(previous if name is None else name)
        try:
            yield self
        finally:
            self.select_target(previous)

    def target_part_parameters(self, name: str) -> list[nn.Parameter]:
        """The parameters only target `name` uses (to train a new target's parts alone): its LSA input projection and
        low-rank deltas; for "main", the primary LSA input projection (none when the LSA reads the keys/values
        directly)."""
        self._check_target_name(name)
        if name == PRIMARY_TARGET:
            return [] if self.lsa_in_proj is None else list(self.lsa_in_proj.parameters())
        return list(self.target_parts[name].parameters())

    @torch.no_grad()
    def add_target(
        self,
        name: str,
        target: PreTrainedModel | None = None,
        *,
        target_name_or_path: str | None = None,
        target_fingerprint: str | None = None,
        lora_rank: int = 0,
    ) -> None:
        """Serve another target of the primary one's signature (e.g. a fine-tune of it) with parts of its own
        (`MoATargetParts`): an LSA input projection copied from the primary's and, with `lora_rank` > 0, low-rank
        deltas on every linear layer of the SA/CA blocks, zero at first (so it first drafts as for the primary). Train
        them alone with `target_part_parameters(name)` (see docs/training.md). `target` (the model) gives the name
        and fingerprint by which `attach` recognises it; without it pass them, or select it with `select_target`."""
        if target is not None:
            diffs = self._signature_differences(target)
            if diffs:
                raise ValueError(
                    f"Target {name!r} cannot share this drafter: its signature differs from the primary target's ("
                    + "; ".join(diffs)
                    + "). A drafter serves targets of one architecture and vocabulary; train another for this one."
                )
            target_name_or_path = target_name_or_path or getattr(target.config, "name_or_path", None) or None
            target_fingerprint = target_fingerprint or _fingerprint(target)
        if name in self.target_names:
            raise ValueError(f"This drafter already serves a target named {name!r}: choose another name.")
        spec = {"target_name_or_path": target_name_or_path, "target_fingerprint": target_fingerprint}
        extra = {**(self.config.extra_targets or {}), name: {**spec, "lora_rank": int(lora_rank)}}
        self.config.validate_sorted(extra)  # raises before anything changes
        parts = self._new_parts(int(lora_rank))
        if self.lsa_in_proj is not None:
            parts.lsa_in_proj.weight.copy_(self.lsa_in_proj.weight)
        else:  # the primary reads the keys/values directly: start from the identity
            nn.init.eye_(parts.lsa_in_proj.weight)
        self.config.extra_targets = extra
        if getattr(self, "target_parts", None) is None:
            self.target_parts = nn.ModuleDict()
        self.target_parts[name] = parts.to(device=self.device, dtype=self.dtype)
        self.select_target(self._active_target)

    def target_for(self, target: PreTrainedModel) -> str | None:
        """The name of the served target whose recorded fingerprint `target`'s weights have (the primary first), or
        None (no match, or no fingerprints to compare)."""
        recorded = {PRIMARY_TARGET: self.config.target_fingerprint}
        recorded.update({n: s.get("target_fingerprint") for n, s in (self.config.extra_targets or {}).items()})
        if not any(recorded.values()):
            return None
        actual = _fingerprint(target)
        return next((n for n, fp in recorded.items() if fp and _weights_difference(fp, actual) == ""), None)

    # ----------------------------------------------------------------------------------------------------------------
    # Attaching to the target
    # -----------------------------------------------------------------------------------------------------------------
    def attach(self, target: PreTrainedModel, allow_other_target: bool = False) -> "MoADrafterModel":
        """Borrow the target's embedding, LM head (and last N layers) and install hooks that expose its cache.

        Nothing on the target is modified: two forward hooks are registered and removed again by `detach`.
        """
        if self._attachment is not None:
            if self._attachment.target is target:
                return self
            self.detach()
        name = self.check_target(target, allow_other_target=allow_other_target)
        self.select_target(name or PRIMARY_TARGET)
        n = self.config.target_layer_inference
        decoder = decoder_of(target)
        tli_layers = list(decoder.layers[len(decoder.layers) - n :]) if n > 0 else []
        tap = TargetTap(on_new_session=self._start_session)
        handles = register_hooks(target, tap)
        self._attachment = _Attachment(
            target=target,
            embed=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            tli_layers=tli_layers,
            final_norm=getattr(decoder, "norm", None) if n > 0 else None,
            rotary=_full_attention_rotary(decoder) if n > 0 else None,
            tap=tap,
            handles=handles,
        )
        self._start_session()
        return self

    def check_target(self, target: PreTrainedModel, allow_other_target: bool = False) -> str | None:
        """Raise a `ValueError` saying what is wrong if this drafter cannot serve `target`; else return the name of
        the recorded target it is (None: another model, accepted with `allow_other_target`)."""
        reason = unsupported_target_reason(target.config) or tli_unsupported_reason(
            target.config, self.config.target_layer_inference
        )
        if reason is not None:
            raise ValueError(f"This target cannot be served by a MoA drafter: {reason}.")
        name = self.target_for(target) if self.config.extra_targets else None
        try:
            self._check_signature(target, allow_other_target or name is not None)
        except ValueError as err:
            if not self.config.extra_targets:
                raise
            known = ", ".join(f"{n!r} ({path})" for n, path in self._target_paths().items())
            raise ValueError(f"{err} This drafter serves: {known}.") from None
        n = self.config.target_layer_inference
        if n > 0:
            decoder = decoder_of(target)
            for attr in ("layers", "norm", "rotary_emb"):
                if not hasattr(decoder, attr):
                    raise ValueError(
                        f"target_layer_inference={n} needs the target's decoder to expose `{attr}` "
                        f"({type(decoder).__name__} does not). Use target_layer_inference=0 for this target."
                    )
        return name if name is not None else (None if self._other_target_reason(target) else PRIMARY_TARGET)

    # ----------------------------------------------------------------------------------------------------------------
    # Borrowed or own embedding / head
    # -----------------------------------------------------------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] float32 next-token logits over the full vocabulary (-inf outside a draft
        vocabulary)."""
        if self.config.draft_vocab_size is not None:
            return self._full_vocab(self.draft_logits(hidden))
        self._require("LM head")
        head = self.get_output_embeddings()
        return head(hidden.to(head.weight.dtype)).float()

    def _full_vocab(self, draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] scattered into the full vocabulary [..., V] (-inf elsewhere)."""
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), -float("inf"))  # [..., V]
        return full.index_copy_(-1, self.draft_ids, draft)

    def _exit_logits(self, hidden: torch.Tensor, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An exit's float32 logits [..., V] and (if asked) its top probability [...] over the draft vocabulary."""
        draft = self.draft_logits(hidden)  # [..., V'] (V' = V without a draft vocabulary)
        top = draft.softmax(-1).amax(-1) if confidence else None
        return (self._full_vocab(draft) if self.config.draft_vocab_size is not None else draft), top

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V'] float32 logits over the draft vocabulary (`draft_ids`); the full head without
        one."""
        if self.config.draft_vocab_size is None:
            return self.head(hidden)
        return self.draft_head(hidden.to(self.draft_head.weight.dtype)).float()

    @torch.no_grad()
    def init_draft_vocab(self, token_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Set the draft vocabulary to `token_ids` [V'] (full-vocabulary ids, e.g. the most frequent tokens of the
        target's outputs) and start the draft head from those rows of the target's LM head weight [V, d]."""
        if self.config.draft_vocab_size is None:
            raise ValueError("This drafter has no draft vocabulary; build it with `draft_vocab_size=...`.")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != self.config.draft_vocab_size or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(
                f"Expected {self.config.draft_vocab_size} distinct token ids for the draft vocabulary, got "
                f"{token_ids.numel()} ({token_ids.unique().numel()} distinct)."
            )
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"Draft vocabulary ids must lie in [0, {self.config.vocab_size}).")
        self.draft_ids.copy_(token_ids.to(self.draft_ids.device))
        self.draft_head.weight.copy_(lm_head_weight[token_ids.to(lm_head_weight.device)].to(self.draft_head.weight))

    # ----------------------------------------------------------------------------------------------------------------
    # The three attentions
    # -----------------------------------------------------------------------------------------------------------------
    def compute_context(self, target_kv: torch.Tensor) -> torch.Tensor:
        """LSA: [B, T, L, 2*Hkv*hd] target keys/values per layer -> [B, T, d] one context vector per token."""
        B, T, L, W = target_kv.shape
        x = target_kv.to(self.dtype).reshape(B * T, L, W)  # each token is a sequence over the target's layers
        proj = self.lsa_in_proj  # the active target's own
        if self._active_target != PRIMARY_TARGET:
            proj = self.target_parts[self._active_target].lsa_in_proj
        if proj is not None:
            x = proj(x)  # [B*T, L, lsa_hidden]
        cos, sin = self.lsa_rotary_emb(torch.arange(L, device=x.device), x.dtype)  # position = layer index
        x = self.layer_self_attention(x, cos, sin, mask=None)  # no mask across layers
        return self.Ekv2E(x.mean(dim=1)).view(B, T, -1)  # mean over layers -> [B, T, d]

    def read_context(self, target_cache, start: int, end: int) -> torch.Tensor:
        """Context vectors [B, end-start, d] of target positions [start, end) read from the target's cache.

        The LSA treats every token on its own (attention runs across layers, never across tokens), so the positions
        are read in chunks of `CONTEXT_CHUNK` tokens and the last chunk is zero-padded to a power of two (then cut
        off again): the LSA only ever sees a handful of shapes (a long prompt costs no new kernel set-up on CPU), a
        cycle's few new tokens stay cheap, and memory stays bounded.

        Positions older than `oldest_held_position` (a sliding-window layer of the target has dropped them: the start
        of a prompt longer than the window, read at the first cycle) have no context: their vectors are zero, and
        `_sync` keeps them out of the CA memory (`extend_context`'s `valid`). Reading them from the layers that still
        held them instead (masking the others out of the LSA) drafted worse: mean acceptance 2.65-2.68 against
        2.74-2.80 for a tiny target with window 8 < prompt 24 (1500 training steps, 3 runs, 96 held-out prompts).
        """
        lo = min(max(start, oldest_held_position(target_cache)), end)  # positions [lo, end) are held by every layer
        out = self._context_chunks(lambda s, e: gather_target_kv(target_cache, lo + s, lo + e), end - lo)
        keys = target_cache.layers[0].keys
        dropped = keys.new_zeros(keys.shape[0], lo - start, self.config.hidden_size, dtype=self.dtype)  # no context
        return torch.cat([dropped, *out], dim=1)  # [B, end-start, d]

    def _context_chunks(self, gather: Callable[[int, int], torch.Tensor], n: int) -> list[torch.Tensor]:
        """Context vectors of n tokens in chunks [B, <= CONTEXT_CHUNK, d], from `gather(s, e)`: their target
        keys/values [B, e-s, L, W] of tokens s..e-1 (each chunk zero-padded to a power of two, see `read_context`)."""
        out = []
        for s in range(0, n, CONTEXT_CHUNK):
            kv = gather(s, min(n, s + CONTEXT_CHUNK))  # [B, m, L, W]
            m = kv.shape[1]
            size = min(CONTEXT_CHUNK, 1 << (m - 1).bit_length())  # m rounded up to a power of two
            if m < size:
                kv = torch.cat([kv, kv.new_zeros(kv.shape[0], size - m, *kv.shape[2:])], dim=1)  # [B, size, L, W]
            out.append(self.compute_context(kv)[:, :m])  # [B, m, d]
        return out

    def _tli(self, h, positions, tli_cache, mask=None):
        """Run the target's last N layers (with `tli_cache` holding their keys/values) and final norm on h."""
        att = self._attachment
        if att is None:
            raise RuntimeError("target_layer_inference > 0 runs the target's last layers: attach the drafter first.")
        dtype = att.tli_layers[0].parameters().__next__().dtype
        x = h.to(dtype)
        position_ids = positions.expand(h.shape[0], -1)
        cos_sin = att.rotary(x, position_ids)
        for layer in att.tli_layers:
            x = layer(
                x,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=cos_sin,
                **{CACHE_NAME: tli_cache},
            )
            x = x[0] if isinstance(x, tuple) else x
        return att.final_norm(x).to(h.dtype)

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_kv: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        target_kv_held: torch.Tensor | None = None,
        cycle_starts: torch.LongTensor | None = None,
        sa_mask: torch.Tensor | None = None,
        target_tli_kv: list | None = None,
        return_logits: bool = True,
        exits: str = "all",
        target_name: str | None = None,
        **kwargs,
    ) -> MoADrafterOutput:
        """Training-time (parallel) forward over whole sequences with simulated drafting cycles.

        Args:
            input_ids: [B, T] tokens.
            target_kv: [B, T, L, 2*Hkv*hd] the target's keys/values per layer (see `gather_target_kv`), or
            context: [B, T, d] precomputed context vectors.
            target_kv_held: optional bool [B, T]: whether every target layer still held token j's key/value when it
                was read at inference (a sliding-window layer drops old positions; see `held_at_reads`); tokens it
                was not are kept out of the CA memory, as at inference. None: all held.
            cycle_starts: [B, T] start(i); position i reads the context of tokens j < start(i) only. Default: i
                (every position is the first of its cycle: all earlier tokens verified).
            sa_mask: optional bool [B, T, T] SA mask (default causal).
            target_tli_kv: with N > 0, a list of N (key, value) pairs [B, Hkv, T, hd] from the target's last N
                layers; position i sees them for j < start(i) and the drafted ones for start(i) <= j <= i.
            exits: "all": `exit_logits` too, the logits of every exit (block) of a sorted drafter; "last": the last
                exit's logits only (what an inference-style call needs; `exit_logits` None).
            target_name: the target whose parts to use (None: the active one, see `select_target`).
        """
        with self.using_target(target_name):
            args = (context, target_kv_held, cycle_starts, sa_mask, target_tli_kv, return_logits, exits)
            return self._forward(input_ids, target_kv, *args)

    def _forward(
        self, input_ids, target_kv, context, target_kv_held, cycle_starts, sa_mask, target_tli_kv, return_logits, exits
    ) -> MoADrafterOutput:
        B, T = input_ids.shape
        device = input_ids.device
        pos = torch.arange(T, device=device)
        if cycle_starts is None:
            cycle_starts = pos.expand(B, T)
        if context is None:
            if target_kv is None:
                raise ValueError("forward needs `target_kv` (the target's per-layer keys/values) or `context`.")
            context = self.compute_context(target_kv)
        h = self.embed(input_ids)  # [B, T, d]
        cos, sin = self.rotary_emb(pos, h.dtype)
        causal = pos[None, :] <= pos[:, None]  # [T, T]
        mask = causal[None, None] if sa_mask is None else (sa_mask & causal)[:, None]
        verified = pos[None, None, :] < cycle_starts[:, :, None]  # [B, T, T]: j < start(i)
        ca_mask = verified if target_kv_held is None else verified & target_kv_held[:, None, :]
        outputs = []  # the output of every block: one exit each
        for sa, ca in self.block_layers():
            h = sa(h, cos, sin, mask=mask)
            ctx_k, ctx_v = ca.context_keys_values(context.to(h.dtype), cos, sin)
            h = ca(h, cos, sin, ctx_k, ctx_v, mask=ca_mask[:, None])
            outputs.append(h)
        final = None
        if self.config.target_layer_inference > 0:
            if target_tli_kv is None:
                raise ValueError("target_layer_inference > 0: pass `target_tli_kv` (the last N layers' keys/values).")
            tli = DynamicCache()
            first = self.config.target_num_hidden_layers - self.config.target_layer_inference
            for i, (k, v) in enumerate(target_tli_kv):
                tli.update(k, v, first + i)
            # keys: [target j < start(i) | drafted start(i) <= j <= i]
            drafted = causal[None] & (pos[None, None, :] >= cycle_starts[:, :, None])  # [B, T, T]
            visible = torch.cat([verified, drafted], dim=-1)[:, None]  # [B, 1, T, 2T]
            dtype = self._attachment.tli_layers[0].parameters().__next__().dtype
            additive = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
            final = self._tli(h, pos[None], tli, mask=additive)
        logits = self.head(final if final is not None else h) if return_logits else None
        exit_logits = None
        if return_logits and exits == "all":
            exit_logits = (*(self.head(x) for x in outputs[:-1]), logits)
        return MoADrafterOutput(
            logits=logits,
            hidden_states=h,
            final_hidden_states=final,
            exit_logits=exit_logits,
            exit_hidden_states=tuple(outputs),
        )

    # ----------------------------------------------------------------------------------------------------------------
    # Inference: one drafting call of assisted generation
    # -----------------------------------------------------------------------------------------------------------------
    def _sync(self, cache: MoADrafterCache, num_verified: int) -> None:
        """Append CA memory (and the TLI cache) for target positions that are verified and not yet read."""
        att = self._attachment
        target_cache = att.tap.cache if att is not None else None
        if target_cache is None or target_cache.get_seq_length() == 0:
            return
        end = min(target_cache.get_seq_length(), num_verified)
        start = cache.context_length
        if end > start:
            held = oldest_held_position(target_cache)  # 0 unless a sliding-window layer dropped older positions
            valid = None if start >= held else torch.arange(start, end) >= held  # [T] held by every layer
            self.extend_context(cache, self.read_context(target_cache, start, end), valid=valid)
            if self._session is not None:
                self._session.context_reads.append((start, end))
        if self.config.target_layer_inference > 0:
            self._sync_tli(cache, target_cache, end)

    def _sync_tli(self, cache: MoADrafterCache, target_cache, end: int) -> None:
        """TLI cache = the target's own keys/values of its last N layers for verified positions < end (keys/values
        computed from drafted positions are dropped)."""
        if cache.tli is None:
            cache.tli = DynamicCache()
        if cache.tli_length > cache.tli_verified:
            cache.tli.crop(cache.tli_verified - cache.tli_length)
        start = cache.tli_verified
        first = self.config.target_num_hidden_layers - self.config.target_layer_inference
        for idx in range(first, self.config.target_num_hidden_layers):
            layer = target_cache.layers[idx]
            cache.tli.update(layer.keys[:, :, start:end], layer.values[:, :, start:end], idx)
        cache.tli_verified = end

    def extend_context(self, cache: MoADrafterCache, context: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Append context vectors [B, T, d] of the next verified positions to the CA memory of `cache`.

        valid: optional bool [T], False for positions without context (older than `oldest_held_position` when they
        were read; `read_context` gives them zero vectors), which the CA then never attends to. None: all valid.
        (A client that receives context vectors from a server, see `moa_hf.serving`, calls this directly.)
        """
        start = cache.context_length
        context = context.to(self.dtype)
        cos, sin = self.rotary_emb(torch.arange(start, start + context.shape[1], device=context.device), context.dtype)
        cache.append_context(*self.cross_attention.context_keys_values(context, cos, sin), valid=valid)
        for block, (_, ca) in zip(self._deep_blocks(cache), self.block_layers()[1:]):
            block.append_context(*ca.context_keys_values(context, cos, sin))

    def draft_step(self, new_ids: torch.Tensor, cache: MoADrafterCache) -> torch.Tensor:
        """Public form of one drafting step: feed `new_ids` [B, T] (tokens not yet in the SA cache), get the
        logits [B, V] for the next token given the CA memory in `cache` (a sorted drafter's from the exit each row
        leaves at, see `config.exit_thresholds`)."""
        return self._decode(new_ids, cache)

    def _decode(self, new_ids: torch.Tensor, cache: MoADrafterCache) -> torch.Tensor:
        """Feed the tokens not yet in the SA cache; logits [B, V] for the token after the last one."""
        past = cache.get_seq_length()
        T = new_ids.shape[1]
        pos = torch.arange(past, past + T, device=new_ids.device)
        h = self.embed(new_ids)  # [B, T, d]
        cos, sin = self.rotary_emb(pos, h.dtype)
        mask = None
        if T > 1:  # causal among the new tokens, all cached ones visible
            mask = torch.arange(past + T, device=h.device)[None, :] <= pos[:, None]  # [T, past+T]
        h = self.self_attention(h, cos, sin, mask=mask, cache=cache)
        cache.tokens = new_ids if cache.tokens is None else torch.cat([cache.tokens, new_ids], dim=1)
        M = cache.context_length
        cache.cycle_starts += [min(p, M) for p in range(past, past + T)]  # position p reads the context of j < p, < M
        if cache.ca_keys is None:
            B, hkv, hd = h.shape[0], self.config.num_key_value_heads, self.config.head_dim
            cache.ca_keys = cache.ca_values = h.new_zeros(B, hkv, 0, hd)
        if self.config.num_blocks > 1:
            return self._decode_sorted(h, past, cos, sin, cache)
        self.record_exits([h.shape[0]])
        h = h[:, -1:]  # only the last position drafts
        ca_mask = None if cache.ca_valid is None else cache.ca_valid[None, None, None, :]  # [1, 1, 1, M]
        h = self.cross_attention(h, cos[-1:], sin[-1:], cache.ca_keys, cache.ca_values, mask=ca_mask)
        if self.config.target_layer_inference > 0:
            if cache.tli is None:
                cache.tli = DynamicCache()
            h = self._tli(h, pos[-1:][None], cache.tli)
        return self.head(h)[:, -1]  # [B, V] float32

    def _decode_sorted(self, h, past: int, cos, sin, cache: MoADrafterCache) -> torch.Tensor:
        """Sorted drafters: block 1's CA on the T new positions past.. (SA output h [B, T, d]) and the adaptive exits
        of the last one; logits [B, V]. Every position keeps its block-1 output for the deeper blocks."""
        T, M = h.shape[1], cache.context_length
        starts = torch.arange(past, past + T, device=h.device).clamp(max=M)  # [T] as `cache.cycle_starts`
        ca_mask = torch.arange(M, device=h.device)[None, :] < starts[:, None]  # [T, M]
        if cache.ca_valid is not None:
            ca_mask = ca_mask & cache.ca_valid[None, :]
        ca_mask = ca_mask[None, None]  # [1, 1, T, M]
        every = T == 1 and past >= M and cache.ca_valid is None  # one drafted token sees all context: no mask
        h = self.cross_attention(h, cos, sin, cache.ca_keys, cache.ca_values, mask=None if every else ca_mask)
        slots = torch.arange(past + T, device=h.device)  # [past+T]
        sa_mask = slots[None, :] <= slots[past:, None]  # [T, past+T] causal
        first = _Pending(h, sa_mask[None, None], cos, sin, ca_mask)
        tops = None if self._exit_tops is None else []
        logits, exit_of = self._adaptive_exits(first, self._deep_blocks(cache), record=tops)  # [B, 1, V], [B, 1]
        if self._session is not None:
            self.record_exits(torch.bincount(exit_of.flatten() - 1, minlength=self.config.num_blocks).tolist())
        if tops is not None:
            self._exit_tops.append(
                {
                    "position": past + T,
                    "cycle": len(self._session.calls) if self._session is not None else None,
                    "top1": torch.cat([top1 for top1, _ in tops], dim=-1),  # [B, K]
                    "confidence": torch.cat([conf for _, conf in tops], dim=-1),  # [B, K]
                    "exit": exit_of[:, -1],  # [B]
                }
            )
        return logits[:, -1]  # [B, V]

    def _deep_blocks(self, state) -> list[_DeepBlock]:
        """The deeper blocks' drafting state of a cache or tree state (created on first use)."""
        if len(state.deep) < self.config.num_blocks - 1:
            state.deep = [_DeepBlock() for _ in range(self.config.num_blocks - 1)]
        return state.deep

    def _run_pending(self, block: _DeepBlock, sa: MoADecoderLayer, ca: MoACrossAttentionLayer) -> _Pending:
        """Run a deeper block on all its pending slots (in slot order); returns their outputs with their masks."""
        todo, block.pending = block.pending, []
        width = block.length + sum(p.size for p in todo)  # the block's slots after this run
        M = block.ca_keys.shape[2] if block.ca_keys is not None else 0
        x = torch.cat([p.x for p in todo], dim=1)  # [B, n, d]
        sa_mask = torch.cat([_fit(p.sa_mask, width) for p in todo], dim=-2)  # [B|1, 1, n, width]
        ca_mask = torch.cat([_fit(p.ca_mask, M) for p in todo], dim=-2)  # [B|1, 1, n, M]
        cos, sin = torch.cat([p.cos for p in todo], dim=-2), torch.cat([p.sin for p in todo], dim=-2)
        if block.ca_keys is None:
            block.ca_keys = block.ca_values = x.new_zeros(
                x.shape[0], self.config.num_key_value_heads, 0, self.config.head_dim
            )
        x = sa(x, cos, sin, mask=sa_mask, cache=block.kv)
        x = ca(x, cos, sin, block.ca_keys, block.ca_values, mask=ca_mask)
        return _Pending(x, sa_mask, cos, sin, ca_mask)

    def _adaptive_exits(
        self, x: _Pending, deep: list[_DeepBlock], m: int = 1, record: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """S2D's adaptive depth for the last `m` slots of block 1's output `x` ([B, n, d] with what deeper blocks need
        to run these n slots): the logits [B, m, V] of each slot's exit and that exit [B, m] (1-based). With a
        `record` list, every block and every exit's head run, and each exit appends its (top-1 [B, m], top
        probability [B, m]); the drafted logits and exits stay those of the thresholds.

        A slot leaves at the first exit k < K whose top probability clears `exit_thresholds[k-1]`, else at exit K.
        Block k runs when any slot still needs it (every row of the chain, every node of the tree's frontier: one
        batched call beats gathering the rows that need it), and first on its `pending` slots (tokens that left
        earlier, in slot order), so its keys/values are those the full-depth drafter has. Each exit's head runs
        once, giving both its logits and the confidence."""
        K, thresholds = self.config.num_blocks, [*self._exit_thresholds(), 0.0]  # exit K always accepts
        logits = exit_of = None
        for k in range(1, K + 1):
            if k > 1:  # block k catches up on the slots that left before it, then runs these
                deep[k - 2].pending.append(x)
                x = self._run_pending(deep[k - 2], *self.block_layers()[k - 1])
            t = thresholds[k - 1]
            if t > 1.0 and record is None:  # no token leaves here: no head needed
                continue
            exit_logits, top = self._exit_logits(x.x[:, -m:], confidence=t > 0.0 or record is not None)
            if record is not None:  # exit_logits [B, m, V], top [B, m] or None
                record.append((exit_logits.argmax(-1), top))
            if t > 1.0:  # recorded only: no token leaves here
                continue
            leave = (
                torch.ones(exit_logits.shape[:-1], dtype=torch.bool, device=x.x.device) if top is None else top >= t
            )
            if exit_of is not None:
                leave = leave & (exit_of == 0)
            logits = exit_logits if logits is None else torch.where(leave[..., None], exit_logits, logits)
            exit_of = torch.where(leave, k, 0 if exit_of is None else exit_of)  # [B, m]
            if record is None and bool((exit_of > 0).all()):
                break
        if k < K:  # the slots block k+1 has not run on
            deep[k - 1].pending.append(x)
        return logits, exit_of

    def _exit_thresholds(self) -> list[float]:
        """`exit_thresholds_for` the active target (read at every drafting step); None: never leave before exit K."""
        thresholds = self.exit_thresholds_for()
        if thresholds is None:
            return [2.0] * (self.config.num_blocks - 1)
        return check_exit_thresholds(thresholds, self.config.num_blocks)

    def exit_thresholds_for(self, name: str | None = None) -> list[float] | None:
        """The exit thresholds drafting for target `name` (None: the active one) uses: those of
        `override_exit_thresholds` while it holds, else `config.target_exit_thresholds(name)`: the target's own, else
        `config.exit_thresholds` (None: every token leaves at the last exit)."""
        if self._exit_override is not None:
            return self._exit_override
        if name is None:  # the drafting step's case: the active target is a known one
            name = self._active_target
        else:
            self._check_target_name(name)
        return self.config.target_exit_thresholds(name)

    def set_exit_thresholds(self, thresholds: list[float] | None, target: str = PRIMARY_TARGET) -> None:
        """Store tuned thresholds for `target`: the primary's are `config.exit_thresholds` (they also serve every
        target without its own), another target's go into its `extra_targets` entry (None: it uses the primary's
        again)."""
        self._check_target_name(target)
        if thresholds is not None:
            thresholds = check_exit_thresholds(thresholds, self.config.num_blocks)
        if target == PRIMARY_TARGET:
            self.config.exit_thresholds = thresholds
            return
        spec = {k: v for k, v in self.config.extra_targets[target].items() if k != "exit_thresholds"}
        if thresholds is not None:
            spec["exit_thresholds"] = thresholds
        self.config.extra_targets = {**self.config.extra_targets, target: spec}

    def override_exit_thresholds(self, thresholds: list[float] | None) -> contextlib.AbstractContextManager:
        """Draft every target with `thresholds` (e.g. `fixed_exit_thresholds(k, K)`: always exit k) instead of the
        stored ones; None lifts the override. Lasts until the next call, or used as `with drafter.override_exit_
        thresholds(t):` until the block ends (the previous override restored)."""
        previous = self._exit_override
        self._exit_override = None if thresholds is None else check_exit_thresholds(thresholds, self.config.num_blocks)

        @contextlib.contextmanager
        def restore():
            try:
                yield self
            finally:
                self._exit_override = previous

        return restore()

    @contextlib.contextmanager
    def recording_exit_tops(self):
        """Inside the block, every chain drafting step (`draft_step`, assisted generation) of a sorted drafter runs
        all K exits and appends to the yielded list {"position": p, "cycle": c, "top1": [B, K], "confidence":
        [B, K], "exit": [B]}: for the token drafted at sequence position p (0-based) in drafting cycle c (the
        session's drafting calls so far), each exit's top-1 (full-vocabulary id) and top probability, and the exit
        the token left at. The drafter still drafts with its thresholds, so the tokens stay the same; every step
        costs the full depth. For analysis (`moa tune`'s exit agreement), not for serving."""
        if self.config.num_blocks < 2:
            raise ValueError(
                f"recording_exit_tops compares the exits of a sorted drafter; this one has num_blocks "
                f"{self.config.num_blocks}. Use a drafter with num_blocks > 1 (`moa train --num-blocks 3`)."
            )
        previous, self._exit_tops = self._exit_tops, []
        try:
            yield self._exit_tops
        finally:
            self._exit_tops = previous

    def new_cache(self) -> MoADrafterCache:
        cache = MoADrafterCache()
        if self.config.num_blocks > 1:
            self._deep_blocks(cache)
        return cache

    def _prepare_draft(
        self, input_ids: torch.Tensor, cache: MoADrafterCache, max_new_tokens: int, min_new_tokens: int
    ):
        """Roll the SA cache back to the tokens it was computed from (never the last one: its output drafts), read
        the context of newly verified tokens (LSA), and draft with SA + CA per token (see `DrafterMixin.generate`).
        """
        num_verified = input_ids.shape[1]
        # the CA memory holds verified tokens only, which stay verified (after lookup cycles SA lags behind it)
        cache.crop_self(min(cache.common_prefix(input_ids), num_verified - 1))
        self._sync(cache, num_verified)
        pending = input_ids[:, cache.get_seq_length() :]  # [1, P] verified tokens not yet in the SA cache

        def next_logits(token: torch.Tensor | None) -> torch.Tensor:
            return self._decode(pending if token is None else token, cache)  # [1, V]

        return next_logits, max_new_tokens

    # ----------------------------------------------------------------------------------------------------------------
    # Tree drafting (the engine in custom_generate/engine.py; see `DrafterMixin` and `TreeState`)
    # -----------------------------------------------------------------------------------------------------------------
    def tree_unsupported_reason(self) -> str | None:
        if self.config.target_layer_inference > 0:
            return (
                f"Tree drafting needs target_layer_inference=0 (this drafter has {self.config.target_layer_inference}"
                ": it runs the target's last layers on every drafted token, a chain). Pass it as `assistant_model` "
                "to `target.generate` instead, or use a drafter with target_layer_inference=0."
            )
        return None

    def tree_start(self, batch_size: int) -> MoATreeState:
        """A fresh tree drafting state for `batch_size` rows (no verified token yet)."""
        self._check_tree()
        c = self.config
        empty = torch.zeros(batch_size, c.num_key_value_heads, 0, c.head_dim, dtype=self.dtype, device=self.device)
        state = MoATreeState(
            **TreeState.empty_fields(batch_size, 1, self.device),
            ca_keys=empty,  # [B, Hkv, 0, hd]
            ca_values=empty,
            ca_valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device),  # [B, 0]
            root_exits=torch.ones(batch_size, dtype=torch.long, device=self.device),  # [B]
            node_exits=torch.ones(batch_size, 0, dtype=torch.long, device=self.device),  # [B, 0]
        )
        if c.num_blocks > 1:
            self._deep_blocks(state)
        return state

    @torch.no_grad()
    def tree_catch_up(
        self,
        state: MoATreeState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        prev_slots: torch.Tensor,
        target_cache,
        prev_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed newly verified `tokens` [B, n] (right-aligned; `valid` [B, n] False on left padding; `positions`
        [B, n] real positions). CA memory: the context (LSA) of the target's keys/values at `prev_slots` [B, n]
        (the token at position-1; -1: none) of `target_cache` (a transformers cache, or a function reading another
        engine's cache: slots [B, m] -> [B, m, L, 2*Hkv*hd], as `moa_hf.vllm` reads vLLM's), with RoPE at
        position-1. Returns float32 logits [B, V] of the token after each row's last one (the tree root's children),
        from the exit each row's root leaves at; the deeper blocks run on these tokens when a later token first
        needs them."""
        state.end_tree()
        # a transformers cache, or a reader of another engine's cache (vLLM's paged one): slots -> [B, m, L, W]
        read = target_cache if callable(target_cache) else functools.partial(gather_target_kv_at, target_cache)
        context = torch.cat(self._context_chunks(lambda s, e: read(prev_slots[:, s:e]), tokens.shape[1]), dim=1)
        cos, sin = self.rotary_emb(positions - 1, context.dtype)  # [B, n, hd]: the context is position-1's
        k, v = self.cross_attention.context_keys_values(context, cos, sin)  # [B, Hkv, n, hd]
        state.append_context(k, v, valid & (prev_slots >= 0))
        for block, (_, ca) in zip(state.deep, self.block_layers()[1:]):
            block.append_context(*ca.context_keys_values(context, cos, sin))
        h = self.embed(tokens)  # [B, n, d]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [B, n, hd]
        sa_mask = state.add_verified(valid)  # [B, 1, n, V]
        if self.config.num_blocks > 1:
            h = self.self_attention(h, cos, sin, mask=sa_mask, cache=state.layers[0])
            n, M = tokens.shape[1], state.ca_keys.shape[2]
            own = M - n + torch.arange(n, device=h.device)  # [n] each verified token's CA slot (position-1's context)
            ca_mask = (torch.arange(M, device=h.device)[None, :] <= own[:, None])[None] & state.ca_valid[:, None, :]
            logits, exits = self._tree_exits(state, _Pending(h, sa_mask, cos, sin, ca_mask[:, None]), m=1)
            state.root_exits = exits[:, -1]  # [B]
            return logits[:, -1]  # [B, V]
        h = self.self_attention(h, cos, sin, mask=sa_mask, cache=state.layers[0])[:, -1:]
        state.root_exits = torch.ones_like(tokens[:, -1])  # [B]
        return self._tree_logits(state, h, cos[:, -1:], sin[:, -1:])[:, -1]  # [B, V]

    @torch.no_grad()
    def tree_step(
        self, state: MoATreeState, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor
    ) -> torch.Tensor:
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`). Each node
        sees in SA the row's verified tokens, its ancestors and itself; in CA the verified context. Returns float32
        logits [B, k, V] of each node's next token. A sorted drafter's nodes each leave at their own exit; a deeper
        block runs on the whole frontier when any node needs it (see `_adaptive_exits`)."""
        h = self.embed(tokens)  # [B, k, d]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [B, k, hd]
        sa_mask = state.add_nodes(parents)  # [B, 1, k, S]
        h = self.self_attention(h, cos, sin, mask=sa_mask, cache=state.layers[0])
        if self.config.num_blocks > 1:
            ca_mask = state.ca_valid[:, None, None, :].expand(-1, -1, h.shape[1], -1)  # [B, 1, k, M]
            logits, state.node_exits = self._tree_exits(state, _Pending(h, sa_mask, cos, sin, ca_mask), m=h.shape[1])
            return logits
        state.node_exits = torch.ones_like(tokens)  # [B, k]
        return self._tree_logits(state, h, cos, sin)  # [B, k, V]

    def _tree_exits(self, state: MoATreeState, first: _Pending, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted drafters: block 1's CA on the new slots (SA output `first.x`), then `_adaptive_exits` for the last
        m: their float32 logits [B, m, V] and exits [B, m]."""
        first.x = self.cross_attention(first.x, first.cos, first.sin, state.ca_keys, state.ca_values, first.ca_mask)
        return self._adaptive_exits(first, state.deep, m=m)

    def _tree_logits(self, state: MoATreeState, h, cos, sin) -> torch.Tensor:
        """CA over the verified context of each row and the head: h [B, T, d] -> float32 logits [B, T, V]."""
        mask = state.ca_valid[:, None, None, :]  # [B, 1, 1, M]
        return self.head(self.cross_attention(h, cos, sin, state.ca_keys, state.ca_values, mask=mask))


MoADrafterConfig.register_for_auto_class()
MoADrafterModel.register_for_auto_class("AutoModel")
