"""How each route enters the MoA drafter's one forward (`MoADrafterModel.step`): chains (assisted generation's
drafting calls through `DrafterMixin.generate`, the serving client, `moa costs`) and trees (the engine of
custom_generate/, vLLM's proposer). Each builds its masks and keeps its `MoADraftState`; none computes anything the
forward does not. A chain is a tree of top-k 1 (tested token-equal).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import torch
import torch.nn.functional as F

from .moa_state import PLACEHOLDER, MoADraftState
from .target_cache import (
    CacheReader,
    SlotReader,
    TargetStates,
    context_in_chunks,
    oldest_held_position,
    split_target_kv,
)

__all__ = ["MoADraftingRoutes"]


class MoADraftingRoutes:
    """The chain and tree entry points of `MoADrafterModel` (a base class of it: they call its `step`,
    `read_context`, `compute_context` and session statistics), and `extend`, how every route (training too) adds
    context vectors to a state's memory."""

    def extend(self, state: MoADraftState, context, positions, valid, tli_kv=None, tli_valid=None) -> None:
        """Append context vectors [B, n, d] (read at `positions` [n] or [B, n]; `valid` [B, n], False: no context
        there) to the memory of `state`: every block's CA keys/values of them; with TLI, the target's keys/values
        of the same tokens in its last N layers (`tli_kv`: {layer: (keys, values) [B, Hkv, n, hd]}, `tli_valid`
        [B, n], None: `valid`; `MoADraftState.append_memory`)."""
        context = context.to(self.dtype)
        cos, sin = self.rotary_emb(positions, context.dtype)
        blocks_kv = [ca.context_keys_values(context, cos, sin) for _, ca in self.block_layers()]
        if tli_kv is not None and self._attachment is not None:  # in the dtype of the layers that read them
            dtype = self._attachment.tli_dtype
            tli_kv = {i: (k.to(dtype), v.to(dtype)) for i, (k, v) in tli_kv.items()}
        state.append_memory(blocks_kv, valid, context, tli_kv, tli_valid)

    @property
    def tli_layer_ids(self) -> range:
        """The target's layers Target Layer Inference runs: its last N (empty for N = 0)."""
        L = self.config.target_num_hidden_layers
        return range(L - self.config.target_layer_inference, L)

    def tli_reader(self, read):
        """`read` (a route's reader of `TargetStates`), keeping the keys/values of the TLI layers it reads: returns
        (the reader, `kept()` -> {layer: (keys, values) [B, Hkv, n, hd]} of every token read, in order; None
        without TLI)."""
        parts = []

        def reading(start: int, end: int) -> TargetStates:
            states = read(start, end)
            if self.tli_layer_ids:
                parts.append(states.kv[:, :, self.tli_layer_ids.start :])  # [B, m, N, W]
            return states

        def kept() -> dict | None:
            if not parts:
                return None
            kv, H = torch.cat(parts, dim=1), self.config.target_num_key_value_heads  # [B, n, N, W]
            return {layer: split_target_kv(kv, i, H) for i, layer in enumerate(self.tli_layer_ids)}

        return reading, kept

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
            # the reader of assisted generation: the target's cache and the hook on its decoder (`FeatureTap`)
            reader = CacheReader(target_cache, att.final_hidden if self.config.context_final_hidden else None)
            layers = target_cache.layers  # TLI: the target's own keys/values there (its last N layers hold them all)
            tli_kv = {
                i: (layers[i].keys[:, :, start:end], layers[i].values[:, :, start:end]) for i in self.tli_layer_ids
            }
            self.extend_context(cache, self.read_context(reader, start, end), valid=valid, tli_kv=tli_kv or None)
            if self._session is not None:
                self._session.context_reads.append((start, end))

    def extend_context(self, cache: MoADraftState, context: torch.Tensor, valid=None, tli_kv=None) -> None:
        """Append context vectors [B, T, d] of the next verified positions to a chain's memory (slot m = target
        position m).

        valid: optional bool [T], False for positions without context (older than `oldest_held_position` when they
        were read; `read_context` gives them zero vectors), which the CA then never attends to. None: all valid.
        tli_kv: with Target Layer Inference, {target layer: (keys, values) [B, Hkv, T, hd]} of the same positions,
        as its cache holds them (all valid).
        (A client that receives context vectors from a server, see `moa_hf.serving`, calls this directly.)
        """
        B, T = context.shape[:2]
        cache.ready(self.config, B, self.dtype, context.device)
        start = cache.context_length
        positions = torch.arange(start, start + T, device=context.device)
        valid = torch.ones(T, dtype=torch.bool) if valid is None else valid
        everywhere = None if tli_kv is None else torch.ones(B, T, dtype=torch.bool, device=context.device)
        self.extend(cache, context, positions, valid.to(context.device)[None].expand(B, T), tli_kv, everywhere)

    def draft_step(self, new_ids: torch.Tensor, cache: MoADraftState) -> torch.Tensor:
        """One chain drafting step: feed `new_ids` [B, T] (tokens not yet in the SA cache), get the logits [B, V] for
        the next token given the memory in `cache` (a sorted drafter's from the exit each row leaves at, see
        `config.exit_thresholds`), with the exit recorded in the session's statistics."""
        cache.ready(self.config, new_ids.shape[0], self.dtype, new_ids.device)
        if self.config.block_size > 1:
            return self.block_step(new_ids, cache)
        past, T = cache.num_verified, new_ids.shape[1]
        pos = torch.arange(past, past + T, device=new_ids.device)
        sa_mask = cache.add_slots(new_ids)  # [B, 1, T, past+T] causal (a chain's slots are all valid), None: T = 1
        M = cache.context_length
        limit = None if T == 1 and past >= M else pos.clamp(max=M)[None]  # position p reads the context of j < p
        out = self.step(cache, new_ids, pos, sa_mask, limit, last=1)
        if out.exits is None:
            self.record_exits([new_ids.shape[0]])
        elif self._session is not None:
            self.record_exits(torch.bincount(out.exits.flatten() - 1, minlength=self.config.num_blocks).tolist())
        return out.logits[:, -1]  # [B, V] float32

    def block_step(self, new_ids: torch.Tensor, cache: MoADraftState) -> torch.Tensor:
        """A block drafter's chain step (`draft_step`): the next row of the current block's logits when the token
        after `new_ids` lies in it, else one forward over [every token not yet in the SA cache, k-1 placeholders]
        (`block_forward`) whose first row it returns and whose other k-1 rows wait for the next steps."""
        past = cache.num_verified + sum(t.shape[1] for t in cache.block_fed)  # the first position of new_ids
        positions = torch.full_like(new_ids[:, -1:], past + new_ids.shape[1] - 1)  # [B, 1] the last one's
        row = cache.block_row(positions)  # [B, 1, V] or None
        if row is not None:  # a drafted token: the block already holds the logits after it
            cache.block_fed.append(new_ids)
            self.record_exits([new_ids.shape[0]])
            bias = self.markov_bias(new_ids[:, -1])  # [B, V] from the token just drafted, or None
            return row[:, 0] if bias is None else row[:, 0] + bias
        fed, cache.block_fed = cache.block_fed, []
        tokens = torch.cat([*fed, new_ids], dim=1)  # [B, T] every token not yet in the SA cache
        M = cache.context_length
        pos = torch.arange(cache.num_verified, cache.num_verified + tokens.shape[1], device=tokens.device)
        logits = self.block_forward(cache, tokens, cache.add_slots(tokens), pos.clamp(max=M)[None], pos[None])
        self.record_exits([new_ids.shape[0]])
        return logits[:, 0]  # [B, V]

    def markov_bias(self, previous: torch.Tensor, full: bool = True) -> torch.Tensor | None:
        """A block slot's logit bias from the token drafted before it (`block_markov_rank`): ids [...] -> float32
        [..., V] (`full`: 0 outside the draft vocabulary) or [..., V'] over it; None without a Markov head."""
        if not self.config.block_markov_rank:
            return None
        bias = self.markov_out(self.markov_in(previous).to(self.markov_out.weight.dtype)).float()  # [..., V']
        if not full:
            return bias
        return bias.new_zeros((*bias.shape[:-1], self.config.vocab_size)).index_copy_(-1, self.draft_ids, bias)

    def block_forward(self, state, tokens, sa_mask, limit, positions) -> torch.Tensor:
        """One block drafter forward: `tokens` [B, T] (new verified slots, already added to `state` with their SA
        mask `sa_mask` [B, 1, T, V] or None: every slot; `limit` [B or 1, T] their memory limits, `positions`
        [B or 1, T]) followed by k-1 placeholder slots (tree nodes, each the child of the one before, reading every
        verified token and context). Returns the float32 logits [B, k, V] of the last token and the placeholders
        (the token 1..k after the last one) and keeps the placeholders' in `state` (`block_row`); the placeholder
        slots are dropped again."""
        B, T, k = tokens.shape[0], tokens.shape[1], self.config.block_size
        device = tokens.device
        if sa_mask is None:
            sa_mask = torch.ones(B, 1, T, state.num_verified, dtype=torch.bool, device=device)
        chain = torch.ones(k - 1, k - 1, dtype=torch.bool, device=device).tril().expand(B, -1, -1)  # [B, k-1, k-1]
        state.ancestors = chain  # the placeholders are tree nodes, each the child of the one before (none before)
        nodes_mask = torch.cat([state.valid[:, None, :].expand(-1, k - 1, -1), chain], dim=-1)[:, None]
        sa_mask = torch.cat([F.pad(sa_mask, (0, k - 1)), nodes_mask], dim=2)  # [B, 1, T + k-1, V + k-1]
        last = positions[:, -1:]  # [B or 1, 1]
        slots = (last + torch.arange(1, k, device=device)).expand(B, -1)  # [B, k-1] the placeholders' positions
        M = state.context_length
        limit = torch.cat([limit.expand(B, -1), torch.full_like(slots, M)], dim=1)  # [B, T + k-1]
        ids = torch.cat([tokens, torch.full_like(slots, PLACEHOLDER)], dim=1)  # [B, T + k-1]
        out = self.step(state, ids, torch.cat([positions.expand(B, -1), slots], dim=1), sa_mask, limit, last=k)
        state.end_tree()  # the placeholders' keys are not needed again: drafted tokens are fed as verified ones
        state.block_logits, state.block_root, state.block_fed = out.logits[:, 1:], last[:, 0].expand(B), []
        return out.logits  # [B, k, V]

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
    def tree_start(self, batch_size: int) -> MoADraftState:
        """A fresh drafting state for `batch_size` rows of the engine's trees (no verified token yet)."""
        self._check_tree()
        return MoADraftState.empty(self.config, batch_size, dtype=self.dtype, device=self.device)

    @property
    def draft_depth_limit(self) -> int | None:
        """The deepest tree node (or longest chain) `tree_step` can draft: a block drafter's `block_size` (its one
        forward per cycle drafts that many), None: no limit."""
        return self.config.block_size if self.config.block_size > 1 else None

    @property
    def needs_target_hidden(self) -> bool:
        """Whether `tree_catch_up` reads `prev_hidden`, the target's final hidden states (`context_final_hidden`)."""
        return bool(self.config.context_final_hidden)

    @torch.no_grad()
    def tree_settle(self, state: MoADraftState) -> None:
        """Run a sorted drafter's deeper blocks on the slots they skipped, before its slots are re-laid."""
        self.sorted_exits.settle(state.deep)

    @torch.no_grad()
    def tree_catch_up(
        self, state, tokens, positions, valid, prev_slots, target_cache, prev_hidden=None
    ) -> torch.Tensor:
        """Feed newly verified `tokens` [B, n] (right-aligned; `valid` [B, n] False on left padding; `positions`
        [B, n] real positions). Memory: the context (LSA) of the target's states at `prev_slots` [B, n] (the token
        at position-1; -1: none), read by a `SlotReader`: keys/values of `target_cache` (a transformers cache, or a
        function reading another engine's cache: slots [B, m] -> [B, m, L, 2*Hkv*hd], as `moa_hf.vllm` reads
        vLLM's), with RoPE at position-1; `prev_hidden` [B, n, D]: the target's final hidden states at `prev_slots`
        (read by a drafter with `context_final_hidden` only). With TLI, the same read gives the TLI memory (the
        target's last N layers' keys/values there). Returns float32 logits [B, V] of the token after each row's last
        one (the tree root's children), from the exit each row's root leaves at."""
        if self.config.context_final_hidden and prev_hidden is None:
            raise ValueError(
                "tree_catch_up of a MoA drafter with context_final_hidden=True (`needs_target_hidden`) needs "
                "`prev_hidden`: the target's final hidden states (`outputs.hidden_states[-1]`) at `prev_slots`, "
                "[B, n, D]."
            )
        state.end_tree()
        read = SlotReader(target_cache, prev_slots, prev_hidden if self.config.context_final_hidden else None)
        read, tli_kv = self.tli_reader(read)  # TLI: the same tokens' keys/values in the target's last N layers
        n = tokens.shape[1]
        chunks = context_in_chunks(self.compute_context, read, n, self.config)
        self.extend(state, torch.cat(chunks, dim=1), positions - 1, valid & (prev_slots >= 0), tli_kv())  # p-1's
        sa_mask = state.add_slots(tokens, valid)  # [B, 1, n, V]
        M = state.context_length
        limit = None if n == 1 else (M - n + 1 + torch.arange(n, device=tokens.device))[None]  # up to its own slot
        if self.config.block_size > 1:  # one forward drafts the whole block; `tree_step` reads it
            limit = (M - n + 1 + torch.arange(n, device=tokens.device))[None]
            return self.block_forward(state, tokens, sa_mask, limit, positions)[:, 0]
        out = self.step(state, tokens, positions, sa_mask, limit, last=1)
        state.tli_root = 1 if state.tli is not None else 0  # the root's TLI keys/values stay for every tree step
        state.root_exits = torch.ones_like(tokens[:, -1]) if out.exits is None else out.exits[:, -1]  # [B]
        return out.logits[:, -1]  # [B, V]

    @torch.no_grad()
    def tree_step(self, state, tokens, positions, parents) -> torch.Tensor:
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`). Each node
        sees in SA the row's verified tokens, its ancestors and itself; in CA the verified context; with TLI the TLI
        memory, the root's and its ancestors' positions and itself. Returns float32 logits [B, k, V] of each node's
        next token (a sorted drafter's nodes each from their own exit)."""
        block = state.block_row(positions)  # a block drafter's logits after these positions: no forward
        if block is not None:
            state.node_exits = torch.ones_like(tokens)  # [B, k]
            bias = self.markov_bias(tokens)  # [B, k, V] from each node's own token, or None
            return block if bias is None else block + bias
        if self.config.block_size > 1:
            raise ValueError(
                f"This block drafter drafts {self.config.block_size} tokens per forward and tree nodes at depths 1.."
                f"{self.config.block_size} only (`draft_depth_limit`); cap the tree's depth there."
            )
        sa_mask = state.add_nodes(parents)  # [B, 1, k, V+K+k]
        tli = None  # TLI: the drafted positions are the root's, then the nodes' (ancestors and itself)
        if state.tli is not None:
            root = sa_mask.new_ones(*sa_mask.shape[:3], state.tli_root)  # [B, 1, k, 1]
            tli = torch.cat([root, sa_mask[..., state.num_verified :]], dim=-1)  # [B, 1, k, 1+K+k]
        out = self.step(state, tokens, positions, sa_mask, None, last=tokens.shape[1], tli=tli)
        state.node_exits = torch.ones_like(tokens) if out.exits is None else out.exits  # [B, k]
        return out.logits  # [B, k, V]
