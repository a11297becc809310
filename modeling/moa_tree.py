"""The MoA drafter's tree drafting protocol (for the engine of custom_generate/, and the vLLM proposer): its state
`MoATreeState` (block 1's SA cache, the CA memory of the verified tokens, a sorted drafter's deeper blocks) and
`MoATreeDrafting` (the drafter's `tree`: `start`, `catch_up`, `step`, behind its `tree_start`, `tree_catch_up`,
`tree_step`), which draft the same tokens as the chain, node by node, for left-padded batches.

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch and its
sibling files.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .drafting import TreeState
from .sorted_exits import DeepBlock, MoASortedExits, PendingSlots, crop_deep
from .target_cache import gather_target_kv_at

__all__ = ["MoATreeDrafting", "MoATreeState"]


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
    latest: torch.Tensor  # [B, d] each row's newest verified context vector (`ca_latest_context`; zeros: none)
    deep: list[DeepBlock] = field(default_factory=list)  # blocks 2..K of a sorted drafter

    def append_context(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Append CA keys/values [B, Hkv, n, hd] with their validity [B, n]."""
        self.ca_keys = torch.cat([self.ca_keys, k], dim=2)  # [B, Hkv, M+n, hd]
        self.ca_values = torch.cat([self.ca_values, v], dim=2)
        self.ca_valid = torch.cat([self.ca_valid, valid], dim=1)  # [B, M+n]

    def end_tree(self) -> None:
        super().end_tree()
        crop_deep(self.deep, self.num_verified, self.num_verified)

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


