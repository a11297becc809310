"""`moa tune`: measure a drafter's speculation settings (draft length, confidence threshold, schedule) on held-out
prompts and pick the fastest.

Transformers' assisted generation reads `num_assistant_tokens`, `num_assistant_tokens_schedule` and
`assistant_confidence_threshold` from the ASSISTANT's `generation_config` (`AssistedCandidateGenerator`), so each
setting is installed as a fresh copy of the drafter's config for its `generate` calls; the original config object is
put back afterwards, untouched. Every `generate` is greedy and batch 1. The plain target (no assistant) runs on the
same prompts, interleaved with the settings so that all share the machine's noise, as the speedup baseline.
Each `generate` runs on the benchmark's runner (`moa_hf.bench.generate_once`: the same timing, target-call counting
and acceptance length as `moa bench`).

A sorted MoA drafter (`num_blocks` K > 1) also has per-exit confidence thresholds (`exit_thresholds`, K - 1 values in
its config.json: a drafted token leaves at the first exit whose top probability reaches that exit's threshold).
`tune_exit_thresholds` measures every fixed exit, then searches the thresholds one exit at a time (coordinate search
over a small grid, from the fastest fixed exit); `--write` stores the fastest in config.json, where the lookup settings
live too. Several targets (`--target` given more than once, each with its own prompts) are measured in the same run:
the speculation settings are pooled (one set serves them all), the exit thresholds are tuned per target the drafter
serves (the primary's in `exit_thresholds`, another's in its `extra_targets` entry; `--pooled-exits`: one set).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import HfArgumentParser, PreTrainedModel

from .bench import (
    BenchMethod,
    acceptance_length,
    drafter_method,
    generate_once,
    hardware_info,
    independent_method,
    vanilla_method,
)
from .modeling import LookupSettings
from .tune_arguments import EXIT_GRID, TuneArguments
from .tune_report import (
    format_exit_agreement_markdown,
    format_exit_tuning_markdown,
    format_tuning_markdown,
    write_best_setting,
)
from .tune_settings import SETTING_KEYS, TuneError, lookup_values, rank

__all__ = [
    "EXIT_GRID",
    "NEVER",
    "SETTING_KEYS",
    "TuneArguments",
    "TuneError",
    "exit_agreement",
    "format_exit_agreement_markdown",
    "format_exit_tuning_markdown",
    "format_tuning_markdown",
    "register",
    "run_tune",
    "tune_exit_thresholds",
    "tune_speculation",
    "write_best_setting",
]

SCHEDULES = ("constant", "heuristic", "heuristic_transient")
TUNING_FILE = "tuning.json"
NEVER = 2.0  # an exit threshold above 1: no token leaves at that exit


# ---------------------------------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _speculation_config(drafter, setting: dict | None) -> Iterator[None]:
    """Give `drafter` a copy of its generation config with the speculation keys of `setting` for the block, and its
    config's lookup fields (MoA; when `setting` has them) and exit thresholds (sorted MoA; when it has them); the
    original generation config and config fields are put back."""
    if setting is None:
        yield
        return
    original = drafter.generation_config
    gc = copy.deepcopy(original)
    for key in SETTING_KEYS[:3]:
        if key in setting:
            setattr(gc, key, setting[key])
    fields = _config_values(drafter, setting)
    exits = fields.pop("exit_thresholds", None)
    own_fields = {key: getattr(drafter.config, key) for key in fields}
    drafter.generation_config = gc  # a "heuristic" schedule writes its final draft length back into this copy
    try:
        for key, value in fields.items():
            setattr(drafter.config, key, value)
        with drafter.override_exit_thresholds(exits) if exits is not None else contextlib.nullcontext():
            yield
    finally:
        drafter.generation_config = original
        for key, value in own_fields.items():
            setattr(drafter.config, key, value)


def _config_values(drafter, setting: dict) -> dict:
    """The drafter config fields that `setting` sets: prompt lookup (MoA drafters, when `setting` has
    `lookup_num_tokens`) and `exit_thresholds` (when it has them)."""
    values = {}
    if "lookup_num_tokens" in setting and getattr(drafter, "supports_prompt_lookup", False):
        values.update(lookup_values(setting))
    if "exit_thresholds" in setting:
        values["exit_thresholds"] = setting["exit_thresholds"]
    return values


def _check_lookup(drafter, setting: dict) -> None:
    """A `TuneError` for lookup fields that the drafter's config cannot take."""
    values = {key.removeprefix("lookup_"): value for key, value in lookup_values(setting).items()}
    try:
        dataclasses.replace(LookupSettings.from_config(drafter.config), **values)  # validates
    except ValueError as err:
        raise TuneError(f"Invalid prompt lookup setting {values} for this drafter: {err}.") from err


