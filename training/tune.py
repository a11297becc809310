"""`moa tune`: measure a drafter's speculation settings (draft length, confidence threshold, schedule) on held-out
prompts and pick the fastest.

Transformers' assisted generation reads `num_assistant_tokens`, `num_assistant_tokens_schedule` and
`assistant_confidence_threshold` from the ASSISTANT's `generation_config` (`AssistedCandidateGenerator`), so each
setting is installed as a fresh copy of the drafter's config for its `generate` calls; the original config object is
put back afterwards, untouched. Every `generate` is greedy and batch 1. The plain target (no assistant) runs on the
same prompts, interleaved with the settings so that all share the machine's noise, as the speedup baseline.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

__all__ = [
    "SETTING_KEYS",
    "TuneError",
    "count_target_calls",
    "format_tuning_markdown",
    "load_drafter_for_tuning",
    "tune_speculation",
    "write_best_setting",
]

SETTING_KEYS = (
    "num_assistant_tokens",
    "assistant_confidence_threshold",
    "num_assistant_tokens_schedule",
    "prompt_lookup_num_tokens",  # MoA drafter only (0: off): see `MoADrafterMixin.default_generation_config`
    "prompt_lookup_min_ngram",
    "prompt_lookup_halve_per_ngram",
)
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
TUNING_FILE = "tuning.json"


class TuneError(ValueError):
    """A tuning request that cannot run as given (the message says how to fix it)."""


# ---------------------------------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class _Calls:
    n: int = 0


@contextlib.contextmanager
def count_target_calls(model: torch.nn.Module) -> Iterator[_Calls]:
    """Count `model`'s forward calls inside the block (a forward pre-hook, always removed on leaving)."""
    calls = _Calls()

    def pre_hook(module, args) -> None:
        calls.n += 1

    handle = model.register_forward_pre_hook(pre_hook)
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def _speculation_config(drafter, setting: dict | None) -> Iterator[None]:
    """Give `drafter` a copy of its generation config with `setting` for the block; the original is put back."""
    if setting is None:
        yield
        return
    original = drafter.generation_config
    gc = copy.deepcopy(original)
    for key, value in _config_values(setting, getattr(drafter, "supports_prompt_lookup", False)).items():
        setattr(gc, key, value)
    drafter.generation_config = gc  # a "heuristic" schedule writes its final draft length back into this copy
    try:
        yield
    finally:
        drafter.generation_config = original


def _config_values(setting: dict, lookup: bool) -> dict:
    """The generation-config fields of `setting`. Lookup fields only for a drafter with its own prompt lookup, and
    "off" as None: a plain causal LM's `generate` would read a 0 there as a request for transformers' prompt lookup."""
    values = {key: setting[key] for key in SETTING_KEYS[:3]}
    if lookup:
        values["prompt_lookup_num_tokens"] = setting.get("prompt_lookup_num_tokens") or None
        values["prompt_lookup_min_ngram"] = setting.get("prompt_lookup_min_ngram")
        values["prompt_lookup_halve_per_ngram"] = bool(setting.get("prompt_lookup_halve_per_ngram"))
    return values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(target: PreTrainedModel) -> int | None:
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.config.get_text_config().pad_token_id
    if pad is None:
        eos = target.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return pad