class MoATreeDrafting:
    """Tree drafting for a `MoADrafterModel` (the drafter's `tree`; see `DrafterMixin` and `TreeState`). It holds no
    modules, only what it runs, read at each call: `embed(ids)` the token embedding, `rotary` the drafter's RoPE,
    `layers()` the (SA, CA) layers of blocks 1..K, `context(gather, n)` the LSA's context vectors in chunks (see
    `MoADrafterModel.context_chunks`), `head(hidden)` the float32 logits, `exits` the sorted exits."""

    def __init__(
        self,
        config,
        embed: Callable[[torch.Tensor], torch.Tensor],
        rotary: nn.Module,
        layers: Callable[[], list[tuple[nn.Module, nn.Module]]],
        context: Callable[[Callable[[int, int], torch.Tensor], int], list[torch.Tensor]],
        head: Callable[[torch.Tensor], torch.Tensor],
        exits: MoASortedExits,
    ):
        self.config = config
        self.embed, self.rotary, self.layers, self.context, self.head = embed, rotary, layers, context, head
        self.exits = exits

    def unsupported_reason(self) -> str | None:
        if self.config.target_layer_inference > 0:
            return (
                f"Tree drafting needs target_layer_inference=0 (this drafter has {self.config.target_layer_inference}"
                ": it runs the target's last layers on every drafted token, a chain). Pass it as `assistant_model` "
                "to `target.generate` instead, or use a drafter with target_layer_inference=0."
            )
        return None

    def start(self, batch_size: int, dtype: torch.dtype, device) -> MoATreeState:
        """A fresh tree drafting state for `batch_size` rows (no verified token yet)."""
        c = self.config
        empty = torch.zeros(batch_size, c.num_key_value_heads, 0, c.head_dim, dtype=dtype, device=device)
        state = MoATreeState(
            **TreeState.empty_fields(batch_size, 1, device),
            ca_keys=empty,  # [B, Hkv, 0, hd]
            ca_values=empty,
            ca_valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),  # [B, 0]
            root_exits=torch.ones(batch_size, dtype=torch.long, device=device),  # [B]
            node_exits=torch.ones(batch_size, 0, dtype=torch.long, device=device),  # [B, 0]
            latest=torch.zeros(batch_size, c.hidden_size, dtype=dtype, device=device),  # [B, d]
        )
        if c.num_blocks > 1:
            self.exits.deep_blocks(state)
        return state

    @torch.no_grad()
    def catch_up(
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
        position-1; `prev_hidden` [B, n, D]: the target's final hidden states at `prev_slots` (read by a drafter
        with `context_final_hidden` only). Returns float32 logits [B, V] of the token after each row's last one (the
        tree root's children), from the exit each row's root leaves at; the deeper blocks run on these tokens when a
        later token first needs them."""
        if self.config.context_final_hidden and prev_hidden is None:
            raise ValueError(
                "tree_catch_up of a MoA drafter with context_final_hidden=True (`needs_target_hidden`) needs "
                "`prev_hidden`: the target's final hidden states (`outputs.hidden_states[-1]`) at `prev_slots`, "
                "[B, n, D]."
            )
        hidden = prev_hidden if self.config.context_final_hidden else None
        state.end_tree()
        # a transformers cache, or a reader of another engine's cache (vLLM's paged one): slots -> [B, m, L, W]
        read = target_cache if callable(target_cache) else functools.partial(gather_target_kv_at, target_cache)
        gather = lambda s, e: read(prev_slots[:, s:e])  # noqa: E731  [B, e-s, L, W]
        context = torch.cat(self.context(gather, tokens.shape[1], target_hidden=hidden), dim=1)  # [B, n, d]
        cos, sin = self.rotary(positions - 1, context.dtype)  # [B, n, hd]: the context is position-1's
        layers = self.layers()
        self_attention, cross_attention = layers[0]
        k, v = cross_attention.context_keys_values(context, cos, sin)  # [B, Hkv, n, hd]
        read = valid & (prev_slots >= 0)  # [B, n] tokens whose previous position has a context
        state.append_context(k, v, read)
        if self.config.ca_latest_context and tokens.shape[1]:  # the newest read context of each row
            n = tokens.shape[1]
            last = n - 1 - read.flip(1).to(torch.int8).argmax(1)  # [B] the last index read (any, if none)
            newest = context[torch.arange(context.shape[0], device=context.device), last]  # [B, d]
            state.latest = torch.where(read.any(1)[:, None], newest.to(state.latest.dtype), state.latest)
        for block, (_, ca) in zip(state.deep, layers[1:]):
            block.append_context(*ca.context_keys_values(context, cos, sin))
        h = self.embed(tokens)  # [B, n, d]
        cos, sin = self.rotary(positions, h.dtype)  # [B, n, hd]
        sa_mask = state.add_verified(valid)  # [B, 1, n, V]
        if self.config.num_blocks > 1:
            h = self_attention(h, cos, sin, mask=sa_mask, cache=state.layers[0])
            n, M = tokens.shape[1], state.ca_keys.shape[2]
            own = M - n + torch.arange(n, device=h.device)  # [n] each verified token's CA slot (position-1's context)
            ca_mask = (torch.arange(M, device=h.device)[None, :] <= own[:, None])[None] & state.ca_valid[:, None, :]
            logits, exits = self.exits.tree_exits(state, PendingSlots(h, sa_mask, cos, sin, ca_mask[:, None]), m=1)
            state.root_exits = exits[:, -1]  # [B]
            return logits[:, -1]  # [B, V]
        h = self_attention(h, cos, sin, mask=sa_mask, cache=state.layers[0])[:, -1:]
        state.root_exits = torch.ones_like(tokens[:, -1])  # [B]
        return self._logits(state, h, cos[:, -1:], sin[:, -1:])[:, -1]  # [B, V]

    @torch.no_grad()
    def step(self, state: MoATreeState, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor):
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`). Each node
        sees in SA the row's verified tokens, its ancestors and itself; in CA the verified context. Returns float32
        logits [B, k, V] of each node's next token. A sorted drafter's nodes each leave at their own exit; a deeper
        block runs on the whole frontier when any node needs it (see `MoASortedExits.adaptive_exits`)."""
        h = self.embed(tokens)  # [B, k, d]
        cos, sin = self.rotary(positions, h.dtype)  # [B, k, hd]
        sa_mask = state.add_nodes(parents)  # [B, 1, k, S]
        h = self.layers()[0][0](h, cos, sin, mask=sa_mask, cache=state.layers[0])
        if self.config.num_blocks > 1:
            ca_mask = state.ca_valid[:, None, None, :].expand(-1, -1, h.shape[1], -1)  # [B, 1, k, M]
            logits, state.node_exits = self.exits.tree_exits(
                state, PendingSlots(h, sa_mask, cos, sin, ca_mask), m=h.shape[1]
            )
            return logits
        state.node_exits = torch.ones_like(tokens)  # [B, k]
        return self._logits(state, h, cos, sin)  # [B, k, V]

    def _logits(self, state: MoATreeState, h, cos, sin) -> torch.Tensor:
        """CA over the verified context of each row and the head: h [B, T, d] -> float32 logits [B, T, V]."""
        mask = state.ca_valid[:, None, None, :]  # [B, 1, 1, M]
        cross_attention = self.layers()[0][1]
        latest = state.latest[:, None] if self.config.ca_latest_context else None  # [B, 1, d]
        return self.head(cross_attention(h, cos, sin, state.ca_keys, state.ca_values, mask=mask, latest=latest))