def _setting_method(drafter, setting: dict | None, allow_other_target: bool) -> BenchMethod:
    """The benchmark method of one setting: `drafter` under `setting` (MoA/EAGLE attached to the target around each
    `generate`, any other causal LM as a plain assistant), or the target alone when `setting` is None."""
    if setting is None:
        return vanilla_method()
    if hasattr(drafter, "attached"):
        base = drafter_method("setting", drafter, allow_other_target)
    else:
        base = independent_method("setting", drafter)

    @contextlib.contextmanager
    def context(target):
        with _speculation_config(drafter, setting), base.context(target) as handle:
            yield handle

    return dataclasses.replace(base, context=context)


def _inputs(ids: Sequence[int], device: torch.device) -> dict:
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)  # [1, P]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _grid(
    num_assistant_tokens, thresholds, schedules, lookup_tokens=(0,), lookup_min_ngrams=(1,), lookup_halving=(False,)
) -> list[dict]:
    settings = []
    lookups = sorted(  # (tokens, shortest n-gram, halving); lookup off: one setting
        {
            (int(n), int(m), bool(h)) if int(n) > 0 else (0, None, False)
            for n in lookup_tokens
            for m in lookup_min_ngrams
            for h in lookup_halving
        },
        key=lambda x: (x[0], x[1] or 0, x[2]),
    )
    for k, threshold, schedule, (lookup, min_ngram, halve) in itertools.product(
        num_assistant_tokens, thresholds, schedules, lookups
    ):
        if int(k) < 1:
            raise TuneError(f"num_assistant_tokens must be >= 1, got {k}.")
        if not 0.0 <= float(threshold) < 1.0:
            raise TuneError(f"Confidence thresholds must lie in [0, 1), got {threshold}.")
        if schedule not in SCHEDULES:
            raise TuneError(f"Unknown schedule {schedule!r}; use one of {SCHEDULES}.")
        if lookup < 0 or (min_ngram is not None and min_ngram < 1):
            raise TuneError(f"Lookup tokens must be >= 0 and minimum n-grams >= 1, got {lookup}, {min_ngram}.")
        settings.append(
            {
                "num_assistant_tokens": int(k),
                "assistant_confidence_threshold": float(threshold),
                "num_assistant_tokens_schedule": schedule,
                "lookup_num_tokens": lookup,
                "lookup_min_ngram": min_ngram,
                "lookup_halve_per_ngram": halve,
            }
        )
    if not settings:
        raise TuneError("The grid is empty: give at least one draft length, threshold and schedule.")
    return settings


def _summary(records: list[dict], drafts: bool) -> dict:
    """Pooled over the records of one run (`moa_hf.bench.generate_once` records); `drafts`: it had a drafter."""
    tokens = sum(r["new_tokens"] for r in records)
    calls = sum(r["target_calls"] for r in records)
    seconds = sum(r["time_s"] for r in records)
    exits = [r["exit_counts"] for r in records if r.get("exit_counts") is not None]  # MoA drafters: tokens per exit
    summary = {
        "new_tokens": tokens,
        "target_calls": calls,
        "wall_time_s": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "acceptance_length": acceptance_length(tokens, calls),
        "drafted_tokens": sum(r["drafted_tokens"] for r in records) if drafts else None,
    }
    if drafts and exits:
        summary["exit_counts"] = [sum(column) for column in zip(*exits)]
    return summary


