"""Counting for the benchmark: the target's forward calls (`count_forward_calls`) and the metrics computed from the
counts (acceptance length, tokens/s, speedup, the theoretical speedup bound of Leviathan et al. 2023, `summarize`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_METRICS = ("acceptance_length", "tokens_per_s", "speedup", "theoretical_speedup")


@dataclass
class CallCounter:
    """Forward calls of one module while counted: how many, how many input tokens, and their wall time."""

    calls: int = 0
    fed_tokens: int = 0
    seconds: float = 0.0
    _t0: float = 0.0


@contextlib.contextmanager
def count_forward_calls(model: torch.nn.Module) -> Iterator[CallCounter]:
    """Count `model`'s forward calls (and time them) inside the block; the hooks are always removed on leaving."""
    counter = CallCounter()

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        counter.calls += 1
        counter.fed_tokens += int(ids.shape[1] if ids is not None else embeds.shape[1] if embeds is not None else 0)
        counter._t0 = time.perf_counter()

    def post_hook(module, args, kwargs, output):
        counter.seconds += time.perf_counter() - counter._t0

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True),
    ]
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------
def expected_length(alpha: float, gamma: float) -> float:
    """E[tokens per cycle] = (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def solve_alpha(acceptance_length: float, gamma: float) -> float:
    """The per-token acceptance rate alpha with E[L](alpha, gamma) = `acceptance_length` (bisection; clipped)."""
    if gamma <= 0 or acceptance_length <= 1.0:
        return 0.0
    if acceptance_length >= gamma + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):  # E[L] increases with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_length(mid, gamma) < acceptance_length else (lo, mid)
    return (lo + hi) / 2


def speedup_bound(alpha: float, gamma: float, cost_ratio: float) -> float:
    """Expected improvement factor (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (Leviathan et al. 2023)."""
    return expected_length(alpha, gamma) / (gamma * cost_ratio + 1.0)


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def acceptance_length(new_tokens: int, target_calls: int) -> float | None:
    """Tokens added per target forward call, the target's own token included: `new_tokens / target_calls`.

    The one definition of acceptance length in moa_hf (bench, tune, the training evaluation and the tests of
    `SpeculationStats.mean_accepted_length`, which equals it for a drafter's session). Every target forward call
    counts, the prefill too: the prefill call yields the first new token, as one step of plain decoding would, and
    each later call verifies a draft and adds the accepted drafted tokens plus the target's own. Plain decoding is
    therefore exactly 1.0 and a drafter whose every draft is accepted tends to draft length + 1. Sum tokens and calls
    over generations before dividing (a pooled ratio, not a mean of per-generation ratios). None without calls.
    """
    return ratio(new_tokens, target_calls)


def group_metrics(rows: list[dict], vanilla_rows: list[dict]) -> dict:
    new = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["time_s"] for r in rows)
    calls = sum(r["target_calls"] for r in rows)
    drafted = sum(r["drafted_tokens"] for r in rows)
    draft_s = sum(r["draft_time_s"] for r in rows)
    verified = sum(r["verified_draft_tokens"] for r in rows)
    tps = ratio(new, seconds)
    vanilla_tps = ratio(sum(r["new_tokens"] for r in vanilla_rows), sum(r["time_s"] for r in vanilla_rows))
    step_s = ratio(sum(r["time_s"] for r in vanilla_rows), sum(r["new_tokens"] for r in vanilla_rows))
    acceptance = acceptance_length(new, calls)
    gamma = ratio(verified, calls) or 0.0  # mean draft length per verification cycle
    per_draft_s = ratio(draft_s, drafted) or 0.0
    cost = per_draft_s / step_s if step_s else 0.0
    alpha = solve_alpha(acceptance, gamma) if acceptance is not None else None
    engine = [r for r in rows if "cycles" in r]  # the engine's methods: tree statistics
    exits = [r["exit_counts"] for r in rows if r.get("exit_counts") is not None]  # MoA drafters: tokens per exit
    return {
        "acceptance_length": acceptance,
        "tokens_per_s": tps,
        "speedup": ratio(tps, vanilla_tps) if tps is not None and vanilla_tps is not None else None,
        "theoretical_speedup": speedup_bound(alpha, gamma, cost) if alpha is not None else None,
        "alpha": alpha,
        "gamma": gamma,
        "cost_ratio": cost,
        "new_tokens": new,
        "time_s": seconds,
        "target_calls": calls,
        "drafted_tokens": drafted,
        "verified_draft_tokens": verified,
        "draft_time_s": draft_s,
        "verify_time_s": sum(r.get("verify_time_s", 0.0) for r in rows),
        "mean_tree_size": ratio(sum(r["verified_draft_tokens"] for r in engine), sum(r["cycles"] for r in engine)),
        "matches_vanilla": sum(bool(r.get("matches_vanilla")) for r in rows),
        "generations": len(rows),
        "exit_counts": [sum(column) for column in zip(*exits)] if exits else None,
    }


def summarize(records: list[dict], method: str) -> dict:
    """Metrics of `method` pooled over all records ("overall") and per category, against `vanilla`'s records."""
    mine = [r for r in records if r["method"] == method]
    vanilla = [r for r in records if r["method"] == "vanilla"]
    categories = list(dict.fromkeys(r["category"] for r in mine))
    return {
        "overall": group_metrics(mine, vanilla),
        "per_category": {
            cat: group_metrics([r for r in mine if r["category"] == cat], [r for r in vanilla if r["category"] == cat])
            for cat in categories
        },
    }
