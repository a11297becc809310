"""An exact replay of greedy chain speculative decoding from teacher-forced drafter passes.

For a one-block MoA drafter (no Target Layer Inference) a drafting cycle at inference *is* the training forward with
one cycle start: a cycle that starts at position s (tokens 0..s verified, the target's states of 0..s-1 read) drafts
token s+1+d at position s+d, reading the context of tokens j < s, and while the drafts before it were accepted its
inputs are the target's own tokens. So K staircase passes of cycle length K (phases 0..K-1) over a sequence that the
target wrote greedily give, for every possible cycle start s and depth d < K, whether inference would draft the
target's token there (`hits`) and with what probability (`confidence`). Replaying greedy decoding on that table (a
cycle starts right after the target's correction or bonus token) gives tokens per target call for any chain rule
(most tokens, confidence threshold) without running the target again: thousands of positions in CPU-seconds.

The replay models transformers' assisted generation with the network alone (`target.generate(assistant_model=...)`,
prompt lookup off): the first cycle drafts before the target has run (no context), a chain drafts at most
`min(num_assistant_tokens, max_length - len - 1)` tokens and stops after a token whose probability is below the
threshold (`draft_chain`). `check_replay` runs the real thing on the same prompts and compares.

Terms: tokens per call = new tokens / target forward calls, pooled over prompts (`moa_hf.bench.acceptance_length`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from moa_hf.bench import acceptance_length
from moa_hf.modeling import MoADrafterModel

from .drafters import unwrap_model
from .evaluation import assisted_outputs
from .targets import run_target

__all__ = [
    "ChainRule",
    "DraftTable",
    "ReplayResult",
    "bootstrap_interval",
    "check_replay",
    "draft_tables",
    "drafter_eos_ids",
    "replay",
    "replay_chain",
    "replay_metrics",
    "parse_rules",
    "replay_unsupported_reason",
]


@dataclass(frozen=True)
class ChainRule:
    """How the `assistant_model` path drafts a chain: at most `max_tokens` tokens (`num_assistant_tokens`), stopping
    after a token whose drafter probability is below `threshold` (`assistant_confidence_threshold`; 0: never)."""

    max_tokens: int = 24
    threshold: float = 0.3

    @classmethod
    def of(cls, drafter) -> ChainRule:
        """The rule of `drafter`'s own generation config (what `generate(assistant_model=drafter)` uses)."""
        gc = drafter.generation_config
        return cls(int(gc.num_assistant_tokens), float(getattr(gc, "assistant_confidence_threshold", 0.0) or 0.0))

    def __str__(self) -> str:
        return f"{self.max_tokens}:{self.threshold:g}"

    @property
    def key(self) -> str:
        """A metric-name-safe label: ``k24_t0.3``."""
        return f"k{self.max_tokens}_t{self.threshold:g}"


def parse_rules(text: str) -> list[ChainRule]:
    """``"24:0.3,8:0"`` -> [ChainRule(24, 0.3), ChainRule(8, 0.0)] (MAX_TOKENS:THRESHOLD, comma-separated)."""
    rules = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        k, sep, thr = item.partition(":")
        try:
            rule = ChainRule(int(k), float(thr) if sep else 0.0)
        except ValueError as err:
            raise ValueError(f"A chain rule is MAX_TOKENS:THRESHOLD (e.g. 24:0.3), got {item!r}.") from err
        if rule.max_tokens < 1 or not 0.0 <= rule.threshold < 1.0:
            raise ValueError(f"A chain rule needs MAX_TOKENS >= 1 and 0 <= THRESHOLD < 1, got {item!r}.")
        rules.append(rule)
    if not rules:
        raise ValueError("No chain rule given; use e.g. 24:0.3,8:0.")
    return rules


