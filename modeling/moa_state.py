"""What a MoA drafter keeps between forwards: `MoADraftState`, one state for every route (training's parallel forward,
assisted generation's chains, the engine's and vLLM's trees, the serving client), and the masks each route builds
for the drafter's one forward (`MoADrafterModel.step`).

Terms, defined once:
- **slot**: one entry of the SA keys/values (per row, in order). Verified slots come first (`valid` [B, V] says which
  hold a real token: left padding does not); tree nodes follow while a tree is drafted (`ancestors`), and `end_tree`
  drops them. A chain (assisted generation, the client) appends its drafted tokens as slots and `truncate`s the
  rejected ones.
- **memory**: the CA keys/values of context vectors (the LSA's output for verified tokens), [B, Hkv, M, hd], with
  `ca_valid` [B, M] (False: no context there) and, for `ca_latest_context`, the vectors themselves (`contexts`
  [B, M, d]). A chain's memory slot m holds target position m; a tree's is aligned with its SA slot (the context of
  the token before that slot's token: catch-up reads it at `prev_slots`). Either way the forward only sees a mask.
- **cycle start**: a query reads the context of verified tokens only: memory slots its CA mask shows.
- **TLI memory** (Target Layer Inference, N > 0): per target layer the drafter runs (its last N), the target's own
  keys/values of the tokens whose contexts the memory holds (`tli` [B, Hkv, M, hd] per layer, `tli_valid` [B, M]),
  then the drafter's own keys/values of the positions it drafted since (the target has none for them yet): a tree's
  root first (`tli_root` of them, kept until the next catch-up), then the nodes, which `end_tree` drops. A query
  reads the TLI memory its CA mask's limit allows, and the drafted positions its route shows it (`step`'s `tli`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .drafting import LayerKV, RollbackCache, TreeState
from .sorted_exits import DeepBlock, crop_deep

__all__ = ["PLACEHOLDER", "MoADraftState", "block_layout", "memory_mask", "newest_context"]

PLACEHOLDER = -1  # the token id of a block drafter's placeholder slot (`block_size` > 1): its learned embedding


def memory_mask(valid: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    """The CA mask of queries that read the memory slots m < `limit` [B or 1, T] holding a context (`valid` [B, M]):
    bool [B, T, M]; `limit` None: every slot (a drafted token reads all verified context)."""
    if limit is None:
        return valid[:, None, :]  # [B, 1, M]
    return (torch.arange(valid.shape[1], device=valid.device) < limit[..., None]) & valid[:, None, :]  # [B, T, M]


def newest_context(contexts: torch.Tensor, valid: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor:
    """The context vector of the newest memory slot each query may read (`ca_latest_context`: the newest valid slot
    m < limit): contexts [B, M, d], valid [B, M], limit [B or 1, T] (None: M) -> [B, T, d] (zeros: none)."""
    B, M, d = contexts.shape
    if limit is None:
        limit = torch.full((1, 1), M, dtype=torch.long, device=valid.device)
    if M == 0:
        return contexts.new_zeros(B, limit.shape[-1], d)
    held = torch.where(valid, torch.arange(M, device=valid.device), -1).cummax(dim=1).values  # [B, M] newest <= m
    newest = held.gather(1, (limit - 1).clamp(0, M - 1).expand(B, -1))  # [B, T]
    newest = torch.where(limit.expand(B, -1) > 0, newest, -1)  # [B, T] -1: none
    picked = contexts.gather(1, newest.clamp(min=0)[..., None].expand(-1, -1, d))  # [B, T, d]
    return picked * (newest >= 0)[..., None].to(picked.dtype)


def block_layout(input_ids, cycle_starts, sa_mask, anchors, config):
    """Training's layout of a block drafter's blocks: after the sequence `input_ids` [B, T] (SA mask `sa_mask`
    [B or 1, 1, T, T], memory limits `cycle_starts` [B, T]) come k-1 placeholder slots per anchor of `anchors`
    [B, A] (-1: none), as at inference: the slot j of the block at anchor s stands at position s+j, sees the tokens
    <= s and the slots 1..j of its block, reads the context of positions < s, and its output predicts token s+j+1.
    Returns (tokens, positions, SA mask, memory limits), each over T' = T + A*(k-1) slots, [B, T'] and
    [B, 1, T', T']."""
    B, T = input_ids.shape
    A, k, device = anchors.shape[1], config.block_size, input_ids.device
    offset = torch.arange(1, k, device=device).repeat(A)  # [S] each slot's j, S = A*(k-1)
    block = torch.arange(A, device=device).repeat_interleave(k - 1)  # [S] each slot's block
    anchor = anchors[:, block]  # [B, S]
    positions = torch.cat([torch.arange(T, device=device).expand(B, T), anchor.clamp(min=0) + offset], dim=1)
    sees_tokens = torch.arange(T, device=device)[None, None, :] <= anchor[:, :, None]  # [B, S, T] (none: -1)
    sees_slots = (block[:, None] == block[None, :]) & (offset[None, :] <= offset[:, None])  # [S, S]
    S = block.shape[0]
    rows = torch.cat([sees_tokens, sees_slots.expand(B, S, S)], dim=-1)  # [B, S, T+S]
    first = torch.cat([sa_mask.expand(B, 1, T, T), sa_mask.new_zeros(B, 1, T, S)], dim=-1)  # [B, 1, T, T+S]
    mask = torch.cat([first, rows[:, None]], dim=2)  # [B, 1, T+S, T+S]
    tokens = torch.cat([input_ids, torch.full_like(anchor, PLACEHOLDER)], dim=1)  # [B, T+S]
    limit = torch.cat([cycle_starts, anchor.clamp(min=0)], dim=1)  # [B, T+S]: context of positions < s
    return tokens, positions, mask, limit


@dataclass
class MoADraftState(TreeState, RollbackCache):
    """The drafting state of a MoA drafter for B rows (see the module docstring for slots and memory).

    `TreeState` gives the slots' validity, the tree nodes' ancestors, block 1's SA keys/values (`layers[0]`) and the
    row operations (`select_rows`, `map_slots`, `compact`, `concat_rows`); `RollbackCache` transformers' `crop`.
    `tokens` [B, S]: the token of each verified slot (a chain's `common_prefix`). `deep`: blocks 2..K of a sorted
    drafter (their own SA keys/values, memory and pending slots). `tli` / `tli_valid`: the TLI memory (module
    docstring), a transformers cache whose layers are the target's (the last N are set). `root_exits` [B] /
    `node_exits` [B, k]: the exit each of the latest forward's outputs left at.
    """

    layers: list[LayerKV] = None  # (the `TreeState` fields, None until `ready`: `MoADrafterCache()` takes no size)
    valid: torch.Tensor = None
    ancestors: torch.Tensor = None
    ca_keys: torch.Tensor = None
    ca_values: torch.Tensor = None
    ca_valid: torch.Tensor = None
    contexts: torch.Tensor = None
    latest: torch.Tensor = None  # [B, d] each row's newest valid context vector (zeros: none yet)
    tokens: torch.Tensor = None
    root_exits: torch.Tensor = None
    node_exits: torch.Tensor = None
    deep: list[DeepBlock] = field(default_factory=list)
    tli: DynamicCache | None = None
    tli_valid: torch.Tensor | None = None  # [B, M] TLI memory slots holding the target's keys/values
    tli_root: int = 0  # drafted TLI positions of verified slots (a tree's root), which `end_tree` keeps
    block_logits: torch.Tensor | None = None  # [B, k-1, V] a block's placeholder slots' logits, not yet drafted
    block_root: torch.Tensor | None = None  # [B] the position of the block's first slot (the last verified token)
    block_fed: list = field(default_factory=list)  # [B, 1] tokens drafted from the block, not yet in the SA cache

    @classmethod
    def empty(cls, config, batch_size: int = 1, dtype=torch.float32, device="cpu") -> "MoADraftState":
        """A state without any slot or memory, for `batch_size` rows of a drafter of `config`."""
        c = config
        kv = torch.zeros(batch_size, c.num_key_value_heads, 0, c.head_dim, dtype=dtype, device=device)
        width = c.hidden_size if c.ca_latest_context else 0  # context vectors are kept for `ca_latest_context` only
        tli = c.target_layer_inference > 0
        return cls(
            **TreeState.empty_fields(batch_size, 1, device),
            ca_keys=kv,  # [B, Hkv, 0, hd]
            ca_values=kv,
            ca_valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),  # [B, 0]
            contexts=torch.zeros(batch_size, 0, width, dtype=dtype, device=device),  # [B, 0, d or 0]
            latest=torch.zeros(batch_size, c.hidden_size, dtype=dtype, device=device),  # [B, d]
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),  # [B, 0]
            root_exits=torch.ones(batch_size, dtype=torch.long, device=device),  # [B]
            node_exits=torch.ones(batch_size, 0, dtype=torch.long, device=device),  # [B, 0]
            deep=[DeepBlock() for _ in range(c.num_blocks - 1)],
            tli=DynamicCache() if tli else None,
            tli_valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device) if tli else None,  # [B, 0]
        )

    def ready(self, config, batch_size: int, dtype, device) -> "MoADraftState":
        """Size a state built without arguments (`MoADrafterCache()`) at its first use; a sized one stays as it is."""
        if self.valid is None:
            empty = MoADraftState.empty(config, batch_size, dtype, device)
            for f in dataclasses.fields(self):
                setattr(self, f.name, getattr(empty, f.name))
        return self

    # ----------------------------------------------------------------------------------------------------------------
    # Lengths (transformers reads `get_seq_length` of an assistant's cache)
    # -----------------------------------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.valid is None else self.num_verified

    @property
    def context_length(self) -> int:
        """M: memory slots (a chain's: target positions whose context was read)."""
        return 0 if self.ca_keys is None else self.ca_keys.shape[2]

    @property
    def tli_layers(self) -> list:
        """The layers of the TLI memory that hold keys/values (transformers' `DynamicLayer`s)."""
        return [layer for layer in self.tli.layers if layer.is_initialized] if self.tli is not None else []

    # ----------------------------------------------------------------------------------------------------------------
    # Appending
    # -----------------------------------------------------------------------------------------------------------------
    def add_slots(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """Record n new verified slots holding `tokens` [B, n] (`valid` [B, n], None: all); returns the bool SA mask
        [B, 1, n, V+n] of their queries (`TreeState.add_verified`), or None for one valid token of a state without
        tree nodes (it sees every slot: a chain's drafting step builds no mask)."""
        self.tokens = torch.cat([self.tokens, tokens], dim=1)  # [B, V+n]
        if valid is None and tokens.shape[1] == 1 and not self.num_nodes and bool(self.valid.all()):
            self.valid = torch.cat([self.valid, self.valid.new_ones(tokens.shape)], dim=1)  # [B, V+1]
            return None
        return self.add_verified(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)

    def append_memory(
        self, blocks_kv: list, valid: torch.Tensor, context: torch.Tensor, tli_kv: dict | None = None, tli_valid=None
    ) -> None:
        """Append n memory slots: each block's CA keys/values [B, Hkv, n, hd] of the context vectors `context`
        [B, n, d], valid [B, n] (False: no context there); with TLI, `tli_kv` {target layer: (keys, values)
        [B, Hkv, n, hd]} of the same tokens, `tli_valid` [B, n] (None: `valid`)."""
        self.clear_block()  # a block drafted before this context came is stale
        if self.tli is not None:
            if tli_kv is None:
                raise ValueError(
                    "This drafter runs the target's last layers (target_layer_inference > 0): its memory needs their "
                    "keys/values of the same tokens as the contexts (`tli_kv`)."
                )
            self.end_tli_draft(keep=0)
            for idx, (k, v) in tli_kv.items():
                self.tli.update(k, v, idx)
            self.tli_valid = torch.cat([self.tli_valid, valid if tli_valid is None else tli_valid], dim=1)
        k, v = blocks_kv[0]
        self.ca_keys = torch.cat([self.ca_keys, k], dim=2)  # [B, Hkv, M+n, hd]
        self.ca_values = torch.cat([self.ca_values, v], dim=2)
        self.ca_valid = torch.cat([self.ca_valid, valid], dim=1)  # [B, M+n]
        kept = context[..., : self.contexts.shape[-1]].to(self.contexts.dtype)  # [B, n, d or 0]: `ca_latest_context`
        self.contexts = torch.cat([self.contexts, kept], dim=1)  # [B, M+n, d or 0]
        if context.shape[1]:  # each row's newest valid context vector
            last = context.shape[1] - 1 - valid.flip(1).to(torch.int8).argmax(1)  # [B] the last valid index
            newest = context[torch.arange(context.shape[0], device=context.device), last]  # [B, d]
            self.latest = torch.where(valid.any(1)[:, None], newest.to(self.latest.dtype), self.latest)
        for block, (k, v) in zip(self.deep, blocks_kv[1:]):
            block.append_context(k, v)

    # ----------------------------------------------------------------------------------------------------------------
    # Rolling back, rows, re-laying
    # -----------------------------------------------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """A chain's rollback: keep slots < `length` (0 empties the state) and memory slots < `length` (a chain's
        memory slot m is target position m, verified for good unless the whole sequence is rolled back)."""
        if self.valid is None:
            return
        self.crop_self(length)
        if self.context_length > length:
            self.ca_keys, self.ca_values = self.ca_keys[:, :, :length], self.ca_values[:, :, :length]
            self.ca_valid, self.contexts = self.ca_valid[:, :length], self.contexts[:, :length]
            for block in self.deep:
                block.ca_keys, block.ca_values = block.ca_keys[:, :, :length], block.ca_values[:, :, :length]
            if self.contexts.shape[-1]:
                self.latest = newest_context(self.contexts, self.ca_valid, None)[:, 0].to(self.latest.dtype)
        if self.tli_valid is not None and self.tli_valid.shape[1] > length:
            self.tli_valid = self.tli_valid[:, :length]
            self.end_tli_draft(keep=0)

    def crop_self(self, length: int) -> None:
        """Keep slots < `length` only; the memory (verified context) stays."""
        if self.valid is None:
            return
        self.clear_block()
        self.end_tree()
        self.end_tli_draft(keep=0)  # a chain's drafted positions, the first one's too
        self.layers[0].crop(length)
        self.valid, self.tokens = self.valid[:, :length], self.tokens[:, :length]
        crop_deep(self.deep, self.num_verified, length)

    def clear_block(self) -> None:
        """Forget a block's undrafted logits and the tokens drafted from it (a new drafting call starts)."""
        self.block_logits, self.block_fed = None, []

    def block_row(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The block's logits for the token after `positions` [B, w] (each within the block: 1 <= position - root
        <= k-1): [B, w, V]; None when there is no block or a position lies beyond it."""
        if self.block_logits is None:
            return None
        offset = positions - self.block_root[:, None] - 1  # [B, w] the placeholder slot's index
        if bool((offset < 0).any()) or bool((offset >= self.block_logits.shape[1]).any()):
            return None
        V = self.block_logits.shape[-1]
        return self.block_logits.gather(1, offset[..., None].expand(-1, -1, V))  # [B, w, V]

    def end_tree(self) -> None:
        super().end_tree()
        crop_deep(self.deep, self.num_verified, self.num_verified)
        self.end_tli_draft(keep=self.tli_root)

    def end_tli_draft(self, keep: int) -> None:
        """Drop the drafter's own TLI keys/values (of drafted positions) but the first `keep`."""
        self.tli_root = min(self.tli_root, keep)
        M = 0 if self.tli_valid is None else self.tli_valid.shape[1]
        for layer in self.tli_layers:
            layer.keys, layer.values = layer.keys[:, :, : M + keep], layer.values[:, :, : M + keep]

    def map_slots(self, fn) -> None:
        """`TreeState.map_slots` for a tree's slot-aligned memory (M == V) as well: the CA's and TLI's (a drafted
        TLI position, the root's, stays as it is), and a sorted drafter's deeper blocks once they ran every slot
        (`MoADrafterModel.tree_settle`)."""
        if not self.num_nodes and any(block.pending for block in self.deep):  # (tree nodes: `TreeState`'s error)
            raise ValueError(
                "The deeper blocks of this sorted drafter's state have slots they did not run yet: call "
                "`drafter.tree_settle(state)` before re-laying its slots (`tree_compact`, `tree_concat_rows` do)."
            )
        super().map_slots(fn)
        self.tokens = fn(self.tokens, 1)
        self.ca_keys, self.ca_values, self.ca_valid = fn(self.ca_keys, 2), fn(self.ca_values, 2), fn(self.ca_valid, 1)
        self.contexts = fn(self.contexts, 1)
        for block in self.deep:
            if block.kv.keys is not None:
                block.kv.keys, block.kv.values = fn(block.kv.keys, 2), fn(block.kv.values, 2)
                block.ca_keys, block.ca_values = fn(block.ca_keys, 2), fn(block.ca_values, 2)
        if self.tli is not None:
            M = self.tli_valid.shape[1]
            for layer in self.tli_layers:  # [memory M | drafted]: the memory re-laid
                layer.keys = torch.cat([fn(layer.keys[:, :, :M], 2), layer.keys[:, :, M:]], dim=2)
                layer.values = torch.cat([fn(layer.values[:, :, :M], 2), layer.values[:, :, M:]], dim=2)
            self.tli_valid = fn(self.tli_valid, 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        rows = rows.to(self.valid.device)
        for block in self.deep:
            block.kv.select_rows(rows)
            if block.ca_keys is not None:
                block.ca_keys, block.ca_values = block.ca_keys[rows], block.ca_values[rows]
            block.pending = [p.rows(rows) for p in block.pending]
        for layer in self.tli_layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]

    @classmethod
    def concat_rows(cls, states: list["MoADraftState"]) -> "MoADraftState":
        if any(block.pending for s in states for block in s.deep):
            raise ValueError("Settle the deeper blocks first: `drafter.tree_concat_rows(states)` does.")
        for s in states:
            s.node_exits = s.node_exits[:, :0]  # [B, 0]: the exits of the last tree step are not carried over
            if any(other.block_logits is None for other in states):
                s.clear_block()
        return super().concat_rows(states)

    @staticmethod
    def _concat_field(name: str, values: list):
        if name == "deep":  # settled blocks: each holds every slot
            return [DeepBlock.concat(blocks) for blocks in zip(*values)]
        if name in ("tli", "tli_valid") and values[0] is None:
            return None
        if name == "tli_root":  # the same for every state caught up on its rows
            if len(set(values)) > 1:
                raise ValueError("Cannot join drafting states with and without a tree root's TLI keys/values.")
            return values[0]
        if name == "tli":
            return _concat_caches(values)
        if name in ("block_logits", "block_root"):  # absent in every state, or tensors (`TreeState` joins those)
            return None
        if name == "block_fed":
            return []
        return TreeState._concat_field(name, values)


def _concat_caches(caches: list[DynamicCache]) -> DynamicCache:
    """The rows of transformers caches of equal lengths in one (a state's TLI memory and drafted positions)."""
    out = DynamicCache()
    for idx, layer in enumerate(caches[0].layers):
        if layer.is_initialized:
            keys = torch.cat([c.layers[idx].keys for c in caches], dim=0)
            out.update(keys, torch.cat([c.layers[idx].values for c in caches], dim=0), idx)
    return out
