"""The MoA drafter's building blocks (`MoADrafterModel` in modeling_moa.py assembles them): RMSNorm in float32, plain
RoPE, the gated MLP, grouped-query attention whose queries and keys/values may come from different streams, the
pre-norm decoder layer (SA, and the LSA across the target's layers), the CA layer over the verified context, and the
deeper blocks of a sorted drafter (`MoABlock`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import rotate_half

from .configuration_moa import MoADrafterConfig
from .target_parts import MoALinear

__all__ = [
    "MoAAttention",
    "MoABlock",
    "MoACrossAttentionLayer",
    "MoADecoderLayer",
    "MoAMLP",
    "MoARMSNorm",
    "MoARotaryEmbedding",
]


class MoARMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # norms in fp32, the weight too; one rounding back to the input's dtype
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)  # x * x: the same values, a cheaper backward
        return (self.weight.float() * x).to(dtype)


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
        self.gate_proj = MoALinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = MoALinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = MoALinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoAAttention(nn.Module):
    """Grouped-query attention whose queries and keys/values may come from different streams (self or cross)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, short: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # short: many independent sequences of a few keys, no mask (the LSA: one sequence per token over the target's
        # layers), where explicit matmuls beat SDPA's fused CPU kernel (its backward by ~6x at 2k x 30 positions)
        self.short = short
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

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        # q [B, H, Tq, hd], k/v [B, Hkv, Tk, hd], mask bool [B or 1, 1, Tq, Tk] (True = visible) or None (all visible);
        # causal (with mask None, Tq == Tk): query i sees keys j <= i, no mask built (SDPA's causal kernels)
        gqa = self.num_heads != self.num_kv_heads
        if causal:
            if mask is not None or q.shape[2] != k.shape[2]:
                raise ValueError("causal attention takes no mask and as many queries as keys")
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif self.short and mask is None:
            y = _explicit_attention(q, k, v)
        elif q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            # one drafted token on a CPU: half-precision SDPA is several times slower there than float32 (one query,
            # 300 keys: 168 vs 50 us with the casts), and float32 is the more exact of the two
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
            y = y.to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        B, H, T, hd = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))  # [B, T, H*hd] -> [B, T, d]


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention as matmuls, softmax in float32: q [N, H, Tq, hd], k/v [N, Hkv, Tk, hd] -> [N, H, Tq, hd]."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves H/Hkv query heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [N, H, Tq, Tk]
    return scores.softmax(-1).to(v.dtype) @ v


class MoADecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer (attention + gated MLP). Used for SA (causal) and LSA (across target layers).
    Recomputed in the backward after `drafter.activation_checkpointing_enable()` (training only). `cache`: where the
    keys/values of earlier positions are (anything with `append_self(k, v)`: `LayerKV`)."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, eps, act, short=False):
        super().__init__()
        self.input_layernorm = MoARMSNorm(hidden_size, eps)
        self.self_attn = MoAAttention(hidden_size, num_heads, num_kv_heads, head_dim, short=short)
        self.post_attention_layernorm = MoARMSNorm(hidden_size, eps)
        self.mlp = MoAMLP(hidden_size, intermediate_size, act)

    @classmethod
    def from_config(cls, c) -> "MoADecoderLayer":
        """The drafter's SA layer (or an EAGLE-style decoder layer) of a drafter config's sizes."""
        return cls(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            c.hidden_act,
        )

    def forward(self, h, cos, sin, mask=None, cache=None, causal=False):
        x = self.input_layernorm(h)
        q = self.self_attn.queries(x, cos, sin)
        k, v = self.self_attn.keys_values(x, cos, sin)
        if cache is not None:
            k, v = cache.append_self(k, v)
        h = h + self.self_attn.attend(q, k, v, mask, causal=causal)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoACrossAttentionLayer(GradientCheckpointingLayer):
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
        if getattr(config, "ca_latest_context", False):  # the newest verified context, added to the input
            self.latest_proj = nn.Linear(d, d, bias=False)

    def context_keys_values(self, context, cos, sin):
        return self.attn.keys_values(self.input_layernorm(context), cos, sin)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask=None, latest=None):
        # h [B, T, d]; ctx_k/ctx_v [B, Hkv, M, hd]; mask bool [B, 1, T, M] or None (all M visible); latest [B, T or 1,
        # d]: the newest context vector each position may read (`ca_latest_context`), or None
        B, T, _ = h.shape
        if latest is not None:
            h = h + self.latest_proj(latest.to(h.dtype))  # [B, T, d]
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
        self.self_attention = MoADecoderLayer.from_config(c)
        self.cross_attention = MoACrossAttentionLayer(c)
        for linear in (
            self.self_attention.self_attn.o_proj,
            self.self_attention.mlp.down_proj,
            self.cross_attention.attn.o_proj,
            self.cross_attention.mlp.down_proj,
        ):
            linear.zero_init = True
