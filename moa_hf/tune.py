"""`moa tune`: measure a drafter's speculation settings (draft length, confidence threshold, schedule) on held-out
prompts and pick the fastest.

Transformers' assisted generation reads `num_assistant_tokens`, `num_assistant_tokens_schedule` and
`assistant_confidence_threshold` from the ASSISTANT's `generation_config` (`AssistedCandidateGenerator`), so each
setting is installed as a fresh copy of the drafter's config for its `generate` calls; the original config object is
put back afterwards, untouched. Every `generate` is greedy and batch 1. The plain target (no assistant) runs on the
same prompts, interleaved with the settings so that all share the machine's noise, as the speedup baseline.
Each `generate` runs on the benchmark's runner (`moa_hf.bench.generate_once`: the same timing, target-call counting
and acceptance length as `moa bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

from .bench import (
    BenchMethod,
    acceptance_length,
    drafter_method,
    format_value,
    generate_once,
    hardware_info,
    independent_method,
    vanilla_method,
)
from .modeling import LookupSettings, MoADrafterConfig
from .modeling.lookup import pop_legacy_lookup_keys

__all__ = [
    "SETTING_KEYS",
    "TuneError",
    "format_tuning_markdown",
    "register",
    "run_tune",
    "tune_speculation",
    "write_best_setting",
]

SETTING_KEYS = (
    "num_assistant_tokens",
    "assistant_confidence_threshold",
    "num_assistant_tokens_schedule",
    "lookup_num_tokens",  # MoA drafter only (0: off): its config's fields, see `moa_hf.modeling.LookupSettings`
    "lookup_min_ngram",
    "lookup_halve_per_ngram",
)
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
TUNING_FILE = "tuning.json"


class TuneError(ValueError):
    """A tuning request that cannot run as given (the message says how to fix it)."""


# ---------------------------------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _speculation_config(drafter, setting: dict | None) -> Iterator[None]:
    """Give `drafter` a copy of its generation config with `setting` for the block, and its config's lookup fields
    (MoA); the original generation config and lookup fields are put back."""
    if setting is None:
        yield
        return
    original = drafter.generation_config
    gc = copy.deepcopy(original)
    for key in SETTING_KEYS[:3]:
        setattr(gc, key, setting[key])
    lookup = _lookup_values(setting) if getattr(drafter, "supports_prompt_lookup", False) else {}
    own_lookup = {key: getattr(drafter.config, key) for key in lookup}
    drafter.generation_config = gc  # a "heuristic" schedule writes its final draft length back into this copy
    try:
        for key, value in lookup.items():
            setattr(drafter.config, key, value)
        yield
    finally:
        drafter.generation_config = original
        for key, value in own_lookup.items():
            setattr(drafter.config, key, value)


def _check_lookup(drafter, setting: dict) -> None:
    """A `TuneError` for lookup fields that the drafter's config cannot take."""
    values = {key.removeprefix("lookup_"): value for key, value in _lookup_values(setting).items()}
    try:
        dataclasses.replace(LookupSettings.from_config(drafter.config), **values)  # validates
    except ValueError as err:
        raise TuneError(f"Invalid prompt lookup setting {values} for this drafter: {err}.") from err


def _lookup_values(setting: dict) -> dict:
    """The MoA drafter config's lookup fields of `setting` (lookup off: 0 tokens, the config's own n-gram sizes)."""
    values = {
        "lookup_num_tokens": int(setting.get("lookup_num_tokens") or 0),
        "lookup_halve_per_ngram": bool(setting.get("lookup_halve_per_ngram")),
    }
    if setting.get("lookup_min_ngram") is not None:
        values["lookup_min_ngram"] = int(setting["lookup_min_ngram"])
    return values


def _setting_method(drafter, setting: dict | None, allow_other_target: bool) -> BenchMethod:
    """The benchmark method of one setting: `drafter` under `setting` (MoA/EAGLE attached to the target around each
    `generate`, any other causal LM as a plain assistant), or the target alone when `setting` is None."""
    if setting is None:
        return vanilla_method()
    if hasattr(drafter, "attached"):
        base = drafter_method("setting", drafter, allow_other_target)
    else:
        base = independent_method(drafter)

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


def _rank(row: dict) -> tuple[float, float]:
    """Best first: the highest speedup, then (ties) the highest acceptance length."""
    return row["speedup"] or 0.0, row["acceptance_length"] or 0.0


