"""Where the time of one drafting cycle goes (`moa costs`).

The chain through transformers' assisted generation: the drafter's cost per drafted token relative to one target
decode step, and the per-cycle overhead beyond the two models' forwards (transformers' assisted loop plus our glue).
The tree engine (`engine_costs`): the target's cost of one forward over n = 1, 2, 4, ..., 64 tokens (a tree of n - 1
drafted nodes and its root) relative to one decode step, and the drafter's cost of one tree depth over w nodes, as the
engine itself measures them (`speculative_generate`'s `measure_costs`, reported as the output's `costs`) to choose its
tree shapes; then where an engine cycle's time goes.

A sorted drafter (`num_blocks` K > 1) drafts at K exits: `exit_costs` times one drafted token at each fixed exit (the
chain's `draft_step`, batch 1, the minimum of the repeats: the least disturbed timing) and reports each over a target
decode step and over the full depth (the issue's target: exit 1 at most 0.6 x the full depth).
"""

import contextlib
import time

import torch
from transformers import DynamicCache

from .modeling import CACHE_NAME, CacheReader, MoADrafterCache
from .modeling.custom_generate.policy import wall_times

__all__ = ["engine_costs", "exit_costs", "measure_costs"]


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    times = wall_times(fn, device, repeats)
    return 1000 * times[len(times) // 2]


def exit_costs(drafter, draft_token, step_ms: float, repeats: int = 20) -> list[dict]:
    """One row per exit k of `drafter` (1 for a drafter of one block): `drafter_token_ms`, the minimum over `repeats`
    of `draft_token()` (one drafted token, its cache cropped back) with the drafter always leaving at exit k
    (`fixed_exit_thresholds`), `over_target_step` (over `step_ms`, a target decode step) and `over_full_depth` (over
    the last exit's). The first call at each exit is a warm-up (a deeper block first catches up on the context)."""
    from .modeling import fixed_exit_thresholds

    num_blocks = int(getattr(drafter.config, "num_blocks", 1) or 1)
    rows = []
    for k in range(1, num_blocks + 1):
        exit_k = (  # read at every drafting step
            drafter.override_exit_thresholds(fixed_exit_thresholds(k, num_blocks))
            if num_blocks > 1
            else contextlib.nullcontext()
        )
        with exit_k:
            rows.append({"exit": k, "drafter_token_ms": 1000 * wall_times(draft_token, drafter.device, repeats)[0]})
    full = rows[-1]["drafter_token_ms"]
    for row in rows:
        row["over_target_step"] = row["drafter_token_ms"] / step_ms
        row["over_full_depth"] = row["drafter_token_ms"] / full
    return rows


@torch.no_grad()
def measure_costs(target, drafter, input_ids: torch.Tensor, repeats: int = 20, gen_tokens: int = 64) -> dict:
    """Median timings on `input_ids` (one prompt) with the drafter attached to the target; `exits`: the drafting cost
    per token at each exit (`exit_costs`, minimum timings) and `exit1_over_full_depth`."""
    cache = DynamicCache(config=target.config)
    reads_hidden = getattr(drafter.config, "context_final_hidden", False)
    prefill = target(input_ids[:, :-1], use_cache=True, output_hidden_states=reads_hidden, **{CACHE_NAME: cache})
    hidden = prefill.hidden_states[-1] if reads_hidden else None  # [1, n-1, D]: the target's final hidden states
    n = input_ids.shape[1]
    last = input_ids[:, -1:]

    def target_step():
        target(last, use_cache=True, **{CACHE_NAME: cache})
        cache.crop(-1)

    def target_verify5():
        target(input_ids[:, -5:].clone(), use_cache=True, **{CACHE_NAME: cache})
        cache.crop(-5)

    reader = CacheReader(cache, None if hidden is None else lambda s, e: hidden[:, s:e])  # the target's states
    dcache = MoADrafterCache()
    drafter.extend_context(dcache, drafter.read_context(reader, 0, n - 1))
    drafter.draft_step(input_ids[:, :-1], dcache)

    def draft_token():
        drafter.draft_step(last, dcache)
        dcache.crop(n - 1)

    def lsa_3_tokens():  # what a drafting cycle does for 3 newly verified tokens: gather + LSA
        drafter.read_context(reader, n - 4, n - 1)

    result = {
        "target_decode_step_ms": _median_ms(target_step, repeats, input_ids.device),
        "target_verify_5_tokens_ms": _median_ms(target_verify5, repeats, input_ids.device),
        "drafter_token_ms": _median_ms(draft_token, repeats, input_ids.device),
        "lsa_3_verified_tokens_ms": _median_ms(lsa_3_tokens, repeats, input_ids.device),
    }
    result["drafter_token_over_target_step"] = result["drafter_token_ms"] / result["target_decode_step_ms"]
    result["exits"] = exit_costs(drafter, draft_token, result["target_decode_step_ms"], repeats)
    result["exit1_over_full_depth"] = result["exits"][0]["over_full_depth"]
    result["lsa_per_token_over_target_step"] = result["lsa_3_verified_tokens_ms"] / 3 / result["target_decode_step_ms"]
    # per-cycle overhead: wall time of assisted generate minus the time inside the two models' forwards
    t0 = time.perf_counter()
    target.generate(input_ids, max_new_tokens=gen_tokens, do_sample=False, assistant_model=drafter)
    wall = time.perf_counter() - t0
    stats = drafter.speculation_stats
    cycles = max(1, len(stats.accepted_lengths))
    result["cycles"] = cycles
    result["mean_accepted_length"] = stats.mean_accepted_length
    result["overhead_per_cycle_ms"] = 1000 * (wall - stats.draft_time_s - stats.verify_time_s) / cycles
    result["draft_time_per_cycle_ms"] = 1000 * stats.draft_time_s / cycles
    result["verify_time_per_cycle_ms"] = 1000 * stats.verify_time_s / cycles
    if drafter.tree_unsupported_reason() is None:
        result["engine"] = engine_costs(target, drafter, input_ids, gen_tokens)
    return result


@torch.no_grad()
def engine_costs(target, drafter, input_ids: torch.Tensor, gen_tokens: int = 64) -> dict:
    """The tree engine's measured costs on `input_ids` (one prompt, batch 1) and one greedy engine generation.

    `target_verify_ms[n]`: one target forward over n new tokens; `target_verify_over_decode_step[n]`: the same over the
    forward of one token (a decode step); `drafter_depth_ms[w]` and `drafter_depth_over_decode_step[w]`: one drafter
    tree step (one depth) over w nodes. They are the engine's own measurement (`measure_costs` in
    `moa_hf.modeling.custom_generate.engine`, taken on the engine's first cycle in a process and kept for its later
    calls), read from the output's `costs`. Then, from a second generation (the first one measured and warmed up):
    cycles, mean accepted length and tree size, and per cycle the draft and verify time and the rest
    (`overhead_per_cycle_ms`: the loop around the two models' forwards; `loop_per_cycle_ms`: the cycle's time outside
    the target's and the drafter's forwards, drafting's own Python included); `shape_policy`: what the engine's shape
    policy measured and chose (its arms' seconds per token and cycles, the shapes it verified).
    """
    from .modeling.custom_generate.engine import speculative_generate

    def generate():
        return speculative_generate(
            target,
            drafter,
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=gen_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )

    generate()  # the engine measures its costs on its first cycle
    t0 = time.perf_counter()
    out = generate()
    wall = time.perf_counter() - t0
    stats, costs = out.speculation_stats[0], out.costs
    if costs is None:
        raise RuntimeError("The engine reported no measured costs; it measures them on its first cycle.")
    step = costs.verify[min(costs.verify)]  # a forward over one token: a decode step
    cycles = max(1, len(stats.tree_sizes))
    return {
        "target_verify_ms": {n: 1000 * s for n, s in sorted(costs.verify.items())},
        "target_verify_over_decode_step": {n: s / step for n, s in sorted(costs.verify.items())},
        "drafter_depth_ms": {w: 1000 * s for w, s in sorted(costs.step.items())},
        "drafter_depth_over_decode_step": {w: s / step for w, s in sorted(costs.step.items())},
        "cycles": len(stats.tree_sizes),
        "mean_accepted_length": stats.mean_accepted_length,
        "mean_tree_size": sum(stats.tree_sizes) / cycles,
        "draft_time_per_cycle_ms": 1000 * stats.draft_time_s / cycles,
        "verify_time_per_cycle_ms": 1000 * stats.verify_time_s / cycles,
        "overhead_per_cycle_ms": 1000 * (wall - stats.draft_time_s - stats.verify_time_s) / cycles,
        "loop_per_cycle_ms": 1000 * stats.loop_time_s / cycles,
        "shape_policy": out.policy,
    }
