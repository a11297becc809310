"""Mixture-of-Attentions (MoA) drafter for speculative decoding (Zimmer et al., ICLR 2025, arXiv 2410.03804).

Per drafting cycle (the target has verified tokens 0..n-1 and cached keys/values for 0..n-2):
  1. LSA: for each newly verified token, attention across the target's L layers over that layer's cached key/value,
     mean over layers, projection -> one context vector per token; CA keys/values of it are appended to the CA cache.
     (A sliding-window layer keeps only its newest positions: those it dropped, e.g. the start of a prompt longer
     than its window, read at the first cycle, are left out of the CA memory; see `read_context`.)
  2. per drafted token: embedding -> SA (causal, own KV cache) -> CA (queries attend to verified context only)
     -> [TLI: the target's last N layers with the target's own cache] -> the target's LM head.

The drafting runtime shared with the EAGLE drafter (target hooks, the `generate` that assisted generation calls, the
drafting loop, statistics, the tree drafting state) is in drafting.py, prompt lookup in lookup.py. The tree drafting
API (`tree_start`, `tree_catch_up`, `tree_step`, ...; for the engine of custom_generate/) drafts the same tokens as
the chain, node by node, for left-padded batches.

This file ships inside every Hub repo as remote code: it imports only torch, transformers and its sibling files.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import rotate_half

from .configuration_moa import MoADrafterConfig, tli_unsupported_reason, unsupported_target_reason
from .drafting import (
    DrafterMixin,
    DraftingSession,
    RollbackCache,
    TargetTap,
    TreeState,
    decoder_of,
    register_hooks,
)

__all__ = [
    "MoADrafterModel",
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


class MoAMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoAAttention(nn.Module):
    """Grouped-query attention whose queries and keys/values may come from different streams (self or cross)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

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
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
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
    """

    def __init__(self):
        self.tokens = None  # [B, T] the tokens whose SA keys/values are cached
        self.sa_keys = self.sa_values = None  # [B, Hkv, T, hd]
        self.ca_keys = self.ca_values = None  # [B, Hkv, M, hd]
        self.ca_valid: torch.Tensor | None = None  # [M] bool, False: no context for that position; None: all valid
        self.tli: DynamicCache | None = None
        self.tli_verified = 0  # the TLI cache holds the target's own keys/values for positions < tli_verified

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

    def truncate(self, length: int) -> None:
        """Keep positions < `length` (0 empties the cache)."""
        self.crop_self(length)
        if self.ca_keys is not None:
            self.ca_keys, self.ca_values = self.ca_keys[:, :, :length], self.ca_values[:, :, :length]
        if self.ca_valid is not None:
            self.ca_valid = self.ca_valid[:length]
        if self.tli_length > length:
            self.tli.crop(length - self.tli_length)
        self.tli_verified = min(self.tli_verified, length)


@dataclass
class MoATreeState(TreeState):
    """The MoA drafter's tree drafting state: `TreeState` (its SA cache, one layer) and the CA memory of the verified
    tokens: CA keys/values [B, Hkv, M, hd] of the target states read at each verified token's `prev_slots`, and
    `ca_valid` [B, M] (False for padding and tokens without a previous target state: never attended)."""

    ca_keys: torch.Tensor
    ca_values: torch.Tensor
    ca_valid: torch.Tensor

    def append_context(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Append CA keys/values [B, Hkv, n, hd] with their validity [B, n]."""
        self.ca_keys = torch.cat([self.ca_keys, k], dim=2)  # [B, Hkv, M+n, hd]
        self.ca_values = torch.cat([self.ca_values, v], dim=2)
        self.ca_valid = torch.cat([self.ca_valid, valid], dim=1)  # [B, M+n]


