"""Where simulated drafting cycles start: the staircase of `MoATrainer` (cycle lengths drawn U{min..max} per sequence,
a pure function of seed, step and example), cycles that start after the drafter's own misses (`on_policy_restarts`),
when the drafter reads each token at inference (`read_ends_of_cycles`) and the SA curriculum's mask."""

from __future__ import annotations

import torch

from moa_hf.modeling import cycle_starts_from_restarts

__all__ = [
    "block_anchors",
    "block_slots",
    "markov_rows",
    "draw_cycle_lengths",
    "draw_uniform",
    "mix64",
    "on_policy_restarts",
    "read_ends_of_cycles",
    "sa_curriculum_mask",
    "simulated_cycles",
    "staircase_restarts",
]

_MASK64 = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 chain): reproducible randomness without a global RNG."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (int(v) & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x


def draw_cycle_lengths(sample_index: torch.Tensor, step: int, seed: int, low: int, high: int) -> torch.Tensor:
    """Cycle length U{low..high} per sequence [B], a pure function of (seed, step, sample index): resumable."""
    span = high - low + 1
    return torch.tensor([low + mix64(seed, step, int(i), 1) % span for i in sample_index.tolist()], dtype=torch.long)


def draw_uniform(sample_index: torch.Tensor, step: int, seed: int, salt: int) -> torch.Tensor:
    return torch.tensor([mix64(seed, step, int(i), salt) / 2.0**64 for i in sample_index.tolist()])


