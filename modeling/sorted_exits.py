"""Sorted drafters (S2D, arXiv 2407.01955): the MoA drafter with K > 1 stacked SA + CA blocks and an exit after each.
While drafting, a token leaves at the first exit k < K whose top probability clears `exit_thresholds[k-1]` (else at
exit K; `_adaptive_exits`). Each deeper block keeps its own keys/values (`DeepBlock`); a block skipped by tokens that
left earlier first catches up on them from the stored outputs of the block before (`DeepBlock.pending`), so every exit
drafts exactly what `forward` gives there. `MoASortedExits` (the drafter's `sorted_exits`) runs them and keeps the
thresholds: `thresholds_for`, `set_thresholds`, `override`; `recording_tops` for analysis.

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch and its
sibling files.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .configuration_moa import PRIMARY_TARGET, check_exit_thresholds
from .drafting import LayerKV
from .target_parts import MoATargets

__all__ = ["DeepBlock", "MoASortedExits", "PendingSlots", "crop_deep", "fit_mask"]


@dataclass
class PendingSlots:
    """Inputs of slots a deeper block has not run on yet, with what that block needs to run them: x [B, n, d] (the
    previous block's outputs), the SA mask [B or 1, 1, n, S] over slots (columns beyond a block's length are never
    visible to these rows), RoPE cos/sin [(B,) n, hd], the CA mask [B or 1, 1, n, M] over the context they saw, and
    (`ca_latest_context`) the newest context vector each read, [B, n, d]."""

    x: torch.Tensor
    sa_mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ca_mask: torch.Tensor
    latest: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.x.shape[1]

    def first(self, n: int) -> "PendingSlots":
        cut = (self.sa_mask[..., :n, :], self.cos[..., :n, :], self.sin[..., :n, :], self.ca_mask[..., :n, :])
        return PendingSlots(self.x[:, :n], *cut, None if self.latest is None else self.latest[:, :n])

    def rows(self, rows: torch.Tensor) -> "PendingSlots":
        latest = None if self.latest is None else self.latest[rows]
        return PendingSlots(
            self.x[rows], self.sa_mask[rows], self.cos[rows], self.sin[rows], self.ca_mask[rows], latest
        )


def fit_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A bool mask [..., S] cut or padded with False to [..., width]."""
    if mask.shape[-1] >= width:
        return mask[..., :width]
    return torch.cat([mask, mask.new_zeros(*mask.shape[:-1], width - mask.shape[-1])], dim=-1)