def _jobs(target, prompt_ids) -> list[tuple]:
    """(target, prompt ids) pairs: `prompt_ids` are one target's prompts, or already such pairs (several targets)."""
    jobs = [(p[0], list(p[1])) if isinstance(p, tuple) else (target, list(p)) for p in prompt_ids]
    if not jobs or any(len(ids) == 0 for _, ids in jobs):
        raise TuneError("Give at least one prompt, each with at least one token.")
    return jobs


def _measure(
    drafter,
    jobs: list[tuple],
    settings: list[dict],
    *,
    max_new_tokens: int,
    repeats: int,
    progress: bool,
    warmup: bool,
    allow_other_target: bool,
    desc: str = "moa tune",
) -> tuple[dict, list[dict]]:
    """Greedy batch-1 generations of every (target, prompt) job with the target alone and with `drafter` under each
    setting, interleaved: for each (repeat, job) the baseline and all settings run back to back, in an order rotated
    from one job to the next. Returns (baseline, rows): pooled summaries; a row is its setting plus its summary,
    ``speedup`` over the baseline and ``identical_outputs`` (jobs whose output equals the baseline's)."""
    if max_new_tokens < 1 or repeats < 1:
        raise TuneError(f"max_new_tokens and repeats must be >= 1 (got {max_new_tokens}, {repeats}).")
    runs: list[dict | None] = [None, *settings]  # None: the target alone (the baseline)
    methods = [_setting_method(drafter, run, allow_other_target) for run in runs]
    inputs = [_inputs(ids, target.device) for target, ids in jobs]
    records: list[list[dict]] = [[] for _ in runs]
    outputs: dict[tuple[int, int], list[int]] = {}  # (run, job) -> last greedy output
    was_training = getattr(drafter, "training", False)
    drafter.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=repeats * len(jobs) * len(runs), desc=desc, unit="gen", disable=not progress)
    try:
        if warmup:  # one-time costs (kernels, allocator) stay out of the measurements
            for method in methods[:2]:
                generate_once(jobs[0][0], method, inputs[0], min(max_new_tokens, 8))
        for step, (_, j) in enumerate(itertools.product(range(repeats), range(len(jobs)))):
            shift = step % len(runs)
            target, prompt = jobs[j]
            for i in [*range(shift, len(runs)), *range(shift)]:
                record, out = generate_once(target, methods[i], inputs[j], max_new_tokens)
                outputs[(i, j)] = out[0, len(prompt) :].tolist()
                records[i].append(record)
                bar.update(1)
    finally:
        bar.close()
        drafter.train(was_training)
    baseline = _summary(records[0], drafts=False)
    base_tps = baseline["tokens_per_s"]
    baseline["speedup"] = 1.0
    rows = []
    for i, setting in enumerate(settings, start=1):
        row = {**setting, **_summary(records[i], drafts=True)}
        row["speedup"] = row["tokens_per_s"] / base_tps if row["tokens_per_s"] and base_tps else None
        row["identical_outputs"] = sum(outputs[(i, j)] == outputs[(0, j)] for j in range(len(jobs)))
        rows.append(row)
    return baseline, rows