@torch.no_grad()
def _generate_once(
    target: PreTrainedModel,
    drafter,
    setting: dict | None,
    ids: Sequence[int],
    max_new_tokens: int,
    allow_other_target: bool,
) -> dict:
    """One greedy `generate` (with `drafter` under `setting`, or the target alone when `setting` is None)."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=target.device)  # [1, P]
    kwargs = {}
    attach = contextlib.nullcontext()
    if setting is not None:
        kwargs["assistant_model"] = drafter
        if hasattr(drafter, "attached"):  # MoA / EAGLE: hooks on the target only while it drafts
            attach = drafter.attached(target, allow_other_target=allow_other_target)
    with _speculation_config(drafter, setting), attach, count_target_calls(target) as calls:
        _sync(target.device)
        t0 = time.perf_counter()
        out = target.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=_pad_id(target),
            **kwargs,
        )
        _sync(target.device)
        seconds = time.perf_counter() - t0
        stats = getattr(drafter, "speculation_stats", None) if setting is not None else None
        drafted = int(stats.drafted_tokens) if stats is not None else None
    return {
        "new_tokens": int(out.shape[1] - input_ids.shape[1]),
        "target_calls": calls.n,
        "seconds": seconds,
        "drafted_tokens": drafted,
        "output": out[0, input_ids.shape[1] :].tolist(),
    }


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
                "prompt_lookup_num_tokens": lookup,
                "prompt_lookup_min_ngram": min_ngram,
                "prompt_lookup_halve_per_ngram": halve,
            }
        )
    if not settings:
        raise TuneError("The grid is empty: give at least one draft length, threshold and schedule.")
    return settings


def _rank(row: dict) -> tuple[float, float]:
    """Best first: the highest speedup, then (ties) the highest acceptance length."""
    return row["speedup"] or 0.0, row["acceptance_length"] or 0.0


def _summary(records: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in records)
    calls = sum(r["target_calls"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    drafted = [r["drafted_tokens"] for r in records]
    return {
        "new_tokens": tokens,
        "target_calls": calls,
        "wall_time_s": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "acceptance_length": tokens / calls if calls else None,
        "drafted_tokens": None if any(d is None for d in drafted) else sum(drafted),
    }


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
    `assistant_model`. For each (repeat, prompt) the baseline and all settings run back to back, in an order rotated
    from one prompt to the next. Per setting: ``tokens_per_s`` (new tokens / wall time of its `generate` calls),
    ``speedup`` (over the baseline's tokens/s), ``acceptance_length`` (new tokens / target forward calls; 1.0 for the
    baseline), ``drafted_tokens`` (MoA/EAGLE only) and ``identical_outputs`` (prompts whose greedy output equals the
    baseline's: all of them, up to low-precision rounding, as speculative decoding is lossless). A "heuristic" schedule
    starts from the setting's draft length at every prompt. `lookup_tokens` (0: off) and `lookup_min_ngrams` set the
    MoA drafter's prompt lookup (`prompt_lookup_num_tokens`, `prompt_lookup_min_ngram`), `lookup_halving` whether
    shorter matches propose fewer tokens (`prompt_lookup_halve_per_ngram`). Returns ``{"baseline",
    "rows", "best", ...}``, best by speedup (ties: higher acceptance length). The drafter's generation config is
    left as it was.
    """
    prompts = [list(p) for p in prompt_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TuneError("Give at least one prompt, each with at least one token.")
    if max_new_tokens < 1 or repeats < 1:
        raise TuneError(f"max_new_tokens and repeats must be >= 1 (got {max_new_tokens}, {repeats}).")
    settings = _grid(num_assistant_tokens, thresholds, schedules, lookup_tokens, lookup_min_ngrams, lookup_halving)
    if any(s["prompt_lookup_num_tokens"] for s in settings) and not getattr(drafter, "supports_prompt_lookup", False):
        raise TuneError(
            f"{type(drafter).__name__} has no prompt lookup of its own; tune it with lookup tokens 0 (for prompt "
            "lookup without a drafter use `target.generate(prompt_lookup_num_tokens=...)`)."
        )
    runs: list[dict | None] = [None, *settings]  # None: the target alone (the baseline)
    records: list[list[dict]] = [[] for _ in runs]
    outputs: dict[tuple[int, int], list[int]] = {}  # (run, prompt) -> last greedy output
    was_training = getattr(drafter, "training", False)
    drafter.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=repeats * len(prompts) * len(runs), desc="moa tune", unit="gen", disable=not progress)
    try:
        if warmup:  # one-time costs (kernels, allocator) stay out of the measurements
            for run in (None, settings[0]):
                _generate_once(target, drafter, run, prompts[0], min(max_new_tokens, 8), allow_other_target)
        for step, (_, p) in enumerate(itertools.product(range(repeats), range(len(prompts)))):
            shift = step % len(runs)
            for i in [*range(shift, len(runs)), *range(shift)]:
                record = _generate_once(target, drafter, runs[i], prompts[p], max_new_tokens, allow_other_target)
                outputs[(i, p)] = record.pop("output")
                records[i].append(record)
                bar.update(1)
    finally:
        bar.close()
        drafter.train(was_training)
    baseline = _summary(records[0])
    base_tps = baseline["tokens_per_s"]
    baseline["speedup"] = 1.0
    rows = []
    for i, setting in enumerate(settings, start=1):
        row = {**setting, **_summary(records[i])}
        row["speedup"] = row["tokens_per_s"] / base_tps if row["tokens_per_s"] and base_tps else None
        row["identical_outputs"] = sum(outputs[(i, p)] == outputs[(0, p)] for p in range(len(prompts)))
        rows.append(row)
    best = max(rows, key=_rank)
    return {
        "baseline": baseline,
        "rows": rows,
        "best": best,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Loading, reporting, writing
# ---------------------------------------------------------------------------------------------------------------------
def _detect_kind(path: Path) -> str:
    from moa_hf import MoADrafterConfig, EagleDrafterConfig

    config = path / "config.json"
    if not config.is_file():
        raise TuneError(f"{path} is not a saved drafter folder (no config.json); pass the --output of `moa train`.")
    model_type = json.loads(config.read_text()).get("model_type")
    return {MoADrafterConfig.model_type: "moa", EagleDrafterConfig.model_type: "eagle"}.get(model_type, "independent")


def load_drafter_for_tuning(path: str, target: PreTrainedModel, kind: str = "auto"):
    """(drafter, kind) from a folder written by `moa train`, on the target's device and in its dtype."""
    from transformers import AutoModelForCausalLM

    from moa_hf import MoADrafterModel, EagleDrafterModel

    folder = Path(path)
    detected = _detect_kind(folder)
    if kind == "auto":
        kind = detected
    elif kind != detected:
        raise TuneError(f"{folder} holds a {detected!r} drafter, not {kind!r}; pass --kind {detected} (or auto).")
    cls = {"moa": MoADrafterModel, "eagle": EagleDrafterModel}.get(kind, AutoModelForCausalLM)
    drafter = cls.from_pretrained(str(folder))  # safetensors, never remote code
    if kind == "independent":
        vocab = drafter.get_output_embeddings().weight.shape[0]
        target_vocab = target.get_output_embeddings().weight.shape[0]
        if vocab != target_vocab:
            raise TuneError(
                f"The independent drafter at {folder} has {vocab} output tokens but the target has {target_vocab}; "
                "it must share the target's tokenizer."
            )
    return drafter.to(device=target.device, dtype=target.dtype).eval(), kind


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _lookup_cell(row: dict) -> str:
    lookup = row.get("prompt_lookup_num_tokens") or 0
    halving = ", halving" if row.get("prompt_lookup_halve_per_ngram") else ""
    return f"{lookup} ({row.get('prompt_lookup_min_ngram')}{halving})" if lookup else "off"


def format_tuning_markdown(result: dict) -> str:
    """A Markdown table: the baseline, then the settings from fastest to slowest (the best in bold)."""
    n = result["num_prompts"]
    lines = [
        f"## moa tune: {n} prompts, up to {result['max_new_tokens']} new tokens, greedy, "
        f"{result['repeats']} repeat(s)",
        "",
        "| draft tokens | threshold | schedule | lookup tokens (min n-gram) | acceptance length | tokens/s | speedup "
        "| same output |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    b = result["baseline"]
    lines.append(f"| (target alone) | | | | {_fmt(b['acceptance_length'])} | {_fmt(b['tokens_per_s'], 1)} | 1.00x | |")
    best = result["best"]
    for row in sorted(result["rows"], key=_rank, reverse=True):
        cells = [
            str(row["num_assistant_tokens"]),
            _fmt(row["assistant_confidence_threshold"]),
            row["num_assistant_tokens_schedule"],
            _lookup_cell(row),
            _fmt(row["acceptance_length"]),
            _fmt(row["tokens_per_s"], 1),
            _fmt(row["speedup"], 2, "x"),
            f"{row['identical_outputs']}/{n}",
        ]
        if row is best:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Best: num_assistant_tokens={best['num_assistant_tokens']}, "
        f"assistant_confidence_threshold={best['assistant_confidence_threshold']}, "
        f"num_assistant_tokens_schedule={best['num_assistant_tokens_schedule']}, "
        f"prompt_lookup_num_tokens={best.get('prompt_lookup_num_tokens') or 0}"
        f"{', halving per shorter n-gram' if best.get('prompt_lookup_halve_per_ngram') else ''} "
        f"({_fmt(best['speedup'], 2, 'x')}, acceptance length {_fmt(best['acceptance_length'])}).",
    ]
    return "\n".join(lines)


def write_best_setting(path: str | Path, setting: dict, fallback: GenerationConfig | None = None) -> GenerationConfig:
    """Set the speculation fields of the drafter folder's `generation_config.json` to `setting` (saved in place).

    A folder without one starts from `fallback` (e.g. the loaded drafter's config).
    """
    try:
        gc = GenerationConfig.from_pretrained(str(path))
    except OSError:
        if fallback is None:
            raise
        gc = copy.deepcopy(fallback)
    for key, value in _config_values(setting, "prompt_lookup_num_tokens" in setting).items():
        setattr(gc, key, value)
    gc._from_model_config = False  # else transformers drops `prompt_lookup_min_ngram` when loading it
    gc.save_pretrained(str(path))
    return gc