@dataclass
class DraftTable:
    """One sequence's teacher-forced drafting outcomes per cycle start and depth.

    Row r is the cycle starting at s = prompt_length - 1 + r (the last verified token; the target has read 0..s-1);
    column d its (d+1)-th drafted token, the prediction at position s+d of token s+d+1. `hits[r, d]`: the drafter's
    top token is the target's (greedy: accepted while every earlier one of the cycle was); `confidence[r, d]`: its
    probability. Row 0 is the first cycle of the `assistant_model` path, drafted before the target ran (no context).
    `max_length`: the generation's limit (prompt + max_new_tokens), which caps each chain as transformers does;
    `length`: the tokens of the sequence that the replay covers (the target's greedy continuation up to there).
    """

    prompt_length: int
    length: int
    max_length: int
    hits: torch.Tensor  # bool [R, K]
    confidence: torch.Tensor  # float32 [R, K]
    eos: torch.Tensor  # bool [R, K]: the drafted token is an end-of-sequence token (the chain stops after it)
    disagreements: int = 0  # answer tokens that are not the target's teacher-forced argmax (bf16 near-ties)

    @property
    def new_tokens(self) -> int:
        return self.length - self.prompt_length


@dataclass
class ReplayResult:
    """Replayed decoding of a set of sequences under one chain rule: per sequence new tokens and target calls, the
    drafted tokens of cycles up to their first rejection, and acceptance by depth at the cycles decoding ran."""

    rule: ChainRule
    new_tokens: list[int]
    calls: list[int]
    reached: list[int]  # [K]: cycles whose chain reached depth d (all before accepted, not stopped)
    accepted: list[int]  # [K]: of those, the ones whose depth-d token was accepted

    @property
    def tokens_per_call(self) -> float:
        return acceptance_length(sum(self.new_tokens), sum(self.calls)) or 0.0

    def depth_rates(self) -> list[float]:
        """The acceptance rate at each depth given that the chain reached it (cycles decoding actually ran)."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    def interval(self, level: float = 0.95, samples: int = 2000, seed: int = 0) -> tuple[float, float]:
        """Bootstrap interval over sequences of the pooled tokens per call."""
        return bootstrap_interval(self.new_tokens, self.calls, level, samples, seed)


def drafter_eos_ids(drafter) -> list[int]:
    """The tokens after which the drafter's chain stops (`DrafterMixin.generate`: its generation config's
    `eos_token_id`, else its config's)."""
    eos = drafter.generation_config.eos_token_id
    eos = eos if eos is not None else drafter.config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def replay_unsupported_reason(drafter) -> str | None:
    """Why the replay is not exact for `drafter`, or None: it needs a one-block MoA drafter without Target Layer
    Inference (a deeper block's keys/values of verified tokens depend on their cycles; TLI runs target layers over
    drafted positions)."""
    if not isinstance(drafter, MoADrafterModel):
        return f"the replay covers MoA drafters (the teacher-forced cycle is their inference), not {type(drafter)}."
    if drafter.config.num_blocks != 1:
        return f"a drafter of {drafter.config.num_blocks} blocks (the replay is exact for one block)."
    if drafter.config.target_layer_inference:
        return "target_layer_inference > 0 (the replay is exact without TLI)."
    return None


_BASE_PERIOD = 6  # depths every start gets; deeper ones only where the first _BASE_PERIOD drafts were all right


def _cycle_starts(length: int, first: int, period: int, phase: int, first_without_context: bool) -> torch.Tensor:
    """[T] start(p) for a staircase of cycles of `period` tokens whose starts are first + phase + m * period; earlier
    positions start their own cycle. `first_without_context`: the cycle at `first` (phase 0) reads no context
    (start 0), as the `assistant_model` path's first drafting call, which runs before the target."""
    pos = torch.arange(length)
    anchor = first + phase
    starts = torch.where(pos >= anchor, anchor + (pos - anchor).div(period, rounding_mode="floor") * period, pos)
    if first_without_context and phase == 0:
        starts[(pos >= first) & (pos < first + period)] = 0
    return starts


@torch.no_grad()
def _target_greedy(target: PreTrainedModel, final_hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """The target's greedy next token [B, T] from its post-norm final hidden states [B, T, D]."""
    head = target.get_output_embeddings()
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])  # [B*T, D]
    top = torch.cat([head(flat[i : i + chunk].to(head.weight.dtype)).argmax(-1) for i in range(0, len(flat), chunk)])
    return top.view(final_hidden.shape[:2])  # [B, T]