# ---------------------------------------------------------------------------------------------------------------------
# Tuning
# ---------------------------------------------------------------------------------------------------------------------
def tune_speculation(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence[Sequence[int]],
    num_assistant_tokens: Sequence[int] = (2, 3, 4, 5, 6, 8),
    thresholds: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5),
    schedules: Sequence[str] = ("constant",),
    lookup_tokens: Sequence[int] = (0,),
    lookup_min_ngrams: Sequence[int] = (1,),
    lookup_halving: Sequence[bool] = (False,),
    max_new_tokens: int = 96,
    repeats: int = 1,
    progress: bool = True,
    warmup: bool = True,
    allow_other_target: bool = False,
) -> dict:
    """Time greedy speculative decoding with `drafter` for every setting of the grid, and the target alone.

    `drafter` is a MoA/EAGLE drafter (attached to `target` around each of its calls) or any causal LM used as
    `assistant_model`. `prompt_ids` are prompts of `target`, or (target, prompt) pairs to measure several targets
    together (their generations pooled; `target` is then unused). For each (repeat, prompt) the baseline and all
    settings run back to back, in an order rotated from one prompt to the next. Per setting: ``tokens_per_s`` (new
    tokens / wall time of its `generate` calls), ``speedup`` (over the baseline's tokens/s), ``acceptance_length``
    (new tokens / target forward calls; 1.0 for the baseline), ``drafted_tokens`` (MoA/EAGLE only) and
    ``identical_outputs`` (prompts whose greedy output equals the baseline's: all of them, up to low-precision
    rounding, as speculative decoding is lossless). A "heuristic" schedule starts from the setting's draft length at
    every prompt. `lookup_tokens` (0: off) and `lookup_min_ngrams` set the MoA drafter's prompt lookup (its config's
    `lookup_num_tokens`, `lookup_min_ngram`), `lookup_halving` whether shorter matches propose fewer tokens
    (`lookup_halve_per_ngram`). Returns ``{"baseline", "rows", "best", ...}``, best by speedup (ties: higher
    acceptance length). The drafter's generation config and
    lookup fields are left as they were.
    """
    jobs = _jobs(target, prompt_ids)
    settings = _grid(num_assistant_tokens, thresholds, schedules, lookup_tokens, lookup_min_ngrams, lookup_halving)
    if any(s["lookup_num_tokens"] for s in settings) and not getattr(drafter, "supports_prompt_lookup", False):
        raise TuneError(
            f"{type(drafter).__name__} has no prompt lookup of its own; tune it with lookup tokens 0 (for prompt "
            "lookup without a drafter use `target.generate(prompt_lookup_num_tokens=...)`)."
        )
    for setting in settings if getattr(drafter, "supports_prompt_lookup", False) else ():
        _check_lookup(drafter, setting)  # e.g. a minimum n-gram above the drafter's longest: refused before any run
    baseline, rows = _measure(
        drafter,
        jobs,
        settings,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        progress=progress,
        warmup=warmup,
        allow_other_target=allow_other_target,
    )
    best = max(rows, key=rank)
    return {
        "baseline": baseline,
        "rows": rows,
        "best": best,
        "num_prompts": len(jobs),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
    }


def _exit_start(exit: int, num_blocks: int) -> list[float]:
    """The K - 1 thresholds of fixed exit `exit` with NEVER beyond it: where the search starts from that exit."""
    return ([NEVER] * (exit - 1) + [0.0] + [NEVER] * (num_blocks - 1 - exit))[: num_blocks - 1]


def _exit_candidates(current: list[float], i: int, grid: Sequence[float]) -> list[list[float]]:
    """`current` with threshold `i` (0-based) set to each value of the grid, 0 (always leave at exit i + 1), NEVER
    and its current value (measured again among its rivals, under the same noise). Where `current` lets no token
    reach exit i + 2 (threshold i is 0), the tokens that threshold i would now send deeper also get the next exit as
    their fallback (threshold i + 1 at 0), not only the exit `current` happens to name beyond it."""
    values = sorted({*map(float, grid), 0.0, NEVER, float(current[i])})
    candidates = [[*current[:i], v, *current[i + 1 :]] for v in values]
    if i + 1 < len(current) and float(current[i]) == 0.0 and float(current[i + 1]) != 0.0:
        nxt = [*current[: i + 1], 0.0, *current[i + 2 :]]
        candidates += [[*nxt[:i], v, *nxt[i + 1 :]] for v in values if v not in (0.0, NEVER)]
    unique = {tuple(_canonical(c)): None for c in candidates}  # settings that draft alike are measured once
    return [list(c) for c in unique]