def _summary(records: list[dict], drafts: bool) -> dict:
    """Pooled over the records of one run (`moa_hf.bench.generate_once` records); `drafts`: it had a drafter."""
    tokens = sum(r["new_tokens"] for r in records)
    calls = sum(r["target_calls"] for r in records)
    seconds = sum(r["time_s"] for r in records)
    return {
        "new_tokens": tokens,
        "target_calls": calls,
        "wall_time_s": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "acceptance_length": acceptance_length(tokens, calls),
        "drafted_tokens": sum(r["drafted_tokens"] for r in records) if drafts else None,
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
    MoA drafter's prompt lookup (its config's `lookup_num_tokens`, `lookup_min_ngram`), `lookup_halving` whether
    shorter matches propose fewer tokens (`lookup_halve_per_ngram`). Returns ``{"baseline",
    "rows", "best", ...}``, best by speedup (ties: higher acceptance length). The drafter's generation config and
    lookup fields are left as they were.
    """
    prompts = [list(p) for p in prompt_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise TuneError("Give at least one prompt, each with at least one token.")
    if max_new_tokens < 1 or repeats < 1:
        raise TuneError(f"max_new_tokens and repeats must be >= 1 (got {max_new_tokens}, {repeats}).")
    settings = _grid(num_assistant_tokens, thresholds, schedules, lookup_tokens, lookup_min_ngrams, lookup_halving)
    if any(s["lookup_num_tokens"] for s in settings) and not getattr(drafter, "supports_prompt_lookup", False):
        raise TuneError(
            f"{type(drafter).__name__} has no prompt lookup of its own; tune it with lookup tokens 0 (for prompt "
            "lookup without a drafter use `target.generate(prompt_lookup_num_tokens=...)`)."
        )
    for setting in settings if getattr(drafter, "supports_prompt_lookup", False) else ():
        _check_lookup(drafter, setting)  # e.g. a minimum n-gram above the drafter's longest: refused before any run
    runs: list[dict | None] = [None, *settings]  # None: the target alone (the baseline)
    methods = [_setting_method(drafter, run, allow_other_target) for run in runs]
    inputs = [_inputs(p, target.device) for p in prompts]
    records: list[list[dict]] = [[] for _ in runs]
    outputs: dict[tuple[int, int], list[int]] = {}  # (run, prompt) -> last greedy output
    was_training = getattr(drafter, "training", False)
    drafter.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=repeats * len(prompts) * len(runs), desc="moa tune", unit="gen", disable=not progress)
    try:
        if warmup:  # one-time costs (kernels, allocator) stay out of the measurements
            for method in methods[:2]:
                generate_once(target, method, inputs[0], min(max_new_tokens, 8))
        for step, (_, p) in enumerate(itertools.product(range(repeats), range(len(prompts)))):
            shift = step % len(runs)
            for i in [*range(shift, len(runs)), *range(shift)]:
                record, out = generate_once(target, methods[i], inputs[p], max_new_tokens)
                outputs[(i, p)] = out[0, len(prompts[p]) :].tolist()
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
# Reporting, writing
# ---------------------------------------------------------------------------------------------------------------------
def _lookup_cell(row: dict) -> str:
    lookup = row.get("lookup_num_tokens") or 0
    halving = ", halving" if row.get("lookup_halve_per_ngram") else ""
    return f"{lookup} ({row.get('lookup_min_ngram')}{halving})" if lookup else "off"


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
    baseline = f"{format_value(b['acceptance_length'])} | {format_value(b['tokens_per_s'], 1)}"
    lines.append(f"| (target alone) | | | | {baseline} | 1.00x | |")
    best = result["best"]
    for row in sorted(result["rows"], key=_rank, reverse=True):
        cells = [
            str(row["num_assistant_tokens"]),
            format_value(row["assistant_confidence_threshold"]),
            row["num_assistant_tokens_schedule"],
            _lookup_cell(row),
            format_value(row["acceptance_length"]),
            format_value(row["tokens_per_s"], 1),
            format_value(row["speedup"], 2, "x"),
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
        f"lookup_num_tokens={best.get('lookup_num_tokens') or 0}"
        f"{', halving per shorter n-gram' if best.get('lookup_halve_per_ngram') else ''} "
        f"({format_value(best['speedup'], 2, 'x')}, acceptance length {format_value(best['acceptance_length'])}).",
    ]
    return "\n".join(lines)


def write_best_setting(path: str | Path, setting: dict, fallback: GenerationConfig | None = None) -> GenerationConfig:
    """Set the speculation fields of the drafter folder's `generation_config.json` to `setting` (saved in place),
    and for a MoA drafter the prompt lookup fields of its `config.json`.

    A folder without one starts from `fallback` (e.g. the loaded drafter's config).
    """
    try:
        gc = GenerationConfig.from_pretrained(str(path))
    except OSError:
        if fallback is None:
            raise
        gc = copy.deepcopy(fallback)
    for key in SETTING_KEYS[:3]:
        setattr(gc, key, setting[key])
    lookup = pop_legacy_lookup_keys(gc)  # older drafters kept prompt lookup here; it is in config.json now
    if "lookup_num_tokens" in setting:
        lookup.update(_lookup_values(setting))
    gc._from_model_config = False  # our own settings: else transformers re-derives them from the model config
    gc.save_pretrained(str(path))
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if lookup and config.get("model_type") == MoADrafterConfig.model_type:  # the MoA drafter's own prompt lookup
        config_file.write_text(json.dumps({**config, **lookup}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return gc


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _csv(kind: type):
    def parse(text: str) -> list:
        try:
            values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from err
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    return parse


def _load_prompts(args: argparse.Namespace) -> list[str]:
    """The held-out prompts of `--prompts`; Spec-Bench is refused (by name, before any loading, and by its records).

    The prompt sources (the offline `default:*` splits, files, `datasets` folders) are `moa_hf.prompts`, shared with
    `moa data`.
    """
    from .prompts import check_not_spec_bench, load_prompts

    for source in args.prompts:  # tuning on the evaluation set would be cheating: refused before any loading
        check_not_spec_bench(source)
    return [
        prompt
        for source in args.prompts
        for prompt in load_prompts(source, column=args.prompt_column, num_prompts=args.num_prompts, seed=args.seed)
    ]


def run_tune(args: argparse.Namespace) -> int:
    from .loading import drafter_kind, load_drafter, load_target
    from .prompts import format_prompts

    prompts = _load_prompts(args)
    torch.manual_seed(args.seed)
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    try:
        drafter = load_drafter(args.drafter, target=target, kind=args.kind)
    except (OSError, ValueError) as err:
        raise TuneError(f"{err} Pass the --output folder of `moa train` as --drafter.") from err
    kind = drafter_kind(drafter)
    prompt_ids = format_prompts(tokenizer, prompts)
    result = tune_speculation(
        target,
        drafter,
        prompt_ids,
        num_assistant_tokens=args.num_assistant_tokens,
        thresholds=args.thresholds,
        schedules=args.schedules,
        lookup_tokens=args.lookup_tokens,
        lookup_min_ngrams=args.lookup_min_ngrams,
        lookup_halving=[bool(h) for h in args.lookup_halve_per_ngram],
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        progress=not args.quiet,
        allow_other_target=args.allow_other_target,
    )
    result = {
        "target": getattr(target.config, "name_or_path", None) or args.target,
        "drafter": str(args.drafter),
        "kind": kind,
        "dtype": str(target.dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "hardware": hardware_info(target.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **result,
        "written": bool(args.write),
    }
    folder = Path(args.drafter)
    (folder / TUNING_FILE).write_text(json.dumps(result, indent=1))
    print(format_tuning_markdown(result))
    print(f"\nwrote {folder / TUNING_FILE}")
    if args.write:
        write_best_setting(folder, result["best"], fallback=drafter.generation_config)
        print(f"updated {folder / 'generation_config.json'} (MoA lookup: config.json) with the best setting")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `moa tune`."""
    p = subparsers.add_parser(
        "tune",
        help="pick a drafter's fastest speculation settings (draft length, confidence threshold)",
        description="Time greedy speculative decoding with the drafter for every setting of a grid on held-out "
        "prompts, against the target alone (interleaved). Prints a table, writes tuning.json into the drafter "
        "folder and, with --write, the best setting into its generation_config.json. Spec-Bench is refused.",
    )
    p.add_argument("--target", required=True, help="`default` (SmolLM2-135M-Instruct, offline), a folder or a Hub id")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="target dtype (auto: bf16 GPU, fp32 CPU)",
    )
    p.add_argument("--device", default=None, help="device of the target (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--drafter", required=True, help="drafter folder (the --output of `moa train`)")
    p.add_argument(
        "--kind",
        default="auto",
        choices=["auto", "moa", "eagle", "independent"],
        help="drafter type (auto: from the folder's config.json)",
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        default=["default:validation", "default:documents"],
        help="held-out prompt sources, --num-prompts from each: `default:validation` (chat, maths, tutorials), "
        "`default:documents` (summarise / answer from / translate a passage), a .jsonl/.txt file, a saved "
        "`datasets` folder or a dataset name (never Spec-Bench); default: both offline splits",
    )
    p.add_argument("--prompt-column", default=None, help="field/column holding the prompt")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts taken from each --prompts source")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--num-assistant-tokens",
        type=_csv(int),
        default=[2, 3, 4, 5, 6, 8],
        help="draft lengths to try, comma-separated (default: 2,3,4,5,6,8)",
    )
    p.add_argument(
        "--thresholds",
        type=_csv(float),
        default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
        help="confidence thresholds to try, comma-separated (default: 0,0.1,0.2,0.3,0.4,0.5)",
    )
    p.add_argument(
        "--schedules",
        type=_csv(str),
        default=["constant"],
        help="draft-length schedules to try: constant, heuristic, heuristic_transient (default: constant)",
    )
    p.add_argument(
        "--lookup-tokens",
        type=_csv(int),
        default=[0],
        help="MoA drafter: prompt-lookup draft lengths to try (0: off; capped by the draft length), "
        "comma-separated (default: 0)",
    )
    p.add_argument(
        "--lookup-min-ngrams",
        type=_csv(int),
        default=[1],
        help="MoA drafter: shortest n-gram match that drafts by lookup instead of the network, comma-separated "
        "(default: 1)",
    )
    p.add_argument(
        "--lookup-halve-per-ngram",
        type=_csv(int),
        default=[0],
        help="MoA drafter: 1 = a lookup match one token shorter than the longest n-gram proposes half as many "
        "tokens; values to try, comma-separated 0/1 (default: 0)",
    )
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (more: less timing noise)")
    p.add_argument(
        "--allow-other-target",
        action="store_true",
        help="attach even if the drafter records another target name (same signature)",
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="save the best setting into the drafter folder's generation_config.json (lookup: its config.json)",
    )
    p.set_defaults(func=run_tune)
