"""Where the time of one drafting cycle goes: the drafter's cost per drafted token relative to one target decode step,
and the per-cycle overhead beyond the two models' forwards (transformers' assisted loop plus our glue)."""

import time

import torch
from transformers import DynamicCache

from .modeling import MoADrafterCache

__all__ = ["measure_costs"]


def _best_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]  # median


@torch.no_grad()
def measure_costs(target, drafter, input_ids: torch.Tensor, repeats: int = 20, gen_tokens: int = 64) -> dict:
    """Median timings on `input_ids` (one prompt) with the drafter attached to the target."""
    cache = DynamicCache(config=target.config)
    target(input_ids[:, :-1], past_key_values=cache, use_cache=True)
    n = input_ids.shape[1]
    last = input_ids[:, -1:]

    def target_step():
        target(last, past_key_values=cache, use_cache=True)
        cache.crop(-1)

    def target_verify5():
        target(input_ids[:, -5:].clone(), past_key_values=cache, use_cache=True)
        cache.crop(-5)

    dcache = MoADrafterCache()
    drafter.extend_context(dcache, drafter.read_context(cache, 0, n - 1))
    drafter.draft_step(input_ids[:, :-1], dcache)

    def draft_token():
        drafter.draft_step(last, dcache)
        dcache.crop(n - 1)

    def lsa_3_tokens():  # what a drafting cycle does for 3 newly verified tokens: gather + LSA
        drafter.read_context(cache, n - 4, n - 1)

    result = {
        "target_decode_step_ms": _best_ms(target_step, repeats),
        "target_verify_5_tokens_ms": _best_ms(target_verify5, repeats),
        "drafter_token_ms": _best_ms(draft_token, repeats),
        "lsa_3_verified_tokens_ms": _best_ms(lsa_3_tokens, repeats),
    }
    result["drafter_token_over_target_step"] = result["drafter_token_ms"] / result["target_decode_step_ms"]
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
    return result
