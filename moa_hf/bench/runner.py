"""Running the benchmark and counting: one generation of one method with its target calls and time
(`generate_once`), the interleaved run over questions and methods, the lossless check, the batch section, and the
metrics (acceptance length, speedup, the theoretical bound)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import time

import torch

from ..chat import encode_chat, eos_token_ids
from ..modeling.custom_generate.engine import speculative_generate
from .counting import acceptance_length, count_forward_calls, ratio, summarize
from .data import BenchError
from .methods import BenchMethod, costs_dict


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(target) -> int | None:
    """The target's pad token id, else its (first) eos id: passed to `generate` so that it does not warn."""
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.config.get_text_config().pad_token_id
    if pad is None:
        pad = next(iter(eos_token_ids(target)), None)
    return pad


@torch.no_grad()
def generate_once(target, method: BenchMethod, inputs: dict, max_new_tokens: int) -> tuple[dict, torch.Tensor]:
    """One greedy batch-1 `generate` with `method`, timed and with the target's forward calls counted.

    `inputs`: `input_ids` [1, P] and `attention_mask` [1, P]. Returns (record, output ids [1, P + new]); the record
    holds `new_tokens`, `time_s`, `target_calls` (the prefill included), `verified_draft_tokens`, `drafted_tokens`
    and `draft_time_s` (0 without a drafter), ... (see `acceptance_length` for what they give), plus what the
    method's `read_stats` adds (the engine's methods: `verify_time_s`, `cycles`, `mean_tree_size`, ...).
    """
    prompt_len = inputs["input_ids"].shape[1]
    generate = target.generate if method.generate is None else functools.partial(method.generate, target)
    with method.context(target) as handle, count_forward_calls(target) as counter:
        _sync(target.device)
        t0 = time.perf_counter()
        out = generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=_pad_id(target),
            **method.generate_kwargs,
        )
        _sync(target.device)
        elapsed = time.perf_counter() - t0
        drafter = method.read_stats(handle, out) if method.read_stats is not None else {}
    ids = getattr(out, "sequences", out)  # [1, P + new]
    # each target call after the first re-feeds the last verified token, then the drafted tokens it verifies
    verified = counter.fed_tokens - prompt_len - max(0, counter.calls - 1)
    record = {
        "method": method.name,
        "prompt_tokens": prompt_len,
        "new_tokens": int(ids.shape[1] - prompt_len),
        "time_s": elapsed,
        "target_calls": counter.calls,
        "target_time_s": counter.seconds,
        "verified_draft_tokens": int(max(0, verified)),
        "drafted_tokens": 0,
        "draft_time_s": 0.0,
        **drafter,
    }
    return record, ids


def _check_methods(methods: list[BenchMethod]) -> None:
    names = [m.name for m in methods]
    if "vanilla" not in names:
        raise BenchError("The methods must include 'vanilla' (the speedup baseline).")
    if len(set(names)) != len(names):
        raise BenchError(f"Method names must be unique, got {names}.")


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit="gen")


def run_benchmark(
    target,
    tokenizer,
    questions: list[dict],
    methods: list[BenchMethod],
    *,
    max_new_tokens: int = 128,
    warmup: int = 1,
    repeats: int = 1,
    progress: bool = True,
) -> dict:
    """Run every method on every question `repeats` times, interleaved; returns {"methods": summary, "records": raw}.

    `questions`: dicts with `question_id`, `category`, `prompt` (see `load_questions`). One method must be `vanilla`.
    """
    _check_methods(methods)
    if not questions:
        raise BenchError("No questions to run.")
    if repeats < 1:
        raise BenchError(f"repeats must be at least 1, got {repeats}.")
    encoded = [encode_chat(tokenizer, q["prompt"], target.device) for q in questions]
    for method in methods:
        for _ in range(warmup):
            generate_once(target, method, encoded[0], max_new_tokens)
    records = []
    bar = _progress(len(questions) * repeats * len(methods), "moa bench", progress)
    with bar:
        for qi, (question, inputs) in enumerate(zip(questions, encoded)):
            for rep in range(repeats):
                shift = (qi * repeats + rep) % len(methods)
                order = methods[shift:] + methods[:shift]  # rotated per question and repeat
                batch, outputs = [], {}
                for position, method in enumerate(order):
                    record, out = generate_once(target, method, inputs, max_new_tokens)
                    record.update(
                        question_id=question["question_id"], category=question["category"], repeat=rep, order=position
                    )
                    batch.append(record)
                    outputs[method.name] = out
                    bar.update(1)
                for record in batch:
                    record["matches_vanilla"] = bool(torch.equal(outputs[record["method"]], outputs["vanilla"]))
                records += batch
    names = [m.name for m in methods]
    return {
        "methods": {
            name: {**summarize(records, name), "info": next(m.info for m in methods if m.name == name)}
            for name in names
        },
        "records": records,
    }


