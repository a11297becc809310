"""How each route enters the MoA drafter's one forward (`MoADrafterModel.step`): chains (assisted generation's
drafting calls through `DrafterMixin.generate`, the serving client, `moa costs`) and trees (the engine of
custom_generate/, vLLM's proposer). Each builds its masks and keeps its `MoADraftState`; none computes anything the
forward does not. A chain is a tree of top-k 1 (tested token-equal).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import functools

import torch
from transformers import DynamicCache

from .moa_state import MoADraftState
from .target_cache import context_in_chunks, gather_target_kv_at, oldest_held_position

__all__ = ["MoADraftingRoutes"]


class MoADraftingRoutes:
    """The chain and tree entry points of `MoADrafterModel` (a base class of it: they call its `step`, `extend`,
    `read_context`, `compute_context` and session statistics)."""

    # ----------------------------------------------------------------------------------------------------------------
    # Chains: assisted generation's drafting calls (`DrafterMixin.generate`), the serving client, `moa costs`
    # -----------------------------------------------------------------------------------------------------------------
    def new_cache(self) -> MoADraftState:
        return MoADraftState.empty(self.config, 1, self.dtype, self.device)

    def _sync(self, cache: MoADraftState, num_verified: int) -> None:
        """Append memory (and the TLI cache) for target positions that are verified and not yet read."""
        att = self._attachment
        target_cache = att.tap.cache if att is not None else None
        if target_cache is None or target_cache.get_seq_length() == 0:
            return
        end = min(target_cache.get_seq_length(), num_verified)
        start = cache.context_length
        if end > start:
            held = oldest_held_position(target_cache)  # 0 unless a sliding-window layer dropped older positions
            valid = None if start >= held else torch.arange(start, end) >= held  # [T] held by every layer
            hidden = att.final_hidden(start, end) if self.config.context_final_hidden else None  # [B, T, D]
            self.extend_context(cache, self.read_context(target_cache, start, end, hidden), valid=valid)
            if self._session is not None:
                self._session.context_reads.append((start, end))
        if self.config.target_layer_inference > 0:
            last = self.config.target_num_hidden_layers
            cache.sync_tli(target_cache, range(last - self.config.target_layer_inference, last), end)

    def extend_context(self, cache: MoADraftState, context: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Append context vectors [B, T, d] of the next verified positions to a chain's memory (slot m = target
        position m).

        valid: optional bool [T], False for positions without context (older than `oldest_held_position` when they
        were read; `read_context` gives them zero vectors), which the CA then never attends to. None: all valid.
        (A client that receives context vectors from a server, see `moa_hf.serving`, calls this directly.)
        """
        B, T = context.shape[:2]
        cache.ready(self.config, B, self.dtype, context.device)
        start = cache.context_length
        positions = torch.arange(start, start + T, device=context.device)
        valid = torch.ones(T, dtype=torch.bool) if valid is None else valid
        self.extend(cache, context, positions, valid.to(context.device)[None].expand(B, T))

    def draft_step(self, new_ids: torch.Tensor, cache: MoADraftState) -> torch.Tensor:
        """One chain drafting step: feed `new_ids` [B, T] (tokens not yet in the SA cache), get the logits [B, V] for
        the next token given the memory in `cache` (a sorted drafter's from the exit each row leaves at, see
        `config.exit_thresholds`), with the exit recorded in the session's statistics."""
        cache.ready(self.config, new_ids.shape[0], self.dtype, new_ids.device)
        past, T = cache.num_verified, new_ids.shape[1]
        pos = torch.arange(past, past + T, device=new_ids.device)
        sa_mask = cache.add_slots(new_ids)  # [B, 1, T, past+T] causal (a chain's slots are all valid), None: T = 1
        M = cache.context_length
        limit = None if T == 1 and past >= M else pos.clamp(max=M)[None]  # position p reads the context of j < p
        tli = None
        if self.config.target_layer_inference > 0:
            cache.tli = DynamicCache() if cache.tli is None else cache.tli
            tli = (cache.tli, None)
        out = self.step(cache, new_ids, pos, sa_mask, limit, last=1, tli=tli)
        if out.exits is None:
            self.record_exits([new_ids.shape[0]])
        elif self._session is not None:
            self.record_exits(torch.bincount(out.exits.flatten() - 1, minlength=self.config.num_blocks).tolist())
        return out.logits[:, -1]  # [B, V] float32

    def _prepare_draft(self, input_ids: torch.Tensor, cache: MoADraftState, max_new_tokens: int, min_new_tokens: int):
        """Roll the SA cache back to the tokens it was computed from (never the last one: its output drafts), read
        the context of newly verified tokens (LSA), and draft with SA + CA per token (see `DrafterMixin.generate`).
        """
        num_verified = input_ids.shape[1]
        # the memory holds verified tokens only, which stay verified (after lookup cycles SA lags behind it)
        cache.crop_self(min(cache.common_prefix(input_ids), num_verified - 1))
        self._sync(cache, num_verified)
        pending = input_ids[:, cache.get_seq_length() :]  # [1, P] verified tokens not yet in the SA cache

        def next_logits(token: torch.Tensor | None) -> torch.Tensor:
            return self.draft_step(pending if token is None else token, cache)  # [1, V]

        return next_logits, max_new_tokens

    # ----------------------------------------------------------------------------------------------------------------
    # Trees: the engine's `TreeDrafter` protocol (custom_generate/tree.py), vLLM's proposer
    # -----------------------------------------------------------------------------------------------------------------
    def tree_unsupported_reason(self) -> str | None:
        if self.config.target_layer_inference > 0:
            return (
                f"Tree drafting needs target_layer_inference=0 (this drafter has {self.config.target_layer_inference}"
                ": its drafted tokens run the target's last layers with the target's cache by position, which a "
                "tree's slots are not). Pass it as `assistant_model` to `target.generate` instead."
            )
        return None

    def tree_start(self, batch_size: int) -> MoADraftState:
        """A fresh drafting state for `batch_size` rows of the engine's trees (no verified token yet)."""
        self._check_tree()
        return MoADraftState.empty(self.config, batch_size, dtype=self.dtype, device=self.device)

    @property
    def needs_target_hidden(self) -> bool:
        """Whether `tree_catch_up` reads `prev_hidden`, the target's final hidden states (`context_final_hidden`)."""
        return bool(self.config.context_final_hidden)

    @torch.no_grad()
    def tree_catch_up(
        self, state, tokens, positions, valid, prev_slots, target_cache, prev_hidden=None
    ) -> torch.Tensor:
        """Feed newly verified `tokens` [B, n] (right-aligned; `valid` [B, n] False on left padding; `positions`
        [B, n] real positions). Memory: the context (LSA) of the target's keys/values at `prev_slots` [B, n] (the
        token at position-1; -1: none) of `target_cache` (a transformers cache, or a function reading another
        engine's cache: slots [B, m] -> [B, m, L, 2*Hkv*hd], as `moa_hf.vllm` reads vLLM's), with RoPE at
        position-1; `prev_hidden` [B, n, D]: the target's final hidden states at `prev_slots` (read by a drafter
        with `context_final_hidden` only). Returns float32 logits [B, V] of the token after each row's last one (the
        tree root's children), from the exit each row's root leaves at."""
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
        n = tokens.shape[1]
        chunks = context_in_chunks(self.compute_context, gather, n, self.config, target_hidden=hidden)
        self.extend(state, torch.cat(chunks, dim=1), positions - 1, valid & (prev_slots >= 0))  # position-1's
        sa_mask = state.add_slots(tokens, valid)  # [B, 1, n, V]
        M = state.context_length
        limit = None if n == 1 else (M - n + 1 + torch.arange(n, device=tokens.device))[None]  # up to its own slot
        out = self.step(state, tokens, positions, sa_mask, limit, last=1)
        state.root_exits = torch.ones_like(tokens[:, -1]) if out.exits is None else out.exits[:, -1]  # [B]
        return out.logits[:, -1]  # [B, V]

    @torch.no_grad()
    def tree_step(self, state, tokens, positions, parents) -> torch.Tensor:
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`). Each node
        sees in SA the row's verified tokens, its ancestors and itself; in CA the verified context. Returns float32
        logits [B, k, V] of each node's next token (a sorted drafter's nodes each from their own exit)."""
        sa_mask = state.add_nodes(parents)  # [B, 1, k, S]
        out = self.step(state, tokens, positions, sa_mask, None, last=tokens.shape[1])
        state.node_exits = torch.ones_like(tokens) if out.exits is None else out.exits  # [B, k]
        return out.logits  # [B, k, V]
