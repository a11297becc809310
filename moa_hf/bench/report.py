"""The benchmark's report: the Markdown tables (`format_markdown`) and the chart (`plot_benchmark`)."""

from __future__ import annotations

import os

from .counting import ratio
from .methods import NO_CONTEXT


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------
def format_value(value, digits: int = 2, suffix: str = "") -> str:
    """`value` with `digits` decimals and `suffix` for a Markdown table; "–" for None."""
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _settings_cell(settings: dict | None) -> str:
    """`depth 4, top-k 1, lookup off`: the tree settings given; `auto` for those the engine chooses."""
    if not settings:
        return "–"
    names = (("tree_depth", "depth"), ("tree_top_k", "top-k"), ("tree_budget", "budget"))
    cells = [f"{label} {settings[key] if settings.get(key) is not None else 'auto'}" for key, label in names]
    lookup = settings.get("lookup")
    cells.append("lookup " + ("as configured" if lookup is None else "on" if lookup else "off"))
    return ", ".join(cells)


def _engine_lines(methods: dict) -> list[str]:
    """The tree engine's methods: mean tree size, drafted tokens, draft and verify time, settings."""
    engine = {name: m for name, m in methods.items() if (m.get("info") or {}).get("engine")}
    if not engine:
        return []
    lines = [
        "",
        "### tree engine",
        "",
        "| method | acceptance length | mean tree size | drafted tokens | draft s | verify s | settings |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in engine.items():
        o = m["overall"]
        lines.append(
            f"| {name} | {format_value(o['acceptance_length'])} | {format_value(o.get('mean_tree_size'), 1)} "
            f"| {o['drafted_tokens']} | {format_value(o['draft_time_s'])} | {format_value(o.get('verify_time_s'))} "
            f"| {_settings_cell(m['info'].get('settings'))} |"
        )
    return lines


def context_share(with_context: float | None, without: float | None) -> float | None:
    """The share of a drafter's gain over plain decoding that the target's state brings: (a - a0) / (a - 1) for
    acceptance lengths a (with the context vectors) and a0 (zeroed); None where a drafter gains nothing."""
    if with_context is None or without is None or with_context <= 1.0:
        return None
    return (with_context - without) / (with_context - 1.0)


def _context_lines(methods: dict) -> list[str]:
    """Methods run also with the drafter's context vectors zeroed (`<method>_nocontext`): acceptance both ways and
    the share of the gain that comes from the target's state."""
    bases = {n: n[: -len(NO_CONTEXT)] for n in methods if n.endswith(NO_CONTEXT)}
    pairs = [(base, zeroed) for zeroed, base in bases.items() if base in methods]
    if not pairs:
        return []
    lines = [
        "",
        "### the target's state (the drafter's context vectors zeroed)",
        "",
        "| method | acceptance length | context zeroed | share of the gain from the target |",
        "|---|---:|---:|---:|",
    ]
    for name, zeroed in pairs:
        a, a0 = methods[name]["overall"]["acceptance_length"], methods[zeroed]["overall"]["acceptance_length"]
        share = context_share(a, a0)
        lines.append(
            f"| {name} | {format_value(a)} | {format_value(a0)} "
            f"| {'–' if share is None else format_value(100 * share, 0, '%')} |"
        )
    return lines


def format_exit_setting(info: dict) -> str:
    """`fixed exit 2`, or the adaptive thresholds a method (or a tuning row) drafted with: `0.80, never` (a threshold
    above 1: no token leaves there)."""
    if isinstance(info.get("exit"), int):
        return f"fixed exit {info['exit']}"
    thresholds = info.get("exit_thresholds")
    if thresholds is None:
        return "last exit"
    return ", ".join("never" if t > 1 else format_value(t) for t in thresholds)


def _exit_lines(methods: dict) -> list[str]:
    """Sorted drafters: tokens drafted at each exit per method (network tokens only), and their mean exit."""
    rows = {n: m for n, m in methods.items() if len(m["overall"].get("exit_counts") or ()) > 1}
    if not rows:
        return []
    num_exits = max(len(m["overall"]["exit_counts"]) for m in rows.values())
    exits = list(range(1, num_exits + 1))
    lines = [
        "",
        "### exits (tokens drafted by the network at each exit; prompt-lookup tokens are drafted by none)",
        "",
        "| method | exit thresholds | acceptance length | tokens/s | speedup | "
        + " | ".join(f"exit {k}" for k in exits)
        + " | mean exit |",
        "|---|---|---:|---:|---:|" + "---:|" * num_exits + "---:|",
    ]
    for name, m in rows.items():
        o, counts = m["overall"], m["overall"]["exit_counts"]
        mean_exit = ratio(sum(k * c for k, c in zip(exits, counts)), sum(counts))
        cells = [
            name,
            format_exit_setting(m.get("info") or {}),
            format_value(o["acceptance_length"]),
            format_value(o["tokens_per_s"], 1),
            format_value(o["speedup"], 2, "x"),
            *(str(c) for c in counts),
            format_value(mean_exit),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _batch_lines(rows: list[dict] | None) -> list[str]:
    """The batch section: per batch size, tokens/s of the target alone and of the engine, speedup, acceptance."""
    if not rows:
        return []
    lines = [
        "",
        "### batches (left-padded prompts of different lengths; real new tokens only, up to each row's EOS)",
        "",
        "| batch | vanilla tokens/s | engine tokens/s | speedup | acceptance length | mean tree size | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        v, e = row["vanilla"], row["engine"]
        lines.append(
            f"| {row['batch_size']} | {format_value(v['tokens_per_s'], 1)} | {format_value(e['tokens_per_s'], 1)} "
            f"| {format_value(row['speedup'], 2, 'x')} | {format_value(e['acceptance_length'])} "
            f"| {format_value(e['mean_tree_size'], 1)} | {row['identical_rows']}/{row['rows']} |"
        )
    return lines


def format_markdown(bench: dict) -> str:
    """Overall table per method, the tree engine's methods, the target's share (methods run also with the context
    zeroed), one acceptance/speedup table per category, the batch section and the losslessness check."""
    methods = bench["methods"]
    lines = [
        f"## moa bench: {bench.get('target', '')} ({bench.get('dtype', '')}, up to {bench.get('max_new_tokens')} "
        "new tokens, greedy)",
        "",
        "| method | acceptance length | tokens/s | speedup | bound | alpha | gamma | c |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        o = m["overall"]
        cells = [
            name,
            format_value(o["acceptance_length"]),
            format_value(o["tokens_per_s"], 1),
            format_value(o["speedup"], 2, "x"),
            format_value(o["theoretical_speedup"], 2, "x"),
            format_value(o["alpha"]),
            format_value(o["gamma"]),
            format_value(o["cost_ratio"], 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _engine_lines(methods)
    lines += _context_lines(methods)
    lines += _exit_lines(methods)
    categories = list(dict.fromkeys(c for m in methods.values() for c in m["per_category"]))
    for cat in categories:
        n = max((m["per_category"].get(cat, {}).get("generations", 0) for m in methods.values()), default=0)
        lines += ["", f"### {cat} ({n} generations per method)", ""]
        lines += ["| method | acceptance length | tokens/s | speedup | bound |", "|---|---:|---:|---:|---:|"]
        for name, m in methods.items():
            c = m["per_category"].get(cat)
            if c:
                lines.append(
                    f"| {name} | {format_value(c['acceptance_length'])} | {format_value(c['tokens_per_s'], 1)} "
                    f"| {format_value(c['speedup'], 2, 'x')} | {format_value(c['theoretical_speedup'], 2, 'x')} |"
                )
    lines += _batch_lines(bench.get("batch"))
    check = bench.get("check")
    if check:
        lines += ["", "### losslessness (float32, token ids vs the target alone)", ""]
        for name, entry in check.items():
            if entry["passed"]:
                lines.append(f"- {name}: PASS ({entry['questions']} questions identical)")
            else:
                first = entry["mismatches"][0]
                lines.append(
                    f"- {name}: FAIL on {len(entry['mismatches'])}/{entry['questions']} questions (first: question "
                    f"{first['question_id']}, new token {first['position']}: expected {first['expected']}, got "
                    f"{first['got']})"
                )
    hw = bench.get("hardware") or {}
    if hw:
        flags = " ".join(hw.get("cpu_flags") or []) or "none of avx2, avx512, amx"
        lines += [
            "",
            f"Hardware: {hw.get('cpu')} (CPU flags: {flags}; "
            f"{hw.get('cores')} cores, {hw.get('threads')} threads), device "
            f"{hw.get('device')}, torch {hw.get('torch')}. bound = Leviathan et al. (2023) expected improvement "
            "factor from alpha (per-token acceptance), gamma (draft tokens per cycle), c (drafter cost per "
            "drafted token / target step).",
        ]
    return "\n".join(lines) + "\n"


def plot_benchmark(bench: dict, path: str | os.PathLike) -> None:
    """A PNG with two panels, speedup and acceptance length per category (and overall), bars grouped per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = bench["methods"]
    categories = list(dict.fromkeys(c for m in methods.values() for c in m["per_category"])) + ["overall"]
    fig = Figure(figsize=(max(8.0, 1.4 * len(categories)), 7.5))
    FigureCanvasAgg(fig)
    width = 0.8 / max(1, len(methods))
    for ax, key, label in zip(
        fig.subplots(2, 1), ("speedup", "acceptance_length"), ("speedup over vanilla", "acceptance length")
    ):
        for i, (name, m) in enumerate(methods.items()):
            values = [
                (m["overall"] if cat == "overall" else m["per_category"].get(cat, {})).get(key) or 0.0
                for cat in categories
            ]
            ax.bar(
                [j + (i - (len(methods) - 1) / 2) * width for j in range(len(categories))], values, width, label=name
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel(label)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=min(6, len(methods)), frameon=False)
    fig.suptitle(f"moa bench: {bench.get('target', '')} ({bench.get('dtype', '')}, {bench['hardware']['device']})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # leave room for the legend below the panels
    fig.savefig(path, format="png", dpi=100)