@dataclass
class DeepBlock:
    """Block k >= 2 of a sorted drafter while drafting: SA keys/values of the slots it ran on (a prefix of the slots
    block k-1 ran on), CA keys/values of the verified context, and the pending slots (block k-1 ran, block k not:
    tokens that left at an earlier exit), which it runs before any later slot that goes this deep."""

    kv: LayerKV = field(default_factory=LayerKV)
    ca_keys: torch.Tensor | None = None  # [B, Hkv, M, hd]
    ca_values: torch.Tensor | None = None
    pending: list[PendingSlots] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if self.kv.keys is None else self.kv.keys.shape[2]

    def append_context(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.ca_keys is not None:
            k, v = torch.cat([self.ca_keys, k], dim=2), torch.cat([self.ca_values, v], dim=2)
        self.ca_keys, self.ca_values = k, v

    @staticmethod
    def concat(blocks: list["DeepBlock"]) -> "DeepBlock":
        """The rows of settled blocks (no pending slots; equal widths) in one."""
        cat = lambda ts: None if ts[0] is None else torch.cat(ts, dim=0)  # noqa: E731
        keys, values = cat([b.ca_keys for b in blocks]), cat([b.ca_values for b in blocks])
        return DeepBlock(LayerKV.concat([b.kv for b in blocks]), keys, values)

    def take(self, n: int) -> None:
        """Keep the first n pending slots."""
        kept = []
        for p in self.pending:
            if n <= 0:
                break
            kept.append(p if p.size <= n else p.first(n))
            n -= p.size
        self.pending = kept


def crop_deep(deep: list[DeepBlock], first_length: int, length: int) -> None:
    """Keep slots < `length` in every deeper block; `first_length`: block 1's slot count after the same crop.
    Block k's pending slots are [len_k, len_{k-1}): cropping keeps the first min(len_{k-1}, length) - len_k'."""
    done = first_length
    for block in deep:
        kept = min(block.length, length)
        block.take(min(done, length) - kept)
        block.kv.crop(kept)
        done = kept


class MoASortedExits:
    """The sorted blocks and adaptive exits of a `MoADrafterModel` (the drafter's `sorted_exits`): drafting a chain
    token or tree nodes through the blocks after block 1 (`adaptive_exits`, called by `MoADrafterModel.step`), each
    leaving at its exit, and the exit
    thresholds (per target, an override, recording every exit's top for analysis).

    It holds no modules: `layers()` gives the (SA, CA) layers of blocks 1..K (the drafter's `self_attention` +
    `cross_attention`, then `blocks`, whose state-dict keys stay theirs), `exit_head(hidden, confidence)` an exit's
    float32 logits [..., V] and top probability, `targets` the target whose thresholds apply.
    """

    def __init__(
        self,
        config,
        layers: Callable[[], list[tuple[nn.Module, nn.Module]]],
        exit_head: Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]],
        targets: MoATargets,
    ):
        self.config = config
        self.layers = layers
        self.exit_head = exit_head
        self.targets = targets
        self.override_thresholds: list[float] | None = None  # `override`
        self.tops: list[dict] | None = None  # `recording_tops`

    def deep_blocks(self, state) -> list[DeepBlock]:
        """The deeper blocks' drafting state of a cache or tree state (created on first use)."""
        if len(state.deep) < self.config.num_blocks - 1:
            state.deep = [DeepBlock() for _ in range(self.config.num_blocks - 1)]
        return state.deep

    def keep_first_block(self) -> None:
        """The config of a drafter whose blocks 2..K are dropped (`MoADrafterModel.keep_first_block`): one block, no
        thresholds."""
        self.config.num_blocks = 1
        self.config.exit_thresholds = None
        for spec in (self.config.extra_targets or {}).values():
            spec.pop("exit_thresholds", None)

    # ----------------------------------------------------------------------------------------------------------------
    # Drafting through the blocks
    # -----------------------------------------------------------------------------------------------------------------
    def record(self, tops: list, exit_of: torch.Tensor, position: int, cycle: int | None) -> None:
        """Append one chain drafting step's exits (`recording_tops`): `tops` as `adaptive_exits` filled it."""
        self.tops.append(
            {
                "position": position,
                "cycle": cycle,
                "top1": torch.cat([top1 for top1, _ in tops], dim=-1),  # [B, K]
                "confidence": torch.cat([conf for _, conf in tops], dim=-1),  # [B, K]
                "exit": exit_of[:, -1],  # [B]
            }
        )

    def adaptive_exits(
        self, x: PendingSlots, deep: list[DeepBlock], m: int = 1, record: list | None = None
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
        K, thresholds = self.config.num_blocks, [*self.thresholds(), 0.0]  # exit K always accepts
        layers = self.layers() if K > 1 else []
        logits = exit_of = None
        for k in range(1, K + 1):
            if k > 1:  # block k catches up on the slots that left before it, then runs these
                deep[k - 2].pending.append(x)
                x = self._run_pending(deep[k - 2], *layers[k - 1])
            t = thresholds[k - 1]
            if t > 1.0 and record is None:  # no token leaves here: no head needed
                continue
            exit_logits, top = self.exit_head(x.x[:, -m:], t > 0.0 or record is not None)
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

    def settle(self, deep: list[DeepBlock]) -> None:
        """Run every deeper block on its pending slots (block 2 first: its outputs are block 3's pending ones), so
        that each holds the keys/values of every slot block 1 ran on: what re-laying a state's slots needs."""
        layers = self.layers()
        for k, block in enumerate(deep):
            if block.pending:
                x = self._run_pending(block, *layers[k + 1])
                if k + 1 < len(deep):
                    deep[k + 1].pending.append(x)

    def _run_pending(self, block: DeepBlock, sa: nn.Module, ca: nn.Module) -> PendingSlots:
        """Run a deeper block on all its pending slots (in slot order); returns their outputs with their masks."""
        todo, block.pending = block.pending, []
        width = block.length + sum(p.size for p in todo)  # the block's slots after this run
        M = block.ca_keys.shape[2] if block.ca_keys is not None else 0
        x = torch.cat([p.x for p in todo], dim=1)  # [B, n, d]
        sa_mask = torch.cat([fit_mask(p.sa_mask, width) for p in todo], dim=-2)  # [B|1, 1, n, width]
        ca_mask = torch.cat([fit_mask(p.ca_mask, M) for p in todo], dim=-2)  # [B|1, 1, n, M]
        cos, sin = torch.cat([p.cos for p in todo], dim=-2), torch.cat([p.sin for p in todo], dim=-2)
        latest = None if todo[0].latest is None else torch.cat([p.latest for p in todo], dim=1)  # [B, n, d]
        if block.ca_keys is None:
            block.ca_keys = block.ca_values = x.new_zeros(
                x.shape[0], self.config.num_key_value_heads, 0, self.config.head_dim
            )
        x = sa(x, cos, sin, mask=sa_mask, cache=block.kv)
        x = ca(x, cos, sin, block.ca_keys, block.ca_values, mask=ca_mask, latest=latest)
        return PendingSlots(x, sa_mask, cos, sin, ca_mask, latest)

    # ----------------------------------------------------------------------------------------------------------------
    # Thresholds
    # -----------------------------------------------------------------------------------------------------------------
    def thresholds(self) -> list[float]:
        """`thresholds_for` the active target (read at every drafting step); None: never leave before exit K."""
        thresholds = self.thresholds_for()
        if thresholds is None:
            return [2.0] * (self.config.num_blocks - 1)
        return check_exit_thresholds(thresholds, self.config.num_blocks)

    def thresholds_for(self, name: str | None = None) -> list[float] | None:
        """The exit thresholds drafting for target `name` (None: the active one) uses: those of `override` while it
        holds, else `config.target_exit_thresholds(name)`: the target's own, else `config.exit_thresholds` (None:
        every token leaves at the last exit)."""
        if self.override_thresholds is not None:
            return self.override_thresholds
        if name is None:  # the drafting step's case: the active target is a known one
            name = self.targets.active
        else:
            self.targets.check_name(name)
        return self.config.target_exit_thresholds(name)

    def set_thresholds(self, thresholds: list[float] | None, target: str = PRIMARY_TARGET) -> None:
        """Store tuned thresholds for `target`: the primary's are `config.exit_thresholds` (they also serve every
        target without its own), another target's go into its `extra_targets` entry (None: it uses the primary's
        again)."""
        self.targets.check_name(target)
        if thresholds is not None:
            thresholds = check_exit_thresholds(thresholds, self.config.num_blocks)
        if target == PRIMARY_TARGET:
            self.config.exit_thresholds = thresholds
            return
        spec = {k: v for k, v in self.config.extra_targets[target].items() if k != "exit_thresholds"}
        if thresholds is not None:
            spec["exit_thresholds"] = thresholds
        self.config.extra_targets = {**self.config.extra_targets, target: spec}

    def override(self, thresholds: list[float] | None, owner=None) -> contextlib.AbstractContextManager:
        """Draft every target with `thresholds` instead of the stored ones; None lifts the override. Lasts until the
        next call, or used as `with sorted_exits.override(t):` until the block ends (the previous override
        restored; it yields `owner`)."""
        previous = self.override_thresholds
        num_blocks = self.config.num_blocks
        self.override_thresholds = None if thresholds is None else check_exit_thresholds(thresholds, num_blocks)

        @contextlib.contextmanager
        def restore():
            try:
                yield owner
            finally:
                self.override_thresholds = previous

        return restore()

    @contextlib.contextmanager
    def recording_tops(self):
        """Inside the block, every chain drafting step (`MoADrafterModel.step`) runs all K exits and appends to the
        yielded list {"position": p, "cycle": c, "top1": [B, K], "confidence": [B, K], "exit": [B]}: for the token
        drafted at sequence position p (0-based) in drafting cycle c, each exit's top-1 (full-vocabulary id) and top
        probability, and the exit the token left at. The drafted tokens stay the same; every step costs the full
        depth. For analysis (`moa tune`'s exit agreement), not for serving."""
        if self.config.num_blocks < 2:
            raise ValueError(
                f"recording_exit_tops compares the exits of a sorted drafter; this one has num_blocks "
                f"{self.config.num_blocks}. Use a drafter with num_blocks > 1 (`moa train --num-blocks 3`)."
            )
        previous, self.tops = self.tops, []
        try:
            yield self.tops
        finally:
            self.tops = previous