@torch.no_grad()
def check_lossless(
    target, tokenizer, questions: list[dict], methods: list[BenchMethod], *, max_new_tokens: int, progress: bool = True
) -> dict:
    """Greedy token ids of every method but `vanilla` vs the target alone on each question (run the target in
    float32): {method: {"passed", "questions", "mismatches": [{question_id, position, expected, got}]}}."""
    spec = [m for m in methods if m.name != "vanilla"]
    result = {m.name: {"passed": True, "questions": 0, "mismatches": []} for m in spec}
    bar = _progress(len(questions) * (len(spec) + 1), "moa bench --check (float32)", progress)
    with bar:
        for question in questions:
            inputs = encode_chat(tokenizer, question["prompt"], target.device)
            ref = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)[0].tolist()
            bar.update(1)
            for method in spec:
                _, out = generate_once(target, method, inputs, max_new_tokens)
                got = out[0].tolist()
                entry = result[method.name]
                entry["questions"] += 1
                if got != ref:
                    prompt_len = inputs["input_ids"].shape[1]
                    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                    entry["passed"] = False
                    entry["mismatches"].append(
                        {
                            "question_id": question["question_id"],
                            "position": pos - prompt_len,  # among the new tokens
                            "expected": ref[pos] if pos < len(ref) else None,
                            "got": got[pos] if pos < len(got) else None,
                        }
                    )
                bar.update(1)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------------
def real_new_tokens(sequences: torch.Tensor, prompt_width: int, eos_ids: list[int]) -> list[int]:
    """Per row of `sequences` [B, P + N], its real new tokens: up to and including its first EOS (all N without one).
    What a row that finished before the others holds after its EOS is padding, not tokens."""
    new = sequences[:, prompt_width:]  # [B, N]
    if not eos_ids:
        return [new.shape[1]] * new.shape[0]
    is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device)).int()  # [B, N]
    after_eos = (is_eos.cumsum(-1) - is_eos) > 0  # [B, N]: strictly after the row's first EOS
    return (~after_eos).sum(-1).tolist()


def _batches(questions: list[dict], size: int) -> list[list[str]]:
    """The questions' prompts in groups of `size`, in order; the last group wraps around to the first questions."""
    n = len(questions)
    return [[questions[(start + j) % n]["prompt"] for j in range(size)] for start in range(0, n, size)]


def _batch_totals(engine: bool) -> dict:
    totals = {"new_tokens": 0, "time_s": 0.0}
    if engine:
        totals.update(target_calls=0, batch_calls=0, drafted_tokens=0, tree_nodes=0, cycles=0)
        totals.update(draft_time_s=0.0, verify_time_s=0.0)
    return totals


def _add_engine_stats(totals: dict, stats: list) -> None:
    """Add one batch's `EngineStats` (one per row) to `totals`: per-row calls, drafted and verified nodes summed over
    rows; the batch's target forwards and times are those of its longest-running row (its rows share them)."""
    for row in stats:
        totals["target_calls"] += int(row.target_calls)
        totals["drafted_tokens"] += int(row.drafted_tokens)
        totals["tree_nodes"] += sum(int(n) for n in row.tree_sizes)
        totals["cycles"] += len(row.tree_sizes)
    totals["batch_calls"] += max(int(row.target_calls) for row in stats)
    totals["draft_time_s"] += max(float(row.draft_time_s) for row in stats)
    totals["verify_time_s"] += max(float(row.verify_time_s) for row in stats)


def _batch_row(size: int, batches: int, prompt_widths: list[int], totals: dict, identical: int) -> dict:
    vanilla, engine = totals["vanilla"], totals["engine"]
    for entry in (vanilla, engine):
        entry["tokens_per_s"] = ratio(entry["new_tokens"], entry["time_s"])
    engine["acceptance_length"] = acceptance_length(engine["new_tokens"], engine["target_calls"])
    engine["mean_tree_size"] = ratio(engine.pop("tree_nodes"), engine["cycles"])
    speedup = None
    if engine["tokens_per_s"] is not None and vanilla["tokens_per_s"]:
        speedup = engine["tokens_per_s"] / vanilla["tokens_per_s"]
    return {
        "batch_size": size,
        "batches": batches,
        "rows": batches * size,
        "prompt_tokens": {"min": min(prompt_widths), "max": max(prompt_widths)},
        "vanilla": vanilla,
        "engine": engine,
        "speedup": speedup,
        "identical_rows": identical,
    }