@torch.no_grad()
def draft_tables(
    drafter: MoADrafterModel,
    target: PreTrainedModel,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    max_new_tokens: int | None = None,
    depth: int = 24,
    eos_token_ids: Sequence[int] | None = None,
    batch_size: int = 4,
    first_cycle_context: bool = False,
    strict: bool = False,
) -> list[DraftTable]:
    """A `DraftTable` of each sequence (prompt + the target's greedy answer of at most `max_new_tokens` tokens; None:
    an answer that ends with one of `eos_token_ids` stopped there, any other one at the token limit).

    One target forward per batch (its states, and its own greedy tokens to count `disagreements`: answer tokens that
    are not its teacher-forced argmax, near-ties that another shape's rounding flipped in bf16) and `depth` drafter
    passes over the context vectors computed once. The answer's tokens are what the target verifies against (what
    decoding wrote); `strict`: replay each sequence only up to its first disagreement instead.
    `first_cycle_context`: the first cycle reads the prompt's context (the engine prefills first); False models the
    `assistant_model` path."""
    reason = replay_unsupported_reason(drafter)
    if reason is not None:
        raise ValueError(f"Cannot replay this drafter: {reason}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}.")
    eos_token_ids = drafter_eos_ids(drafter) if eos_token_ids is None else list(eos_token_ids)
    attach = contextlib.nullcontext() if drafter.is_attached else drafter.attached(target, allow_other_target=True)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # batches of similar lengths
    by_index: dict[int, DraftTable] = {}
    with attach:
        for lo in range(0, len(order), batch_size):
            batch = order[lo : lo + batch_size]
            rows = [list(sequences[i]) for i in batch]
            prompts = [int(prompt_lengths[i]) for i in batch]
            made = _batch_tables(
                drafter, target, rows, prompts, max_new_tokens, depth, eos_token_ids, first_cycle_context, strict
            )
            by_index.update(zip(batch, made))
    return [by_index[i] for i in range(len(sequences))]


def _batch_tables(
    drafter, target, rows, prompts, max_new_tokens, depth, eos_token_ids, first_cycle_context, strict
) -> list[DraftTable]:
    """`draft_tables` of one batch of sequences `rows` (token-id lists) with prompt lengths `prompts`."""
    device = next(target.parameters()).device
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    drafter_device = drafter.draft_ids.device if drafter.config.draft_vocab_size else device
    tables: list[DraftTable] = []
    B, T = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):  # right-padded: positions are the same as unpadded
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    states = run_target(target, ids, mask)
    greedy = _target_greedy(target, states.final_hidden)  # [B, T]: the target's token after each position
    pos = torch.arange(T, device=device)
    # [B, T, d], computed once: a token's context does not depend on the cycles
    context = drafter.compute_context(states, where=mask.bool(), positions=pos)
    hits = torch.zeros(B, T, depth, dtype=torch.bool)  # [B, start, d]
    conf = torch.zeros(B, T, depth)
    is_eos = torch.zeros(B, T, depth, dtype=torch.bool)
    last_prompt = torch.tensor(prompts, device=device)[:, None] - 1  # [B, 1]: each row's first cycle start
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # [B, T]: the sequence's token after each position

    def record(fed: torch.Tensor, keep: torch.Tensor) -> None:
        """One drafter pass with cycle starts `fed` [B, T] (0 on the no-context first cycle); the outcomes
        at positions `keep` [B, T] go to their cycle's row and depth."""
        out = drafter(ids, context=context, cycle_starts=fed, attention_mask=mask, exits="last", return_logits=False)
        draft = drafter.draft_logits(out.hidden_states)  # [B, T, V'] float32
        prob, top = draft.softmax(-1).max(-1)  # [B, T]
        if drafter.config.draft_vocab_size:
            top = drafter.draft_ids.to(drafter_device)[top.to(drafter_device)].to(device)
        start = torch.where(fed == 0, last_prompt, fed)  # [B, T]: the cycle's start s (its table row)
        d = pos[None, :] - start  # [B, T]: depth within its cycle
        b_idx, p_idx = (keep & (d >= 0) & (d < depth)).nonzero(as_tuple=True)
        b_cpu, s_idx, d_idx = b_idx.cpu(), start[b_idx, p_idx].cpu(), d[b_idx, p_idx].cpu()
        hits[b_cpu, s_idx, d_idx] = (top == nxt)[b_idx, p_idx].cpu()
        conf[b_cpu, s_idx, d_idx] = prob[b_idx, p_idx].float().cpu()
        if eos.numel():
            is_eos[b_cpu, s_idx, d_idx] = torch.isin(top[b_idx, p_idx], eos).cpu()

    # Depths < base for every start: `base` staircase passes of period `base`, one per phase
    base = min(depth, _BASE_PERIOD)
    for phase in range(base):
        fed = torch.stack([_cycle_starts(T, p - 1, base, phase, not first_cycle_context) for p in prompts])
        record(fed.to(device), pos[None, :] >= last_prompt + phase)
    # Deeper only where decoding can get there (the first `base` drafts all right): their windows of
    # `depth` positions, packed without overlap into as few passes as they need
    windows: list[list[tuple[int, int]]] = []  # per pass: (row, start)
    ends: list[list[int]] = []  # per pass and row: where its last window ends
    deep = hits[:, :, :base].all(-1) if depth > base else torch.zeros(B, T, dtype=torch.bool)
    for b, s in deep.nonzero().tolist():
        if s < prompts[b] - 1 or s + base >= len(rows[b]):
            continue
        k = next((k for k, e in enumerate(ends) if e[b] <= s), None)
        if k is None:
            windows.append([])
            ends.append([0] * B)
            k = len(ends) - 1
        windows[k].append((b, s))
        ends[k][b] = s + depth
    for packed in windows:
        fed, keep = pos.expand(B, T).clone(), torch.zeros(B, T, dtype=torch.bool, device=device)
        for b, s in packed:
            no_context = s == prompts[b] - 1 and not first_cycle_context
            fed[b, s : s + depth] = 0 if no_context else s
            keep[b, s + base : s + depth] = True
        record(fed, keep)
    agree = (greedy[:, :-1] == ids[:, 1:]).cpu()  # [B, T-1]
    for b, (r, p) in enumerate(zip(rows, prompts)):
        length = len(r)
        if max_new_tokens is not None:
            limit = p + max_new_tokens
        elif r[-1] in eos_token_ids:  # generation stopped at its end-of-sequence token
            limit = length + depth + 1  # no cap before it
        else:  # stopped by the token limit
            limit = length
        wrong = (~agree[b, p - 1 : length - 1]).nonzero()
        if strict and len(wrong):  # replay only the target's teacher-forced greedy continuation
            length = p + int(wrong[0])
        lo_s = p - 1
        valid = (torch.arange(lo_s, length)[:, None] + torch.arange(depth)[None, :] + 1) < length  # [R, K]
        tables.append(
            DraftTable(
                prompt_length=p,
                length=length,
                max_length=length if strict and len(wrong) else limit,
                hits=hits[b, lo_s:length].clone() & valid,
                confidence=conf[b, lo_s:length].clone(),
                eos=is_eos[b, lo_s:length].clone() & valid,
                disagreements=len(wrong),
            )
        )
    return tables