@dataclass
class MoADrafterOutput(ModelOutput):
    """`logits`: [B, T, V] (None if not asked); `hidden_states`: the drafter's feature [B, T, d] (the predicted
    post-norm final hidden state of the target, or with TLI N > 0 the predicted activation after layer L-N);
    `final_hidden_states`: with N > 0, the target's final-norm output after its last N layers."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    final_hidden_states: torch.Tensor | None = None
    past_key_values: MoADrafterCache | None = None


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
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, MoARMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MoACrossAttentionLayer):
            module.null_key.normal_(0.0, std)
            module.null_value.zero_()
        elif isinstance(module, MoARotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq())


class MoADrafterModel(DrafterMixin, MoAPreTrainedModel, GenerationMixin):
    """The MoA drafter. Attach it to its target, then pass it as `assistant_model` to `target.generate`.

    ```python
    drafter = MoADrafterModel.from_pretrained(path).attach(target)
    out = target.generate(**inputs, assistant_model=drafter)
    print(drafter.speculation_stats.mean_accepted_length)
    ```
    """

    supports_prompt_lookup = True  # verified context is read from the target's cache, so skipped cycles cost nothing

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
        self._attachment: _Attachment | None = None
        self._session: DraftingSession | None = None
        self.post_init()
        self.generation_config = self.default_generation_config(self.generation_config)

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
        self.check_target(target, allow_other_target=allow_other_target)
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

    def check_target(self, target: PreTrainedModel, allow_other_target: bool = False) -> None:
        """Raise a `ValueError` saying what is wrong if this drafter cannot serve `target`."""
        reason = unsupported_target_reason(target.config) or tli_unsupported_reason(
            target.config, self.config.target_layer_inference
        )
        if reason is not None:
            raise ValueError(f"This target cannot be served by a MoA drafter: {reason}.")
        self._check_signature(target, allow_other_target)
        n = self.config.target_layer_inference
        if n > 0:
            decoder = decoder_of(target)
            for attr in ("layers", "norm", "rotary_emb"):
                if not hasattr(decoder, attr):
                    raise ValueError(
                        f"target_layer_inference={n} needs the target's decoder to expose `{attr}` "
                        f"({type(decoder).__name__} does not). Use target_layer_inference=0 for this target."
                    )

    # ----------------------------------------------------------------------------------------------------------------
    # Borrowed or own embedding / head
    # -----------------------------------------------------------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] float32 next-token logits over the full vocabulary (-inf outside a draft
        vocabulary)."""
        if self.config.draft_vocab_size is not None:
            draft = self.draft_logits(hidden)  # [..., V']
            full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), -float("inf"))  # [..., V]
            return full.index_copy_(-1, self.draft_ids, draft)
        self._require("LM head")
        head = self.get_output_embeddings()
        return head(hidden.to(head.weight.dtype)).float()

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
        if self.lsa_in_proj is not None:
            x = self.lsa_in_proj(x)  # [B*T, L, lsa_hidden]
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
                past_key_values=tli_cache,
                use_cache=True,
                position_embeddings=cos_sin,
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
        """
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
        h = self.self_attention(h, cos, sin, mask=mask)
        ctx_k, ctx_v = self.cross_attention.context_keys_values(context.to(h.dtype), cos, sin)
        verified = pos[None, None, :] < cycle_starts[:, :, None]  # [B, T, T]: j < start(i)
        ca_mask = verified if target_kv_held is None else verified & target_kv_held[:, None, :]
        h = self.cross_attention(h, cos, sin, ctx_k, ctx_v, mask=ca_mask[:, None])
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
        return MoADrafterOutput(logits=logits, hidden_states=h, final_hidden_states=final)

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

    def draft_step(self, new_ids: torch.Tensor, cache: MoADrafterCache) -> torch.Tensor:
        """Public form of one drafting step: feed `new_ids` [B, T] (tokens not yet in the SA cache), get the
        logits [B, V] for the next token given the CA memory in `cache`."""
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
        h = self.self_attention(h, cos, sin, mask=mask, cache=cache)[:, -1:]
        cache.tokens = (
            new_ids if cache.tokens is None else torch.cat([cache.tokens, new_ids], dim=1)
        )  # only the last position drafts
        if cache.ca_keys is None:
            B, hkv, hd = h.shape[0], self.config.num_key_value_heads, self.config.head_dim
            cache.ca_keys = cache.ca_values = h.new_zeros(B, hkv, 0, hd)
        ca_mask = None if cache.ca_valid is None else cache.ca_valid[None, None, None, :]  # [1, 1, 1, M]
        h = self.cross_attention(h, cos[-1:], sin[-1:], cache.ca_keys, cache.ca_values, mask=ca_mask)
        if self.config.target_layer_inference > 0:
            if cache.tli is None:
                cache.tli = DynamicCache()
            h = self._tli(h, pos[-1:][None], cache.tli)
        return self.head(h)[:, -1]  # [B, V] float32

    def new_cache(self) -> MoADrafterCache:
        return MoADrafterCache()

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
        return MoATreeState(
            **TreeState.empty_fields(batch_size, 1, self.device),
            ca_keys=empty,  # [B, Hkv, 0, hd]
            ca_values=empty,
            ca_valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device),  # [B, 0]
        )

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
        (the token at position-1; -1: none) of `target_cache`, with RoPE at position-1. Returns float32 logits
        [B, V] of the token after each row's last one (the tree root's children)."""
        state.end_tree()
        context = torch.cat(
            self._context_chunks(lambda s, e: gather_target_kv_at(target_cache, prev_slots[:, s:e]), tokens.shape[1]),
            dim=1,
        )  # [B, n, d]
        cos, sin = self.rotary_emb(positions - 1, context.dtype)  # [B, n, hd]: the context is position-1's
        k, v = self.cross_attention.context_keys_values(context, cos, sin)  # [B, Hkv, n, hd]
        state.append_context(k, v, valid & (prev_slots >= 0))
        h = self.embed(tokens)  # [B, n, d]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [B, n, hd]
        h = self.self_attention(h, cos, sin, mask=state.add_verified(valid), cache=state.layers[0])[:, -1:]
        return self._tree_logits(state, h, cos[:, -1:], sin[:, -1:])[:, -1]  # [B, V]

    @torch.no_grad()
    def tree_step(
        self, state: MoATreeState, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor
    ) -> torch.Tensor:
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`). Each node
        sees in SA the row's verified tokens, its ancestors and itself; in CA the verified context. Returns float32
        logits [B, k, V] of each node's next token."""
        h = self.embed(tokens)  # [B, k, d]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [B, k, hd]
        h = self.self_attention(h, cos, sin, mask=state.add_nodes(parents), cache=state.layers[0])
        return self._tree_logits(state, h, cos, sin)  # [B, k, V]

    def _tree_logits(self, state: MoATreeState, h, cos, sin) -> torch.Tensor:
        """CA over the verified context of each row and the head: h [B, T, d] -> float32 logits [B, T, V]."""
        mask = state.ca_valid[:, None, None, :]  # [B, 1, 1, M]
        return self.head(self.cross_attention(h, cos, sin, state.ca_keys, state.ca_values, mask=mask))


MoADrafterConfig.register_for_auto_class()
MoADrafterModel.register_for_auto_class("AutoModel")