def _canonical(thresholds: Sequence[float]) -> list[float]:
    """`thresholds` with those after the first 0 set to NEVER: no token gets past an exit whose threshold is 0, so
    the later ones change nothing ([0.0, 0.8] drafts as [0.0, NEVER])."""
    values = [float(t) for t in thresholds]
    first = next((j for j, t in enumerate(values) if t == 0.0), len(values))
    return values[: first + 1] + [NEVER] * (len(values) - first - 1)


def _reachable_tokens(records: list[dict], output: Sequence[int]) -> list[tuple[float, list[bool]]]:
    """(exit-1 top probability, right at each exit) of the reachable drafted tokens of one batch-1 generation:
    those whose earlier tokens in the same drafting cycle were all right at the exit they left at. `records`: from
    `recording_exit_tops`, in drafting order; `output`: the generated sequence (prompt included), the truth."""
    tokens, cycle, alive = [], None, True
    for record in records:
        if record["cycle"] != cycle:  # a new drafting cycle starts from verified tokens
            cycle, alive = record["cycle"], True
        p = record["position"]
        if p >= len(output):  # drafted past the end of the generation: no truth
            alive = False
            continue
        top1 = record["top1"][0].tolist()  # [K]
        if alive:
            tokens.append((float(record["confidence"][0, 0]), [t == output[p] for t in top1]))
        alive = alive and top1[int(record["exit"][0]) - 1] == output[p]
    return tokens


def exit_agreement(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence,
    exit: int = 1,
    thresholds: Sequence[float] = EXIT_GRID,
    max_new_tokens: int = 64,
    progress: bool = True,
    allow_other_target: bool = False,
) -> dict:
    """How often each exit of a sorted MoA drafter proposes the target's own next token: what a deeper exit has to
    offer for its cost. Greedy batch-1 generations of every prompt with the drafter drafting at `exit`, every exit's
    top-1 recorded at every drafted token (`recording_exit_tops`; the target's output is the truth). Counted: the
    reachable tokens (every earlier token of their drafting cycle right), the ones that can lengthen an accepted
    draft. `prompt_ids`: as `tune_exit_thresholds`.

    Returns ``{"drafting_exit", "tokens", "accepted_draft_tokens", "top1_by_exit": [K], "any_exit", "below": [{
    "threshold", "share", "tokens", "top1_by_exit"}]}``: the share of reachable tokens whose top-1 is right at each
    exit (at any exit), overall and among those whose exit-1 top probability is below each threshold (the tokens
    that threshold sends past exit 1). `accepted_draft_tokens` (from the target's calls) equals the reachable
    tokens right at `exit`."""
    from .modeling import fixed_exit_thresholds

    num_blocks = int(getattr(drafter.config, "num_blocks", 1) or 1)
    if num_blocks < 2 or not hasattr(drafter, "recording_exit_tops"):
        raise TuneError(
            f"Exit agreement compares the exits of a sorted MoA drafter; {type(drafter).__name__} has {num_blocks} "
            "block(s). Train one with `moa train --num-blocks 3`."
        )
    if not 1 <= exit <= num_blocks:
        raise TuneError(f"The drafter has exits 1 to {num_blocks}; got exit={exit}.")
    from tqdm.auto import tqdm

    jobs = _jobs(target, prompt_ids)
    setting = {"exit_thresholds": fixed_exit_thresholds(exit, num_blocks), "lookup_num_tokens": 0}  # the network
    method = _setting_method(drafter, setting, allow_other_target)
    tokens, accepted = [], 0
    was_training = drafter.training
    drafter.eval()
    try:
        for model, ids in tqdm(jobs, desc="moa tune: exit agreement", unit="gen", disable=not progress):
            with drafter.recording_exit_tops() as records:
                record, out = generate_once(model, method, _inputs(ids, model.device), max_new_tokens)
            tokens += _reachable_tokens(records, out[0].tolist())
            accepted += record["new_tokens"] - record["target_calls"]  # each target call adds one token of its own
    finally:
        drafter.train(was_training)

    def shares(rows: list) -> list[float | None]:
        return [sum(right[k] for _, right in rows) / len(rows) if rows else None for k in range(num_blocks)]

    below = []
    for t in sorted({float(t) for t in thresholds}):
        rows = [row for row in tokens if row[0] < t]
        share = len(rows) / len(tokens) if tokens else None
        below.append({"threshold": t, "share": share, "tokens": len(rows), "top1_by_exit": shares(rows)})
    return {
        "drafting_exit": exit,
        "tokens": len(tokens),
        "accepted_draft_tokens": accepted,
        "top1_by_exit": shares(tokens),
        "any_exit": sum(any(right) for _, right in tokens) / len(tokens) if tokens else None,
        "below": below,
        "num_prompts": len(jobs),
        "max_new_tokens": max_new_tokens,
    }