def replay_chain(table: DraftTable, rule: ChainRule) -> tuple[int, int, list[int], list[int]]:
    """Greedy decoding of one table's sequence under `rule`: (new tokens, target calls, reached [K], accepted [K]).

    Each cycle: a chain of at most min(rule.max_tokens, max_length - (s + 1) - 1) tokens is accepted up to its first
    miss; it stops earlier after a token below the threshold or an end-of-sequence token; the target adds one token
    (its correction or bonus) and the next cycle starts there."""
    K = table.hits.shape[1]
    if rule.max_tokens > K:
        raise ValueError(f"The table holds depths < {K}; a chain of {rule.max_tokens} needs draft_tables(depth>=).")
    hits, conf, eos = table.hits.tolist(), table.confidence.tolist(), table.eos.tolist()
    reached, accepted = [0] * K, [0] * K
    s, calls, end, first = table.prompt_length - 1, 0, table.length - 1, table.prompt_length - 1
    while s < end:
        limit = min(rule.max_tokens, table.max_length - s - 2)
        row = s - first
        n = 0
        for d in range(limit):
            reached[d] += 1
            if not hits[row][d]:
                break
            accepted[d] += 1
            n += 1
            if conf[row][d] < rule.threshold or eos[row][d]:
                break
        calls += 1
        s += n + 1
    return table.new_tokens, calls, reached, accepted


