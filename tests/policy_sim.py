"""One simulator for the speculation policy of every route: a synthetic target and drafter (`World`) whose costs and
acceptance are known, and one driver per adapter over the policy core (`drive_engine`: the engine's `ShapePolicy`,
`drive_vllm`: vLLM's `VllmDraftPolicy`, `drive_client`: the serving client's `ClientDraftPolicy`) that plays the
route's loop against it: plan, let the world answer, report what it measured.

Draws are deterministic and evenly spread (golden-ratio sequences): a draft of k tokens has an accepted prefix of at
least i tokens in a share `accept`^i of the draws, a row has a lookup proposal in a share `lookup_share`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moa_hf.modeling.custom_generate import engine
from moa_hf.modeling.custom_generate.tree import Tree

GOLDEN, PLASTIC = 0.6180339887498949, 0.7548776662466927


@dataclass
class World:
    verify: Callable[[int], float] = lambda tokens: 0.010 + 0.0005 * tokens  # a target forward verifying N tokens
    draft_s: float = 0.0005  # the network's seconds per drafted token per row
    lookup_s: float = 1e-4  # the proposer's seconds per row drafted by prompt lookup
    accept: float = 0.8  # network drafts: P(accepted prefix >= i) = accept**i
    accept_lookup: float = 0.7  # lookup drafts, the same
    lookup_share: float = 0.0  # share of rows with a lookup proposal
    round_trip: float = 0.0  # the client's network seconds per call (beyond the server's)
    arm_s: dict = field(default_factory=dict)  # the engine's arms: seconds per token of the batch
    draws: int = 0
    rows_seen: int = 0

    def accepted(self, k: int, by_lookup: bool = False) -> int:
        """The accepted prefix of a draft of k tokens."""
        self.draws += 1
        u, accept = (self.draws * GOLDEN) % 1.0, self.accept_lookup if by_lookup else self.accept
        n = 0
        while n < k and u < accept ** (n + 1):
            n += 1
        return n

    def has_lookup(self) -> bool:
        self.rows_seen += 1
        return (self.rows_seen * PLASTIC) % 1.0 < self.lookup_share


def drive_engine(policy, world: World, cycles: int, context: str = "none", rows: int | None = None) -> list[str]:
    """The engine's loop at `rows` rows still decoding (default: the policy's batch) in `context`: a cycle that
    drafts verifies one node per row. With `world.arm_s`, a cycle of arm a gains 2 tokens per row (plain decoding 1)
    in rows x tokens x arm_s[a] seconds; else each row's node is accepted as `accept` (lookup's as `accept_lookup`)
    and the cycle takes world.verify of the tokens verified, plus draft_s per row for the network's arms. The arms
    played."""
    rows = rows or policy.batch
    one = torch.ones(rows, 1, dtype=torch.long)
    node = Tree(one, one * -1, one, torch.zeros(rows, 1), one.bool(), one.bool() & False)  # one node per row
    played = []
    for _ in range(cycles):
        shape = policy.plan(remaining=100, context=context, rows=rows)
        arm, drafted = policy.arm, int(shape.depth > 0)
        played.append(arm)
        if world.arm_s:
            lengths = [drafted] * rows
            seconds = sum(lengths) * world.arm_s[arm] + rows * world.arm_s[arm]
        else:
            lengths = [world.accepted(drafted, by_lookup=arm == "lookup") for _ in range(rows)]
            drafting = world.lookup_s if arm == "lookup" else world.draft_s
            seconds = world.verify(rows * (1 + drafted)) + drafting * rows * drafted
        tree = node if drafted else engine.empty_tree(rows, "cpu")
        policy.update(tree, lengths, [], seconds, 0.0, 0.0)
    return played


def drive_vllm(policy, world: World, steps: int, batch: int = 1) -> list[tuple[int, bool]]:
    """vLLM's proposer loop at `batch` rows: plan (k, network); rows with a lookup proposal draft k by lookup, the
    others k by the network where it runs; the engine verifies every row's draft (world.verify of the tokens), the
    proposer took world.draft_s per network token and world.lookup_s per lookup row. The plans made."""
    plans = []
    for _ in range(steps):
        k, network = policy.plan(batch)
        plans.append((k, network))
        if not k:
            policy.record_step(batch, 0, batch, world.verify(batch), 0.0)
            continue
        lookup = [policy.lookup and world.has_lookup() for _ in range(batch)]
        by_network = 0 if not network else batch - sum(lookup)
        tokens = batch + k * (sum(lookup) + by_network)
        seconds = world.draft_s * k * by_network + world.lookup_s * sum(lookup)
        policy.record_rows(sum(lookup), batch)
        policy.record_step(batch, k, tokens, world.verify(tokens), seconds, network)
        for by_lookup in lookup:
            if by_lookup or network:
                policy.record_acceptance(k, world.accepted(k, by_lookup), by_lookup=by_lookup)
    return plans


def drive_client(policy, world: World, calls: int, budget: int = 100) -> list[int]:
    """The client's loop: choose k, draft it (world.draft_s per token), one call verifying 1 + k tokens
    (world.round_trip + world.verify(1 + k) seconds). The draft lengths chosen."""
    chosen = []
    for _ in range(calls):
        k = policy.choose(budget)
        chosen.append(k)
        if k:
            policy.observe_draft(world.draft_s)
        policy.observe_call(world.round_trip, world.verify(1 + k), 1 + k, k, world.accepted(k) if k else 0)
    return chosen