@torch.no_grad()
def run_batches(
    target,
    tokenizer,
    questions: list[dict],
    drafter,
    batch_sizes: list[int],
    *,
    max_new_tokens: int = 128,
    warmup: int = 1,
    repeats: int = 1,
    settings: dict | None = None,
    allow_other_target: bool = False,
    progress: bool = True,
) -> list[dict]:
    """Batched greedy decoding, the target alone against the engine, one row per batch size.

    For each size the questions' prompts (of different lengths) go in left-padded batches of that size (the last one
    wraps around to the first questions); on each batch `target.generate` and the engine
    (`speculative_generate(target, drafter, **batch, **settings)`; settings: the tree settings `tree_depth`,
    `tree_top_k`, `tree_budget`, `lookup`, by default none: the engine chooses) run back to back, in an order that
    alternates per batch and repeat. Only real new tokens count (`real_new_tokens`: up to each row's EOS). A row:
    `batch_size`, `batches`, `rows`, `prompt_tokens` {min, max} (real prompt lengths), `vanilla` and `engine`
    {new_tokens, time_s, tokens_per_s} (the engine also `acceptance_length` = its real new tokens / the target calls
    of its rows, pooled, `target_calls` (summed over rows), `batch_calls` (the target forwards of the batches),
    `drafted_tokens`, `mean_tree_size` (drafted nodes verified per row and cycle), `cycles`, `draft_time_s`,
    `verify_time_s`, `settings`, `costs`: the measured costs it chose each cycle's tree shape from), `speedup` and
    `identical_rows` (rows whose tokens are the same for both: all of them in float32, up to rounding ties). The
    warm-up runs absorb the engine's one-time cost measurement per batch size.
    """

    if not questions:
        raise BenchError("No questions to run.")
    if not batch_sizes or min(batch_sizes) < 1:
        raise BenchError(f"--batch-sizes must be positive integers, e.g. 1,4,8 (got {batch_sizes}).")
    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": _pad_id(target)}
    settings = dict(settings or {})
    eos = eos_token_ids(target)

    def run(name: str, batch: dict):
        """(output ids [B, P + N], the engine's output or None, seconds); the drafter attached outside the timing, as
        in the per-question methods."""
        attach = drafter.attached(target, allow_other_target=allow_other_target) if name == "engine" else None
        with attach or contextlib.nullcontext():
            _sync(target.device)
            t0 = time.perf_counter()
            if name == "engine":
                out = speculative_generate(
                    target, drafter, **batch, return_dict_in_generate=True, **settings, **kwargs
                )
                ids = out.sequences
            else:
                ids, out = target.generate(**batch, **kwargs), None
            _sync(target.device)
            return ids, out, time.perf_counter() - t0

    rows = []
    groups = {size: _batches(questions, size) for size in batch_sizes}
    bar = _progress(sum(len(g) for g in groups.values()) * repeats * 2, "moa bench --batch-sizes", progress)
    with bar:
        for size, prompts in groups.items():
            encoded = [encode_chat(tokenizer, p, target.device) for p in prompts]
            for _ in range(warmup):
                for name in ("vanilla", "engine"):
                    run(name, encoded[0])
            totals = {"vanilla": _batch_totals(False), "engine": _batch_totals(True)}
            identical, costs = 0, None
            for step, (rep, batch) in enumerate(itertools.product(range(repeats), encoded)):
                width = batch["input_ids"].shape[1]
                answers = {}
                for name in ("vanilla", "engine") if step % 2 == 0 else ("engine", "vanilla"):
                    ids, out, seconds = run(name, batch)
                    counts = real_new_tokens(ids, width, eos)
                    totals[name]["new_tokens"] += sum(counts)
                    totals[name]["time_s"] += seconds
                    answers[name] = [ids[b, width : width + n].tolist() for b, n in enumerate(counts)]
                    if out is not None:
                        _add_engine_stats(totals["engine"], out.speculation_stats)
                        costs = costs_dict(out)
                    bar.update(1)
                if rep == 0:
                    identical += sum(a == b for a, b in zip(answers["vanilla"], answers["engine"]))
            totals["engine"].update(settings=settings, costs=costs)
            widths = [int(n) for batch in encoded for n in batch["attention_mask"].sum(-1)]
            rows.append(_batch_row(size, len(prompts), widths, totals, identical))
    return rows
