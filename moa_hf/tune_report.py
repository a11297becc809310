"""`moa tune`'s report and what it writes: the Markdown tables of a tuning run (`format_tuning_markdown`,
`format_exit_tuning_markdown`, `format_exit_agreement_markdown`) and the best setting written into a drafter's
generation config (`write_best_setting`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from transformers import GenerationConfig

from .bench import (
    format_exit_setting,
    format_value,
)
from .drafter_types import drafter_type
from .modeling.lookup import pop_legacy_lookup_keys
from .tune_settings import SETTING_KEYS, TuneError, lookup_values, rank

__all__ = [
    "format_exit_agreement_markdown",
    "format_exit_tuning_markdown",
    "format_tuning_markdown",
    "write_best_setting",
]


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
    for row in sorted(result["rows"], key=rank, reverse=True):
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


def format_exit_tuning_markdown(result: dict) -> str:
    """A Markdown table of the exit-threshold search: every step's candidates, fastest first; the best in bold."""
    n, best = result["num_prompts"], result["best"]
    exits = range(1, result["num_blocks"] + 1)
    lines = [
        f"## moa tune: exit thresholds of a {result['num_blocks']}-block drafter, {n} prompts, up to "
        f"{result['max_new_tokens']} new tokens, greedy, {result['repeats']} repeat(s)",
        "",
        "| step | exit thresholds | acceptance length | tokens/s | speedup | tokens per exit ("
        + ", ".join(str(k) for k in exits)
        + ") | same output |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for step in result["steps"]:
        b = step["baseline"]
        lines.append(
            f"| {step['step']}: target alone | | {format_value(b['acceptance_length'])} "
            f"| {format_value(b['tokens_per_s'], 1)} | 1.00x | | |"
        )
        for row in sorted(step["rows"], key=rank, reverse=True):
            cells = [
                step["step"],
                format_exit_setting(row),
                format_value(row["acceptance_length"]),
                format_value(row["tokens_per_s"], 1),
                format_value(row["speedup"], 2, "x"),
                ", ".join(map(str, row.get("exit_counts") or [])) or "–",
                f"{row['identical_outputs']}/{n}",
            ]
            if row is best:
                cells = [f"**{c}**" for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
    fixed = result["best_fixed"]
    lines += [
        "",
        f"Best: exit_thresholds={best['exit_thresholds']} ({format_value(best['speedup'], 2, 'x')}, acceptance length "
        f"{format_value(best['acceptance_length'])}); fastest fixed exit: {fixed['exit']} "
        f"({format_value(fixed['speedup'], 2, 'x')}, acceptance length {format_value(fixed['acceptance_length'])}).",
    ]
    if result.get("agreement"):
        lines += ["", format_exit_agreement_markdown(result["agreement"])]
    return "\n".join(lines)


def format_exit_agreement_markdown(agreement: dict) -> str:
    """`exit_agreement` as a Markdown table: the share of reachable drafted tokens right at each exit, overall and
    below each exit-1 confidence."""
    exits = range(1, len(agreement["top1_by_exit"]) + 1)

    def cells(values: list) -> str:
        return " | ".join(format_value(v, 3) for v in values)

    lines = [
        f"Top-1 agreement with the target, drafting at exit {agreement['drafting_exit']}: {agreement['tokens']} "
        f"reachable drafted tokens (every earlier token of their cycle right), right at any exit "
        f"{format_value(agreement['any_exit'], 3)}. A deeper exit can only pay where it is right more often than "
        "exit 1 on the tokens a threshold sends to it.",
        "",
        "| exit-1 top probability | share of tokens | " + " | ".join(f"right at exit {k}" for k in exits) + " |",
        "|---|---:|" + "---:|" * len(exits),
        f"| any | 1.000 | {cells(agreement['top1_by_exit'])} |",
    ]
    for row in agreement["below"]:
        lines.append(f"| < {row['threshold']:g} | {format_value(row['share'], 3)} | {cells(row['top1_by_exit'])} |")
    return "\n".join(lines)


def write_best_setting(path: str | Path, setting: dict, fallback: GenerationConfig | None = None) -> GenerationConfig:
    """Set the speculation fields of the drafter folder's `generation_config.json` to those in `setting` (saved in
    place), and for a MoA drafter its `config.json` fields: prompt lookup and (sorted drafters) `exit_thresholds`.

    A folder without a generation config starts from `fallback` (e.g. the loaded drafter's config).
    """
    try:
        gc = GenerationConfig.from_pretrained(str(path))
    except OSError:
        if fallback is None:
            raise
        gc = copy.deepcopy(fallback)
    for key in SETTING_KEYS[:3]:
        if key in setting:
            setattr(gc, key, setting[key])
    fields = pop_legacy_lookup_keys(gc)  # older drafters kept prompt lookup here; it is in config.json now
    if "lookup_num_tokens" in setting:
        fields.update(lookup_values(setting))
    if "exit_thresholds" in setting:
        fields["exit_thresholds"] = [float(t) for t in setting["exit_thresholds"]]
    by_target = dict(setting.get("exit_thresholds_by_target") or {})
    gc._from_model_config = False  # our own settings: else transformers re-derives them from the model config
    gc.save_pretrained(str(path))
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if by_target:  # per-target thresholds: the primary's are `exit_thresholds`, the others' in `extra_targets`
        from .modeling import PRIMARY_TARGET

        if PRIMARY_TARGET in by_target:
            fields["exit_thresholds"] = [float(t) for t in by_target.pop(PRIMARY_TARGET)]
        extra = {name: dict(spec) for name, spec in (config.get("extra_targets") or {}).items()}
        for name, thresholds in by_target.items():
            if name not in extra:
                raise TuneError(f"The drafter at {path} serves no target named {name!r}; it serves {sorted(extra)}.")
            extra[name]["exit_thresholds"] = [float(t) for t in thresholds]
        fields["extra_targets"] = extra
    elif "exit_thresholds" in fields and config.get("extra_targets"):  # one set for all: drop per-target ones
        extra = {
            n: {k: v for k, v in spec.items() if k != "exit_thresholds"} for n, spec in config["extra_targets"].items()
        }
        fields["extra_targets"] = extra
    if fields and drafter_type(config).tunable:  # a kind whose config holds tuned settings (the MoA drafter)
        config_file.write_text(json.dumps({**config, **fields}, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return gc