def staircase_restarts(
    prompt_lengths: torch.Tensor, cycle_lengths: torch.Tensor, seq_len: int, response_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Restart points bool [B, T]: every prompt position, and positions p >= prompt_len with
    (p - prompt_len) % cycle_length == 0 (the token the target produced at the start of each cycle).

    With a `response_mask` [B, T] (conversations: True on assistant tokens), every token outside an assistant turn
    is a restart (the target reads a user's turn whole) and the cycles count from the start of each assistant turn."""
    pos = torch.arange(seq_len, device=prompt_lengths.device)[None, :]  # [1, T]
    if response_mask is None:
        response = pos >= prompt_lengths[:, None]  # [B, T]
    else:
        response = response_mask.to(pos.device).bool()
    start = torch.cummax(torch.where(response, 0, pos + 1), dim=1).values  # [B, T]: where p's assistant turn starts
    rel = pos - start  # [B, T]
    return ~response | (rel % cycle_lengths.to(rel.device)[:, None] == 0)


def on_policy_restarts(
    prompt_lengths: torch.Tensor, cycle_lengths: torch.Tensor, first_hits: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Restart points bool [B, T] of decoding-like cycles: every prompt position; from the last one on, a cycle
    starting at s whose first draft misses (`first_hits[b, s]` False: the drafter's top token at s is not token s+1)
    is followed by one at s+1, as decoding restarts right after the target's correction; one whose first draft hits
    runs `cycle_lengths[b]` positions (a staircase step). `lengths`: [B] each row's tokens (no restarts beyond)."""
    B, T = first_hits.shape
    restarts = torch.arange(T)[None, :] < prompt_lengths.cpu()[:, None]  # [B, T]
    hits = first_hits.cpu().tolist()
    for b in range(B):
        s, every, end = max(int(prompt_lengths[b]) - 1, 0), int(cycle_lengths[b]), int(lengths[b])
        while s < end:
            restarts[b, s] = True
            s += every if hits[b][s] else 1
    return restarts.to(first_hits.device)


def read_ends_of_cycles(prompt_lengths: torch.Tensor, cycle_starts: torch.Tensor) -> torch.Tensor:
    """[B, T]: the target's cache length when the drafter reads token j at inference, for simulated cycles.

    The first read covers the whole prompt (the target's cache then holds the prompt: `prompt_length`); a response
    token is read at the start of the next cycle (T for the last one, which no token of the sequence reads). With
    `held_at_reads` this gives the tokens a sliding-window layer of the target no longer holds when they are read.
    """
    B, T = cycle_starts.shape
    pos = torch.arange(T, device=cycle_starts.device).expand(B, T)
    starts = torch.where(cycle_starts == pos, pos, torch.full_like(pos, T))  # restart positions, T elsewhere
    at_or_after = torch.flip(torch.cummin(torch.flip(starts, [1]), dim=1).values, [1])  # next restart >= j
    after = torch.cat([at_or_after[:, 1:], torch.full_like(pos[:, :1], T)], dim=1)  # next restart > j
    return torch.maximum(after, prompt_lengths.to(after.device)[:, None])  # [B, T]


def sa_curriculum_mask(cycle_starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """SA mask bool [B, T, T]: rows marked True see only tokens j >= start(i) (their current cycle); other rows see
    everything (the drafter intersects the mask with causality)."""
    B, T = cycle_starts.shape
    pos = torch.arange(T, device=cycle_starts.device)
    in_cycle = pos[None, None, :] >= cycle_starts[:, :, None]  # [B, T, T]
    return in_cycle | ~rows.to(cycle_starts.device)[:, None, None]


def simulated_cycles(
    args, inputs: dict[str, torch.Tensor], step: int, max_steps: int, training: bool, first_hits=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cycle_starts [B, T], sa_mask [B, T, T] or None) of a training batch under `args` (`MoATrainingArguments`):
    the staircase of simulated drafting cycles (with `first_hits` [B, T], whether the drafter's first draft at each
    position is right: cycles also start after its misses, `on_policy_restarts`) and, with `sa_curriculum`, the SA
    mask. Random draws depend on (seed, `step`, sample index) only (evaluation passes step -1: comparable losses)."""
    input_ids = inputs["input_ids"]
    B, T = input_ids.shape
    index = inputs.get("sample_index")
    if index is None or bool((index < 0).any()):
        index = torch.arange(B) + (1 << 40)  # no dataset index: deterministic per (step, row)
    index = index.cpu()
    every = draw_cycle_lengths(index, step, args.seed, args.min_cycle, args.max_cycle)
    if first_hits is not None:
        if "response_mask" in inputs:
            raise ValueError(
                "cycle_starts='on_policy' supports single-turn data (prompt + response); this batch holds "
                "conversations: use cycle_starts='staircase'."
            )
        mask = inputs.get("attention_mask")
        lengths = mask.sum(1) if mask is not None else torch.full((B,), T)
        restarts = on_policy_restarts(inputs["prompt_lengths"], every, first_hits, lengths)
    else:
        restarts = staircase_restarts(
            inputs["prompt_lengths"], every.to(input_ids.device), T, inputs.get("response_mask")
        )
    cycle_starts = cycle_starts_from_restarts(restarts)  # [B, T]
    sa_mask = None
    if args.sa_curriculum and training:
        prob = max(0.0, 1.0 - 2.0 * step / max(1, max_steps))  # progress = epoch / E
        rows = draw_uniform(index, step, args.seed, 2) < prob
        if bool(rows.any()):
            sa_mask = sa_curriculum_mask(cycle_starts, rows)
    return cycle_starts, sa_mask


def block_anchors(cycle_starts: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """A block drafter's blocks to train: [B, A] the simulated cycles' starts (positions i with start(i) = i whose
    next token is counted), each row's first, -1 after them (A: the most of any row)."""
    pos = torch.arange(cycle_starts.shape[1], device=cycle_starts.device)
    starts = (cycle_starts == pos[None, :]) & counted  # [B, T]
    A = max(int(starts.sum(1).max()), 1)
    order = torch.where(starts, pos[None, :], cycle_starts.shape[1] + pos[None, :]).sort(dim=1).values[:, :A]
    return torch.where(order < cycle_starts.shape[1], order, -1)  # [B, A]


def block_slots(anchors: torch.Tensor, block_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions [B, S] of the placeholder slots of `anchors` [B, A] (S = A*(k-1), in `block_layout`'s order:
    anchor s's slot j stands at s+j and predicts token s+j+1) and their offsets j [S]; a slot of no anchor, or one
    past the sequence's `length`, is at -1."""
    offset = torch.arange(1, block_size, device=anchors.device).repeat(anchors.shape[1])  # [S]
    slot = anchors.repeat_interleave(block_size - 1, dim=1) + offset  # [B, S]
    ok = (anchors.repeat_interleave(block_size - 1, dim=1) >= 0) & (slot < length)
    return torch.where(ok, slot, -1), offset


def markov_rows(drafter, student: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """A block drafter's slot rows with their Markov head (`block_markov_rank`): `student` [B, S, d] with the token
    before each slot, `previous` [B, S], appended as two columns (id // 256, id % 256: exact in bf16), and the head
    (draft logits + the Markov bias of that token, [n, V']) that reads them, with the draft ids, for the losses'
    chunked heads (which see rows only)."""
    columns = torch.stack([previous // 256, previous % 256], dim=-1).to(student.dtype)  # [B, S, 2]

    def head(rows: torch.Tensor) -> torch.Tensor:
        ids = rows[..., -2].round().long() * 256 + rows[..., -1].round().long()  # [n]
        return drafter.draft_logits(rows[..., :-2]) + drafter.markov_bias(ids, full=False)

    return torch.cat([student, columns], dim=-1), (head, drafter.draft_ids)