def tune_exit_thresholds(
    target: PreTrainedModel,
    drafter,
    prompt_ids: Sequence,
    grid: Sequence[float] = EXIT_GRID,
    rounds: int = 1,
    max_new_tokens: int = 64,
    repeats: int = 1,
    progress: bool = True,
    warmup: bool = True,
    allow_other_target: bool = False,
) -> dict:
    """Per-exit confidence thresholds of a sorted MoA drafter (`num_blocks` K > 1) by coordinate search on tokens/s.

    First every fixed exit (`fixed_exit_thresholds`); from the fastest, exit 1's threshold takes every value of `grid`
    plus 0 and NEVER (2.0) with the others kept, the fastest stays, then exit 2's, ... exit K-1's (`rounds` passes;
    exit k's is skipped while an earlier threshold is 0, as no token reaches exit k then; settings that draft alike
    are measured once, thresholds after a 0 written as NEVER). A
    step is one `_measure` (its candidates and the target alone, interleaved, on the same prompts), so a whole search
    costs (K + rounds (K - 1)(len(grid) + 3)) generations per prompt at most. `prompt_ids`: as `tune_speculation`.
    Returns ``{"num_blocks", "grid", "steps": [{"step", "baseline", "rows"}], "best", "best_fixed", "agreement",
    ...}``; a row has ``exit_thresholds``, ``exit`` (k for a fixed exit, else None), the summary (with
    ``exit_counts``), ``speedup`` and ``identical_outputs``; best by speedup (ties: acceptance length); ``agreement``:
    `exit_agreement` drafting at exit 1 (untimed), why the search finds what it finds. The drafter's config is left as
    it was.
    """
    num_blocks = int(getattr(drafter.config, "num_blocks", 1) or 1)
    if num_blocks < 2:
        raise TuneError(
            f"{type(drafter).__name__} has {num_blocks} block(s): exit thresholds need a sorted MoA drafter "
            "(num_blocks > 1, e.g. `moa train --num-blocks 3`); tune its speculation settings instead (--tune "
            "speculation)."
        )
    if not grid or any(not 0.0 <= float(t) <= 1.0 for t in grid):
        raise TuneError(f"Exit thresholds are top probabilities in [0, 1]; got the grid {list(grid)}.")
    if rounds < 1:
        raise TuneError(f"rounds must be >= 1, got {rounds}.")
    from .modeling import fixed_exit_thresholds

    jobs = _jobs(target, prompt_ids)
    run = functools.partial(
        _measure,
        drafter,
        jobs,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        progress=progress,
        allow_other_target=allow_other_target,
    )
    fixed = [{"exit_thresholds": fixed_exit_thresholds(k, num_blocks), "exit": k} for k in range(1, num_blocks + 1)]
    baseline, rows = run(fixed, warmup=warmup, desc="moa tune: fixed exits")
    steps = [{"step": "fixed exits", "baseline": baseline, "rows": rows}]
    agreement = exit_agreement(
        target,
        drafter,
        jobs,
        thresholds=grid,
        max_new_tokens=max_new_tokens,
        progress=progress,
        allow_other_target=allow_other_target,
    )
    best_fixed = max(rows, key=rank)
    current = _exit_start(best_fixed["exit"], num_blocks)
    best = best_fixed
    for round_, i in itertools.product(range(rounds), range(num_blocks - 1)):
        if 0.0 in current[:i]:  # every token leaves before exit i + 1: its threshold changes nothing
            continue
        settings = [{"exit_thresholds": c, "exit": None} for c in _exit_candidates(current, i, grid)]
        baseline, rows = run(settings, warmup=False, desc=f"moa tune: exit {i + 1} threshold")
        steps.append({"step": f"exit {i + 1} threshold (round {round_ + 1})", "baseline": baseline, "rows": rows})
        best = max(rows, key=rank)
        current = list(best["exit_thresholds"])
    return {
        "num_blocks": num_blocks,
        "grid": [float(t) for t in grid],
        "rounds": rounds,
        "steps": steps,
        "best": best,
        "best_fixed": best_fixed,
        "agreement": agreement,
        "num_prompts": len(jobs),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _target_specs(args: TuneArguments) -> list[tuple[str, list[str]]]:
    """(target spec, its prompt sources) per `--target`: `SPEC=SOURCE[+SOURCE...]` gives a target its own prompts (the
    natural held-out prompts of a fine-tune, e.g. `default:pydoc=pydoc:heldout`); a plain SPEC takes `--prompts`."""
    specs = []
    for text in args.target:
        spec, sep, sources = text.partition("=")
        sources = [s for s in sources.split("+") if s] if sep else list(args.prompts)
        if not spec or not sources:
            raise TuneError(
                f"--target {text!r}: expected SPEC or SPEC=SOURCE[+SOURCE...], e.g. default:pydoc=pydoc:heldout."
            )
        specs.append((spec, sources))
    return specs


def _load_prompts(sources: Sequence[str], args: TuneArguments) -> list[str]:
    """The held-out prompts of `sources` (`--num-prompts` from each); Spec-Bench is refused by its records here (by
    name already in `run_tune`, before any loading).

    The prompt sources (the offline `default:*` splits, files, `datasets` folders) are `moa_hf.prompts`, shared with
    `moa data`.
    """
    from .prompts import load_prompts

    return [
        prompt
        for source in sources
        for prompt in load_prompts(source, column=args.prompt_column, num_prompts=args.num_prompts, seed=args.seed)
    ]


def _exit_groups(drafter, jobs: list[tuple], pooled: bool) -> dict[str | None, list[tuple]]:
    """The jobs whose exit thresholds are tuned together: {drafter target name: its jobs} (the drafter's part chosen
    by each model's fingerprint, the primary's for other models), or {None: all} when `pooled` or a single drafter
    target is involved and it is the primary (one set then serves every target, `config.exit_thresholds`)."""
    from .modeling import PRIMARY_TARGET

    several = bool(getattr(drafter.config, "extra_targets", None))
    names = {id(m): (drafter.target_for(m) if several else None) or PRIMARY_TARGET for m, _ in jobs}  # once a model
    groups: dict[str | None, list[tuple]] = {}
    for model, ids in jobs:
        groups.setdefault(names[id(model)], []).append((model, ids))
    if pooled or list(groups) == [PRIMARY_TARGET]:
        return {None: jobs}
    return groups


def _mode(requested: str, drafter) -> str:
    """What to tune: `auto` is the exit thresholds for a sorted MoA drafter (num_blocks > 1), else the speculation
    settings."""
    if requested != "auto":
        return requested
    return "exits" if int(getattr(drafter.config, "num_blocks", 1) or 1) > 1 else "speculation"


def run_tune(args: TuneArguments) -> int:
    """`moa tune` with its options `args`."""
    from .loading import drafter_kind, load_drafter, load_target
    from .prompts import check_not_spec_bench, format_prompts

    specs = _target_specs(args)
    for source in (source for _, sources in specs for source in sources):  # tuning on the evaluation set: cheating
        check_not_spec_bench(source)  # refused before any loading
    prompts = [_load_prompts(sources, args) for _, sources in specs]
    torch.manual_seed(args.seed)
    targets = [load_target(spec, dtype=args.dtype, device=args.device) for spec, _ in specs]
    target = targets[0][0]
    try:
        drafter = load_drafter(args.drafter, target=target, kind=args.kind)
    except (OSError, ValueError) as err:
        raise TuneError(f"{err} Pass the --output folder of `moa train` as --drafter.") from err
    kind = drafter_kind(drafter)
    jobs = [(model, ids) for (model, tok), texts in zip(targets, prompts) for ids in format_prompts(tok, texts)]
    mode = _mode(args.tune, drafter)
    common = dict(max_new_tokens=args.max_new_tokens, repeats=args.repeats, progress=not args.quiet)
    common["allow_other_target"] = args.allow_other_target
    result = {
        "target": getattr(target.config, "name_or_path", None) or specs[0][0],
        "targets": [
            {"spec": spec, "name_or_path": getattr(model.config, "name_or_path", None), "prompts": sources}
            for (spec, sources), (model, _) in zip(specs, targets)
        ],
        "drafter": str(args.drafter),
        "kind": kind,
        "tuned": mode,
        "dtype": str(target.dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "num_prompts": len(jobs),
        "hardware": hardware_info(target.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    best: dict = {}
    if mode in ("exits", "both"):
        groups = _exit_groups(drafter, jobs, pooled=args.pooled_exits)
        tuned = {}
        for name, group in groups.items():
            exits = tune_exit_thresholds(
                target, drafter, group, grid=args.exit_grid, rounds=args.exit_rounds, **common
            )
            tuned[name] = exits["best"]["exit_thresholds"]
            result.setdefault("exits_by_target", {})[name] = exits
            print(f"\n### target {name!r}\n" if name is not None else "", format_exit_tuning_markdown(exits), sep="")
        if None in tuned:  # pooled: one set for every target
            result["exits"] = result.pop("exits_by_target")[None]
            best["exit_thresholds"] = tuned[None]
            drafter.set_exit_thresholds(tuned[None])
            for name in drafter.target_names[1:]:
                drafter.set_exit_thresholds(None, target=name)  # the shared ones serve every target
        else:
            best["exit_thresholds_by_target"] = tuned
            for name, thresholds in tuned.items():
                drafter.set_exit_thresholds(thresholds, target=name)  # the speculation grid below runs with them
    if mode in ("speculation", "both"):
        speculation = tune_speculation(
            target,
            drafter,
            jobs,
            num_assistant_tokens=args.num_assistant_tokens,
            thresholds=args.thresholds,
            schedules=args.schedules,
            lookup_tokens=args.lookup_tokens,
            lookup_min_ngrams=args.lookup_min_ngrams,
            lookup_halving=[bool(h) for h in args.lookup_halve_per_ngram],
            **common,
        )
        result.update(speculation)
        best = {**{k: speculation["best"][k] for k in SETTING_KEYS if k in speculation["best"]}, **best}
        print(format_tuning_markdown(result))
    result["written"] = bool(args.write)
    folder = Path(args.drafter)
    (folder / TUNING_FILE).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {folder / TUNING_FILE}")
    if args.write:
        write_best_setting(folder, best, fallback=drafter.generation_config)
        print(
            f"updated {folder / 'generation_config.json'} (MoA lookup and exit thresholds: config.json) with the best "
            "setting"
        )
    return 0


def _main(namespace: argparse.Namespace) -> int:
    (args,) = HfArgumentParser(TuneArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    return run_tune(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `moa tune` (its options: the fields of `TuneArguments`)."""
    subparsers.add_parser(
        "tune",
        parents=[HfArgumentParser(TuneArguments, add_help=False)],
        help="pick a drafter's fastest speculation settings (draft length, confidence threshold)",
        description="Time greedy speculative decoding with the drafter for every setting of a grid on held-out "
        "prompts, against the target alone (interleaved). Prints a table, writes tuning.json into the drafter "
        "folder and, with --write, the best setting into its generation_config.json. Spec-Bench is refused. "
        "Options: the fields of TuneArguments, each spelled with hyphens or underscores.",
    ).set_defaults(func=_main)