def replay(tables: Sequence[DraftTable], rule: ChainRule) -> ReplayResult:
    """`replay_chain` over every table, pooled."""
    new_tokens, calls = [], []
    K = tables[0].hits.shape[1] if tables else rule.max_tokens
    reached, accepted = [0] * K, [0] * K
    for table in tables:
        n, c, r, a = replay_chain(table, rule)
        new_tokens.append(n)
        calls.append(c)
        reached = [x + y for x, y in zip(reached, r)]
        accepted = [x + y for x, y in zip(accepted, a)]
    return ReplayResult(rule, new_tokens, calls, reached, accepted)


def bootstrap_interval(
    new_tokens: Sequence[int], calls: Sequence[int], level: float = 0.95, samples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap over sequences (prompts) of the pooled ratio sum(new_tokens) / sum(calls)."""
    n = len(new_tokens)
    if n == 0:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    stats = []
    for _ in range(samples):
        pick = [rng.randrange(n) for _ in range(n)]
        c = sum(calls[i] for i in pick)
        stats.append(sum(new_tokens[i] for i in pick) / c if c else math.nan)
    stats.sort()
    lo = stats[int((1 - level) / 2 * (samples - 1))]
    hi = stats[int((1 + level) / 2 * (samples - 1))]
    return (lo, hi)


@torch.no_grad()
def check_replay(
    drafter: MoADrafterModel,
    target: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    rule: ChainRule | None = None,
    pad_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> dict:
    """Real greedy `target.generate(assistant_model=drafter)` (network alone, `rule`'s settings) on each prompt, and
    the replay of the very sequences it wrote: tokens per call of both, pooled, and per prompt."""
    rule = rule or ChainRule.of(drafter)
    own, lookup = drafter.generation_config, drafter.config.lookup_num_tokens
    drafter.generation_config = copy.deepcopy(own)
    drafter.generation_config.num_assistant_tokens = rule.max_tokens
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = rule.threshold
    drafter.config.lookup_num_tokens = 0
    try:
        with drafter.attached(target, allow_other_target=True):
            runs = assisted_outputs(target, drafter, prompt_ids, max_new_tokens, pad_token_id)
    finally:
        drafter.generation_config, drafter.config.lookup_num_tokens = own, lookup
    outputs = [out for out, _ in runs]
    real_tokens = [len(out) - len(ids) for out, ids in zip(outputs, prompt_ids)]
    real_calls = [calls for _, calls in runs]
    tables = draft_tables(
        drafter,
        target,
        outputs,
        [len(p) for p in prompt_ids],
        max_new_tokens,
        depth=rule.max_tokens,
        eos_token_ids=eos_token_ids,
    )
    replayed = replay(tables, rule)
    return {
        "rule": str(rule),
        "prompts": len(prompt_ids),
        "real_tokens_per_call": acceptance_length(sum(real_tokens), sum(real_calls)) or 0.0,
        "replay_tokens_per_call": replayed.tokens_per_call,
        "real_calls": real_calls,
        "replay_calls": replayed.calls,
        "real_new_tokens": real_tokens,
        "replay_new_tokens": replayed.new_tokens,
        "disagreements": sum(t.disagreements for t in tables),
        "tables": tables,
    }


def replay_metrics(
    drafter, target: PreTrainedModel, rows, rules: Sequence[ChainRule], eos_token_ids=None, autocast=None
) -> dict[str, float]:
    """The replay's tokens per target call on held-out greedy answers `rows` (`moa data` rows: ``input_ids``,
    ``prompt_length``) under each chain rule: ``replay_tokens_per_call`` (the first rule) and ``replay_<rule key>``
    (all); {} for a drafter the replay does not cover (`replay_unsupported_reason`). `autocast`: a context manager
    factory to run under (the trainer's mixed precision)."""
    base = unwrap_model(drafter)
    sequences = [list(r["input_ids"]) for r in rows]
    if replay_unsupported_reason(base) is not None or not sequences:
        return {}
    was_training = base.training
    base.eval()
    try:
        with autocast() if autocast is not None else contextlib.nullcontext():
            tables = draft_tables(
                base,
                target,
                sequences,
                [int(r["prompt_length"]) for r in rows],
                depth=max(rule.max_tokens for rule in rules),
                eos_token_ids=eos_token_ids,
            )
    finally:
        base.train(was_training)
    results = [replay(tables, rule) for rule in rules]
    metrics = {f"replay_{r.rule.key}": r.tokens_per_call for r in results}
    metrics["replay_tokens_per_call"] = results[0].tokens_per_call
    return metrics
