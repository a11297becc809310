"""`moa bench`: decoding methods with one target on Spec-Bench questions, per method and per category.

Every method runs greedily in the same process on the same questions, interleaved (for each question and repeat all
methods run, in an order rotated per question) so that machine noise hits them alike. Measured per method, per category
and overall: acceptance length (new tokens / target forward calls), tokens/s, speedup over `vanilla`, and the
theoretical speedup bound of Leviathan et al. (2023) from the measured acceptance, draft length and drafter cost.
`--check` re-runs every speculative method with the target in float32 and compares its token ids with plain greedy
decoding. Numbers are measured, never assumed.

Methods: `vanilla` (the target alone), `moa` / `moa_nolookup` (the MoA drafter through transformers' assisted
generation, with its prompt lookup as configured / off), `moa_tree` / `moa_tree_nolookup` / `moa_chain` (the same
drafter through the tree engine `speculative_generate`: its chosen tree settings with prompt lookup as configured,
lookup off, and a chain: top-k 1 without lookup), `eagle`, `independent` (a small causal LM) and `pld` (prompt lookup
decoding). `--batch-sizes 1,4,8` adds a batch section: left-padded batches of prompts of different lengths, batched
`target.generate` against the engine, counting only the real new tokens of each row (up to its EOS).

Sorted drafters (`num_blocks` K > 1, exits after blocks 1..K): `moa_exit1` .. `moa_exitK` draft at one fixed exit
(`fixed_exit_thresholds`) and `moa_adaptive` with the drafter's tuned `exit_thresholds` (`moa tune --write`), through
assisted generation; `moa_tree_exit1` .. `moa_tree_exitK` and `moa_tree_adaptive` the same through the tree engine
(prompt lookup as the drafter's config says, for all of them). `moa_exits` / `moa_tree_exits` name all of them at
once. Every method of a MoA drafter reports its tokens drafted per exit (`exit_counts`; prompt-lookup tokens are not
drafted by an exit). `--prompts SOURCE ...` replaces the Spec-Bench questions by natural held-out prompts
(`moa_hf.prompts.load_prompts`: `default:validation`, `default:documents`, `pydoc:heldout`, files, datasets), one
category per source.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTIVE_METHODS",
    "ALL_METHODS",
    "BenchError",
    "BenchMethod",
    "CallCounter",
    "ENGINE_METHODS",
    "acceptance_length",
    "build_methods",
    "check_lossless",
    "count_forward_calls",
    "default_questions_path",
    "engine_method",
    "engine_record",
    "exit_method_names",
    "exit_methods_of",
    "format_exit_setting",
    "format_markdown",
    "format_value",
    "generate_once",
    "hardware_info",
    "load_questions",
    "plot_benchmark",
    "prompt_questions",
    "real_new_tokens",
    "register",
    "run_batches",
    "run_benchmark",
    "solve_alpha",
    "speedup_bound",
    "summarize",
]

ALL_METHODS = (
    "vanilla",
    "moa",
    "moa_nolookup",
    "moa_tree",
    "moa_tree_nolookup",
    "moa_chain",
    "eagle",
    "independent",
    "pld",
)
# The engine's methods (`speculative_generate` with the MoA drafter) and the tree settings each passes to it; what is
# not given (None) the engine chooses from its measured costs, and lookup=None follows the drafter's config.
ENGINE_METHODS = {
    "moa_tree": {},
    "moa_tree_nolookup": {"lookup": False},
    "moa_chain": {"tree_top_k": 1, "lookup": False},
}
# Sorted drafters: the drafter's tuned `exit_thresholds` through assisted generation / the tree engine; fixed exits
# are `moa_exit<k>` / `moa_tree_exit<k>` (1 <= k <= num_blocks); the shorthands name every exit and the adaptive one.
ADAPTIVE_METHODS = {"moa_adaptive": "moa", "moa_tree_adaptive": "moa_tree"}
EXIT_SHORTHANDS = {"moa_exits": "moa", "moa_tree_exits": "moa_tree"}
_EXIT_METHOD = re.compile(r"^(moa|moa_tree)_exit(\d+)$")
# Spec-Bench groups the 80 MT-bench questions (ids 81-160) into one category.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_METRICS = ("acceptance_length", "tokens_per_s", "speedup", "theoretical_speedup")
_BUILD_HINT = {
    "moa": "train one with `moa train` (see README) or pass --moa PATH",
    "eagle": "build one with `moa train --kind eagle ...` and pass --eagle PATH",
    "independent": "build one with `moa train --kind independent ...` and pass --independent PATH",
}


class BenchError(ValueError):
    """A benchmark setting or input that cannot work; the message says how to fix it."""


# ---------------------------------------------------------------------------------------------------------------------
# Questions
# ---------------------------------------------------------------------------------------------------------------------
def default_questions_path() -> Path:
    """`<repo root>/../shared/data/spec_bench/question.jsonl`, relative to this package's repository checkout."""
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def _category(raw: str) -> str:
    return "mt_bench" if raw in MT_BENCH_CATEGORIES else raw


def load_questions(path: str | os.PathLike, per_category: int = 2, seed: int = 0) -> list[dict]:
    """Spec-Bench questions (`question_id`, `category`, `turns`): `per_category` sampled per category with `seed`
    (0 = all), as dicts {question_id, category, prompt (= turns[0])} ordered by category then id."""
    path = Path(path)
    if not path.is_file():
        raise BenchError(f"Questions file {path} does not exist. Pass a Spec-Bench question.jsonl with --questions.")
    by_category: dict[str, list[dict]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question = {
                    "question_id": row["question_id"],
                    "category": _category(str(row["category"])),
                    "prompt": str(row["turns"][0]),
                }
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
                raise BenchError(
                    f"{path}:{lineno} is not a Spec-Bench question ({type(err).__name__}: {err}); each line must be a "
                    'JSON object like {"question_id": 1, "category": "qa", "turns": ["..."]}.'
                ) from err
            by_category.setdefault(question["category"], []).append(question)
    if not by_category:
        raise BenchError(f"Questions file {path} holds no questions.")
    order = [c for c in SPEC_BENCH_CATEGORIES if c in by_category] + [
        c for c in by_category if c not in SPEC_BENCH_CATEGORIES
    ]
    rng = random.Random(seed)
    selected = []
    for cat in order:
        pool = sorted(by_category[cat], key=lambda q: str(q["question_id"]))
        if 0 < per_category < len(pool):
            pool = sorted(rng.sample(pool, per_category), key=lambda q: str(q["question_id"]))
        selected += pool
    return selected


def prompt_questions(sources: list[str], num_prompts: int | None = None, seed: int = 0) -> list[dict]:
    """Natural held-out prompts as benchmark questions, `num_prompts` from each source (`moa_hf.prompts.load_prompts`:
    `default:validation`, `pydoc:heldout`, a file, ...): dicts {question_id ("SOURCE#i"), category (the source),
    prompt}, in the order given."""
    from .prompts import load_prompts

    questions = []
    for source in sources:
        try:
            prompts = load_prompts(source, num_prompts=num_prompts, seed=seed)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise BenchError(
                f"--prompts {source}: {err} Pass a prompt source of `moa_hf.prompts.load_prompts` (e.g. "
                "default:validation, pydoc:heldout or a .jsonl file)."
            ) from err
        questions += [{"question_id": f"{source}#{i}", "category": source, "prompt": p} for i, p in enumerate(prompts)]
    return questions


# ---------------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------------
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


@contextlib.contextmanager
def _nothing(target) -> Iterator[None]:
    yield None


@dataclass
class BenchMethod:
    """One decoding method.

    `context(target)` prepares it around one `generate` call and cleans up on leaving (e.g. attaches a drafter);
    `generate_kwargs` are added to the call; `generate(target, **kwargs)` makes it (None: `target.generate(**kwargs)`)
    and returns the output ids [1, P + new] or an output with `.sequences`; `read_stats(handle, output)`, given what
    the context yielded and that output and called inside the context right after the call, returns the drafter's own
    `drafted_tokens` and `draft_time_s`, and may add record fields (the engine's tree statistics) or replace counted
    ones (`verified_draft_tokens`) (None: no drafter cost, as for `vanilla` and `pld`). `info` is recorded in the JSON.
    """

    name: str
    context: Callable[[Any], contextlib.AbstractContextManager] = _nothing
    generate_kwargs: dict = field(default_factory=dict)
    read_stats: Callable[[Any, Any], dict] | None = None
    info: dict = field(default_factory=dict)
    generate: Callable[..., Any] | None = None


def vanilla_method() -> BenchMethod:
    return BenchMethod("vanilla", info={"kind": "target alone"})


def pld_method(num_tokens: int = 10) -> BenchMethod:
    return BenchMethod(
        "pld",
        generate_kwargs={"prompt_lookup_num_tokens": num_tokens},
        info={"kind": "prompt lookup decoding", "prompt_lookup_num_tokens": num_tokens},
    )


def drafter_method(name: str, drafter, allow_other_target: bool = False, info: dict | None = None) -> BenchMethod:
    """A drafter with the MoA drafter's API (`attached(target)`, `speculation_stats`): MoA or EAGLE."""

    def context(target):
        return drafter.attached(target, allow_other_target=True) if allow_other_target else drafter.attached(target)

    def read_stats(handle, output) -> dict:
        stats = drafter.speculation_stats
        _record_active_target(info, drafter)
        record = {"drafted_tokens": int(stats.drafted_tokens), "draft_time_s": float(stats.draft_time_s)}
        return {**record, **_exit_counts(stats)}

    gc = drafter.generation_config
    info = {
        **(info or {}),
        "num_assistant_tokens": getattr(gc, "num_assistant_tokens", None),
        "assistant_confidence_threshold": getattr(gc, "assistant_confidence_threshold", None),
        "lookup_num_tokens": getattr(drafter.config, "lookup_num_tokens", None),  # MoA: its own lookup (0: off)
        **_exit_info(drafter),
    }
    return BenchMethod(name, context, {"assistant_model": drafter}, read_stats, info)


def _exit_info(drafter) -> dict:
    """A sorted drafter's depth and the exit thresholds it drafts with now (those of the active target, or an
    override; empty for drafters without exits)."""
    config = drafter.config
    if not hasattr(config, "num_blocks"):
        return {}
    thresholds = drafter.exit_thresholds_for() if hasattr(drafter, "exit_thresholds_for") else None
    return {"num_blocks": int(config.num_blocks), "exit_thresholds": None if thresholds is None else list(thresholds)}


def _exit_counts(stats) -> dict:
    """`{"exit_counts": [tokens drafted at exit 1, ..., exit K]}` of a drafter's or the engine's statistics (prompt
    lookup tokens are drafted by no exit), or {} where they have none."""
    counts = getattr(stats, "exit_counts", None)
    return {} if counts is None else {"exit_counts": [int(c) for c in counts]}


def _record_active_target(info: dict, drafter) -> None:
    """Record which of the drafter's targets (its per-target parts) served the run: `attach` selects it by the
    target's fingerprint."""
    name = getattr(drafter, "active_target", None)
    if name is not None:
        info["drafter_target"] = name
    info.update(_exit_info(drafter))  # the thresholds of the target it served


def independent_method(assistant, info: dict | None = None) -> BenchMethod:
    """An ordinary causal LM as assistant; its cost is the time of its forward calls (one per drafted token)."""

    def context(target):
        return count_forward_calls(assistant)

    def read_stats(counter: CallCounter, output) -> dict:
        return {"drafted_tokens": counter.calls, "draft_time_s": counter.seconds}

    gc = assistant.generation_config
    info = {
        **(info or {}),
        "num_assistant_tokens": getattr(gc, "num_assistant_tokens", None),
        "assistant_confidence_threshold": getattr(gc, "assistant_confidence_threshold", None),
    }
    return BenchMethod("independent", context, {"assistant_model": assistant}, read_stats, info)


def engine_record(stats) -> dict:
    """The record fields of one row's `EngineStats` (the engine's `out.speculation_stats[b]`): its target calls (the
    prefill included; the engine's one-time cost measurement is not a call of the generation), drafted tokens, draft
    and verify time, the tree nodes the target verified (`verified_draft_tokens`, summed over cycles), cycles, mean
    tree size, the drafted nodes that came from prompt lookup only and (sorted drafters) the nodes drafted per exit."""
    sizes = [int(n) for n in stats.tree_sizes]
    return {
        **_exit_counts(stats),
        "target_calls": int(stats.target_calls),
        "drafted_tokens": int(stats.drafted_tokens),
        "draft_time_s": float(stats.draft_time_s),
        "verify_time_s": float(stats.verify_time_s),
        "verified_draft_tokens": sum(sizes),
        "cycles": len(sizes),
        "mean_tree_size": _ratio(sum(sizes), len(sizes)),
        "lookup_tokens": int(stats.lookup_tokens),
        "engine_mean_accepted_length": stats.mean_accepted_length,
    }


def _costs_dict(output) -> dict | None:
    """The engine output's `costs` (seconds of a target forward over n tokens, `verify`, and of a drafter tree step
    over w nodes per row, `step`), or None where it measured none (a fixed tree shape)."""
    costs = getattr(output, "costs", None)
    return None if costs is None else costs.as_dict()


def engine_method(
    name: str, drafter, settings: dict | None = None, allow_other_target: bool = False, info: dict | None = None
) -> BenchMethod:
    """`drafter` through the tree engine, `speculative_generate(target, drafter, **settings)` (settings: `tree_depth`,
    `tree_top_k`, `tree_budget`, `lookup`; what is left out the engine chooses). The drafter is attached around the
    call, outside the timing, as for the assisted-generation methods; the engine uses that attachment."""
    from .modeling.custom_generate.engine import speculative_generate

    settings = dict(settings or {})

    def context(target):
        return drafter.attached(target, allow_other_target=allow_other_target)

    def generate(target, **kwargs):
        return speculative_generate(target, drafter, return_dict_in_generate=True, **settings, **kwargs)

    def read_stats(handle, output) -> dict:
        info["costs"] = _costs_dict(output)  # what the engine chose the tree shapes from (measured once per process)
        _record_active_target(info, drafter)
        return engine_record(output.speculation_stats[0])

    info = {
        **(info or {}),
        "engine": True,
        "settings": {key: settings.get(key) for key in ("tree_depth", "tree_top_k", "tree_budget", "lookup")},
        "lookup_num_tokens": getattr(drafter.config, "lookup_num_tokens", None),
        **_exit_info(drafter),
    }
    return BenchMethod(name, context, {}, read_stats, info, generate)


# ---------------------------------------------------------------------------------------------------------------------
# Sorted drafters: fixed exits and adaptive depth
# ---------------------------------------------------------------------------------------------------------------------
def exit_method_names(base: str, num_blocks: int, adaptive: bool = True) -> list[str]:
    """`base`_exit1 .. `base`_exitK and (with `adaptive`) `base`_adaptive; `base` is "moa" (assisted generation) or
    "moa_tree" (the tree engine)."""
    return [f"{base}_exit{k}" for k in range(1, num_blocks + 1)] + ([f"{base}_adaptive"] if adaptive else [])


def exit_methods_of(name: str) -> tuple[str, int | None] | None:
    """(base, exit) of a sorted drafter's method: base "moa" or "moa_tree", exit k (1-based; None: adaptive depth with
    the drafter's tuned thresholds); None for any other method."""
    if name in ADAPTIVE_METHODS:
        return ADAPTIVE_METHODS[name], None
    match = _EXIT_METHOD.match(name)
    return (match[1], int(match[2])) if match else None


def _sorted_config(path: str | None) -> tuple[int, list[float] | None]:
    """(num_blocks, exit_thresholds) that the MoA drafter folder's config.json records; (1, None) without one."""
    from . import default_drafter_path

    folder = Path(default_drafter_path()) if path == "default" else Path(path) if path else None
    if folder is None or not (folder / "config.json").is_file():
        return 1, None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    own = [spec.get("exit_thresholds") for spec in (config.get("extra_targets") or {}).values()]
    return int(config.get("num_blocks") or 1), config.get("exit_thresholds") or next((t for t in own if t), None)


def _set_exit(name: str, drafter, exit: int | None, target) -> None:
    """Make `drafter` draft as method `name` does: always at `exit` (`override_exit_thresholds` with
    `fixed_exit_thresholds`; read at every drafting step) or, for None, adaptively with the thresholds it has for
    `target` (its own, or the drafter's shared ones)."""
    from .modeling import fixed_exit_thresholds

    num_blocks = int(getattr(drafter.config, "num_blocks", 1) or 1)
    if exit is None:
        if num_blocks < 2 or drafter.exit_thresholds_for(drafter.target_for(target)) is None:
            raise BenchError(
                f"'{name}' drafts with the drafter's tuned exit thresholds, but it has "
                f"{'a single block (num_blocks 1)' if num_blocks < 2 else 'none (exit_thresholds is null)'}. Tune "
                "them with `moa tune --drafter PATH --write` on a drafter with num_blocks > 1, or leave "
                f"{name} out of --methods."
            )
        return
    if not 1 <= exit <= num_blocks:
        raise BenchError(
            f"'{name}': the drafter has {num_blocks} exit(s) (num_blocks {num_blocks}); use exits 1 to {num_blocks}."
        )
    if num_blocks > 1:
        drafter.override_exit_thresholds(fixed_exit_thresholds(exit, num_blocks))  # this fresh drafter's, for good


def _requested_names(methods: str | None, moa_path: str | None) -> list[str]:
    """`--methods` with the shorthands expanded; by default every method, with a sorted drafter also its exits through
    assisted generation and, once tuned, its adaptive depth through both paths."""
    num_blocks, thresholds = _sorted_config(moa_path)
    tuned = num_blocks > 1 and thresholds is not None
    if not methods:
        extra = exit_method_names("moa", num_blocks, tuned) + (["moa_tree_adaptive"] if tuned else [])
        return list(ALL_METHODS) + (extra if num_blocks > 1 else [])
    names = []
    for name in (n.strip() for n in methods.split(",") if n.strip()):
        base = EXIT_SHORTHANDS.get(name)
        names += exit_method_names(base, num_blocks, tuned) if base else [name]
    return names


def resolve_method_names(methods: str | None, paths: dict[str, str | None]) -> list[str]:
    """The method names of `--methods` (default all), `vanilla` first; errors for unknown names or missing drafters.

    `moa_exits` / `moa_tree_exits` stand for `moa_exit1` .. `moa_exitK` (`moa_tree_...`) and, when the drafter has
    tuned exit thresholds, `moa_adaptive` (`moa_tree_adaptive`); K is the --moa drafter's `num_blocks`.
    """
    names = _requested_names(methods, paths.get("moa"))
    unknown = [n for n in names if n not in ALL_METHODS and exit_methods_of(n) is None]
    if unknown:
        raise BenchError(
            f"Unknown method(s) {unknown} in --methods; choose from {','.join(ALL_METHODS)}, or for a sorted drafter "
            f"moa_exit<k>, moa_tree_exit<k>, {', '.join(ADAPTIVE_METHODS)}, {', '.join(EXIT_SHORTHANDS)}."
        )
    names = ["vanilla"] + [n for n in dict.fromkeys(names) if n != "vanilla"]  # the speedup baseline is always run
    for name in ("eagle", "independent"):
        if name in names and not paths.get(name):
            raise BenchError(
                f"Method '{name}' needs a drafter: {_BUILD_HINT[name]}, or leave it out with "
                f"--methods {','.join(n for n in names if n != name)}."
            )
    users = {"moa": ("moa", "moa_nolookup", *ENGINE_METHODS), "eagle": ("eagle",), "independent": ("independent",)}
    for kind, methods_of_kind in users.items():
        path = paths.get(kind)
        used = [n for n in names if n in methods_of_kind or (kind == "moa" and exit_methods_of(n) is not None)]
        if used and path and path != "default" and not (Path(path) / "config.json").is_file():
            raise BenchError(
                f"--{kind} {path} is not a saved model folder (no config.json there); {_BUILD_HINT[kind]}, or "
                f"leave {','.join(used)} out with --methods."
            )
    return names


def _load_drafter(kind: str, path: str, target):
    """The `kind` drafter at `path` (or `default`) on the target's device and in its dtype (`moa_hf.loading`)."""
    from .loading import load_drafter

    try:
        return load_drafter(path, target=target, kind=kind)
    except (OSError, ValueError) as err:
        raise BenchError(f"Cannot load the {kind} drafter from {path}: {err} ({_BUILD_HINT[kind]}).") from err


def _checked_drafter(name: str, kind: str, path: str | None, target, allow_other_target: bool, engine: bool = False):
    """(drafter, its folder) for `name` (a method, or the batch section): the `kind` drafter at `path` (or `default`),
    checked against the target, and with `engine` against the tree engine's drafter API."""
    from . import default_drafter_path

    if not path:
        raise BenchError(f"'{name}' needs a drafter: {_BUILD_HINT[kind]}.")
    drafter = _load_drafter(kind, path, target)
    path = str(default_drafter_path()) if path == "default" else path
    if hasattr(drafter, "check_target"):
        try:
            drafter.check_target(target, allow_other_target=allow_other_target)
        except ValueError as err:
            raise BenchError(
                f"The {name} drafter at {path} cannot serve this target: {err} Pass --{kind} PATH with a "
                "drafter for this target (or --allow-other-target if only the recorded name differs)."
            ) from err
    if engine:
        reason = drafter.tree_unsupported_reason() if hasattr(drafter, "tree_unsupported_reason") else "no tree API"
        if reason:
            raise BenchError(
                f"{name} runs the drafter at {path} through the tree engine, which cannot draft trees with it "
                f"({reason}); leave {name} out or pass --{kind} with another drafter."
            )
    return drafter, path


def build_methods(
    names: list[str],
    target,
    *,
    moa: str | None = "default",
    eagle: str | None = None,
    independent: str | None = None,
    pld_tokens: int = 10,
    allow_other_target: bool = False,
) -> list[BenchMethod]:
    """The methods `names` for `target`, their drafters loaded from the given folders in the target's dtype (one
    drafter per method: `moa_nolookup` and the exit methods change their drafter's config)."""
    methods = []
    for name in names:
        if name == "vanilla":
            methods.append(vanilla_method())
        elif name == "pld":
            methods.append(pld_method(pld_tokens))
        elif name in ("moa", "moa_nolookup", "eagle"):
            kind = "eagle" if name == "eagle" else "moa"
            drafter, path = _checked_drafter(name, kind, eagle if name == "eagle" else moa, target, allow_other_target)
            if name == "moa_nolookup":  # the same drafter with its prompt lookup off: what the network alone gives
                drafter.config.lookup_num_tokens = 0
            methods.append(drafter_method(name, drafter, allow_other_target, {"drafter": str(path)}))
        elif name in ENGINE_METHODS:  # the same MoA drafter through the tree engine
            drafter, path = _checked_drafter(name, "moa", moa, target, allow_other_target, engine=True)
            info = {"drafter": str(path)}
            methods.append(engine_method(name, drafter, ENGINE_METHODS[name], allow_other_target, info))
        elif (parsed := exit_methods_of(name)) is not None:  # a sorted drafter at one exit, or adaptive
            base, exit = parsed
            drafter, path = _checked_drafter(name, "moa", moa, target, allow_other_target, engine=base == "moa_tree")
            _set_exit(name, drafter, exit, target)
            info = {"drafter": str(path), "exit": "adaptive" if exit is None else exit}
            if base == "moa_tree":  # the engine as `moa_tree` runs it: its chosen tree settings, lookup as configured
                methods.append(engine_method(name, drafter, ENGINE_METHODS["moa_tree"], allow_other_target, info))
            else:
                methods.append(drafter_method(name, drafter, allow_other_target, info))
        elif name == "independent":
            if not independent:
                raise BenchError(f"Method 'independent' needs a drafter: {_BUILD_HINT['independent']}.")
            lm = _load_drafter("independent", independent, target)  # checks it shares the target's vocabulary
            methods.append(independent_method(lm, {"drafter": str(independent)}))
        else:
            raise BenchError(f"Unknown method '{name}'; choose from {','.join(ALL_METHODS)}.")
    return methods


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------
def _chat_text(tokenizer, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise BenchError("The target's tokenizer has no chat template; use an instruction-tuned target.")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def _encode(tokenizer, prompt: str, device) -> dict:
    enc = tokenizer(_chat_text(tokenizer, prompt), return_tensors="pt", add_special_tokens=False)  # template: specials
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def _encode_batch(tokenizer, prompts: list[str], device) -> dict:
    """`input_ids` and `attention_mask` [B, P] of the chat-formatted prompts, left-padded to the longest."""
    if tokenizer.pad_token_id is None:
        raise BenchError(
            "The target's tokenizer has no pad token, which the batch section needs to left-pad its prompts; save the "
            "tokenizer with one (e.g. tokenizer.pad_token = tokenizer.eos_token) or leave out --batch-sizes."
        )
    texts = [_chat_text(tokenizer, p) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(target) -> int | None:
    """The target's pad token id, else its (first) eos id: passed to `generate` so that it does not warn."""
    pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.config.get_text_config().pad_token_id
    if pad is None:
        eos = target.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
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
    encoded = [_encode(tokenizer, q["prompt"], target.device) for q in questions]
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
            inputs = _encode(tokenizer, question["prompt"], target.device)
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
def _eos_ids(target) -> list[int]:
    """The ids `generate` stops a row at: the generation config's EOS ids (none: it stops only at the length)."""
    eos = target.generation_config.eos_token_id
    return [] if eos is None else [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


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
        entry["tokens_per_s"] = _ratio(entry["new_tokens"], entry["time_s"])
    engine["acceptance_length"] = acceptance_length(engine["new_tokens"], engine["target_calls"])
    engine["mean_tree_size"] = _ratio(engine.pop("tree_nodes"), engine["cycles"])
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
    from .modeling.custom_generate.engine import speculative_generate

    if not questions:
        raise BenchError("No questions to run.")
    if not batch_sizes or min(batch_sizes) < 1:
        raise BenchError(f"--batch-sizes must be positive integers, e.g. 1,4,8 (got {batch_sizes}).")
    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": _pad_id(target)}
    settings = dict(settings or {})
    eos = _eos_ids(target)

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
            encoded = [_encode_batch(tokenizer, p, target.device) for p in prompts]
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
                        costs = _costs_dict(out)
                    bar.update(1)
                if rep == 0:
                    identical += sum(a == b for a, b in zip(answers["vanilla"], answers["engine"]))
            totals["engine"].update(settings=settings, costs=costs)
            widths = [int(n) for batch in encoded for n in batch["attention_mask"].sum(-1)]
            rows.append(_batch_row(size, len(prompts), widths, totals, identical))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------------
def _expected_length(alpha: float, gamma: float) -> float:
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
        lo, hi = (mid, hi) if _expected_length(mid, gamma) < acceptance_length else (lo, mid)
    return (lo + hi) / 2


def speedup_bound(alpha: float, gamma: float, cost_ratio: float) -> float:
    """Expected improvement factor (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (Leviathan et al. 2023)."""
    return _expected_length(alpha, gamma) / (gamma * cost_ratio + 1.0)


def _ratio(a: float, b: float) -> float | None:
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
    return _ratio(new_tokens, target_calls)


def _group_metrics(rows: list[dict], vanilla_rows: list[dict]) -> dict:
    new = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["time_s"] for r in rows)
    calls = sum(r["target_calls"] for r in rows)
    drafted = sum(r["drafted_tokens"] for r in rows)
    draft_s = sum(r["draft_time_s"] for r in rows)
    verified = sum(r["verified_draft_tokens"] for r in rows)
    tps = _ratio(new, seconds)
    vanilla_tps = _ratio(sum(r["new_tokens"] for r in vanilla_rows), sum(r["time_s"] for r in vanilla_rows))
    step_s = _ratio(sum(r["time_s"] for r in vanilla_rows), sum(r["new_tokens"] for r in vanilla_rows))
    acceptance = acceptance_length(new, calls)
    gamma = _ratio(verified, calls) or 0.0  # mean draft length per verification cycle
    per_draft_s = _ratio(draft_s, drafted) or 0.0
    cost = per_draft_s / step_s if step_s else 0.0
    alpha = solve_alpha(acceptance, gamma) if acceptance is not None else None
    engine = [r for r in rows if "cycles" in r]  # the engine's methods: tree statistics
    exits = [r["exit_counts"] for r in rows if r.get("exit_counts") is not None]  # MoA drafters: tokens per exit
    return {
        "acceptance_length": acceptance,
        "tokens_per_s": tps,
        "speedup": _ratio(tps, vanilla_tps) if tps is not None and vanilla_tps is not None else None,
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
        "mean_tree_size": _ratio(sum(r["verified_draft_tokens"] for r in engine), sum(r["cycles"] for r in engine)),
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
        "overall": _group_metrics(mine, vanilla),
        "per_category": {
            cat: _group_metrics(
                [r for r in mine if r["category"] == cat], [r for r in vanilla if r["category"] == cat]
            )
            for cat in categories
        },
    }


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------
def hardware_info(device: torch.device | str = "cpu") -> dict:
    """cpu model, cores, torch version, device ("cpu" or the CUDA device name) and torch threads."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "torch": torch.__version__,
        "device": name,
        "threads": torch.get_num_threads(),
    }


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
        mean_exit = _ratio(sum(k * c for k, c in zip(exits, counts)), sum(counts))
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
    """Overall table per method, the tree engine's methods, one acceptance/speedup table per category, the batch
    section and the losslessness check."""
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
        lines += [
            "",
            f"Hardware: {hw.get('cpu')} ({hw.get('cores')} cores, {hw.get('threads')} threads), device "
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


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _load_target(spec: str, dtype: torch.dtype, device: str):
    """`default` or a local folder, never downloaded (`moa_hf.loading.load_target`)."""
    from .loading import load_target

    try:
        return load_target(spec, dtype=dtype, device=device, local_files_only=True)
    except (OSError, ValueError) as err:
        raise BenchError(f"--target {spec}: {err} (`default` is SmolLM2-135M-Instruct).") from err


def _main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchError as err:
        print(f"moa bench: error: {err}", file=sys.stderr)
        return 2


def _parse_batch_sizes(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise BenchError(f"--batch-sizes {text!r} is not a comma list of integers (e.g. 1,4,8).") from err
    if not sizes or min(sizes) < 1:
        raise BenchError(f"--batch-sizes {text!r}: give positive batch sizes, e.g. 1,4,8.")
    return list(dict.fromkeys(sizes))


def _run(args: argparse.Namespace) -> int:
    from .loading import default_device, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = {"moa": args.moa, "eagle": args.eagle, "independent": args.independent}
    names = resolve_method_names(args.methods, paths)
    batch_sizes = _parse_batch_sizes(args.batch_sizes)
    questions_path = None
    if args.prompts:  # natural held-out prompts instead of Spec-Bench
        if args.questions:
            raise BenchError("Give --questions (Spec-Bench) or --prompts (natural held-out prompts), not both.")
        questions = prompt_questions(args.prompts, args.num_prompts, args.seed)
    else:
        questions_path = Path(args.questions) if args.questions else default_questions_path()
        if not args.questions and not questions_path.is_file():
            raise BenchError(
                f"No Spec-Bench questions at the default {questions_path}; pass --questions PATH (a question.jsonl) "
                "or --prompts SOURCE (natural held-out prompts)."
            )
        questions = load_questions(questions_path, args.questions_per_category, args.seed)
    if args.output:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise BenchError("--output writes bench.png with matplotlib: pip install matplotlib") from err
    device = args.device or default_device()
    dtype = parse_dtype(args.dtype)
    torch.manual_seed(args.seed)
    target, tokenizer = _load_target(args.target, dtype, device)
    method_kw = dict(
        moa=args.moa,
        eagle=args.eagle,
        independent=args.independent,
        pld_tokens=args.pld_tokens,
        allow_other_target=args.allow_other_target,
    )
    methods = build_methods(names, target, **method_kw)
    print(
        f"moa bench: {len(questions)} questions x {args.repeats} repeats x methods {','.join(names)}", file=sys.stderr
    )
    result = run_benchmark(
        target,
        tokenizer,
        questions,
        methods,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        repeats=args.repeats,
        progress=not args.no_progress,
    )
    from .modeling import target_fingerprint

    bench = {
        "hardware": hardware_info(target.device),
        "target": str(getattr(target.config, "name_or_path", "") or args.target),
        "target_spec": args.target,
        "target_fingerprint": target_fingerprint(target),  # which of a drafter's targets this run measured
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers": __import__("transformers").__version__,
        "questions": None if questions_path is None else str(questions_path),
        "questions_per_category": None if questions_path is None else args.questions_per_category,
        "prompts": args.prompts,
        "num_prompts": args.num_prompts if args.prompts else None,
        "question_ids": [q["question_id"] for q in questions],
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "methods": result["methods"],
        "records": result["records"],
    }
    if batch_sizes:
        drafter, _ = _checked_drafter("--batch-sizes", "moa", args.moa, target, args.allow_other_target, engine=True)
        bench["batch"] = run_batches(
            target,
            tokenizer,
            questions,
            drafter,
            batch_sizes,
            max_new_tokens=args.max_new_tokens,
            warmup=args.warmup,
            repeats=args.repeats,
            allow_other_target=args.allow_other_target,
            progress=not args.no_progress,
        )
    failed = []
    if args.check:
        target32, tok32 = (
            (target, tokenizer) if dtype == torch.float32 else _load_target(args.target, torch.float32, device)
        )
        methods32 = build_methods(names, target32, **method_kw)
        bench["check"] = check_lossless(
            target32, tok32, questions, methods32, max_new_tokens=args.max_new_tokens, progress=not args.no_progress
        )
        failed = [name for name, entry in bench["check"].items() if not entry["passed"]]
    markdown = format_markdown(bench)
    print(markdown)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(markdown)
        plot_benchmark(bench, out / "bench.png")
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}", file=sys.stderr)
    if failed:
        for name in failed:
            first = bench["check"][name]["mismatches"][0]
            print(
                f"moa bench --check: {name} is NOT lossless: question {first['question_id']} differs from the target "
                f"alone first at new token {first['position']}",
                file=sys.stderr,
            )
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="Benchmark decoding methods (vanilla, moa, the tree engine, eagle, independent, pld) on Spec-Bench.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="SOURCE",
        help="natural held-out prompts instead of Spec-Bench, one category per source: default:validation, "
        "default:documents, pydoc:heldout (the `default:pydoc` target's held-out API names), a .jsonl/.txt file ...",
    )
    p.add_argument("--num-prompts", type=int, default=8, help="with --prompts: prompts taken from each source")
    p.add_argument(
        "--target",
        default="default",
        help="a local model folder, `default` (SmolLM2-135M-Instruct) or `default:NAME` (a shipped fine-tune of it)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--questions-per-category", type=int, default=2, help="sampled with --seed; 0 = all")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded generations per method before measuring")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list (default all: {','.join(ALL_METHODS)}; a sorted --moa drafter adds moa_exit1..K and, once "
        "tuned, moa_adaptive and moa_tree_adaptive); sorted drafters also: moa_tree_exit<k>, and the shorthands "
        "moa_exits / moa_tree_exits (every exit and the adaptive depth)",
    )
    p.add_argument("--moa", default="default", help="MoA drafter folder, or `default` (the shipped drafter)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter folder (`moa train --kind eagle`)")
    p.add_argument("--independent", default=None, help="independent causal-LM drafter folder (`--kind independent`)")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt lookup decoding: tokens drafted per cycle")
    p.add_argument("--allow-other-target", action="store_true", help="attach drafters recorded for another target")
    p.add_argument("--output", default=None, help="folder for bench.json, bench.md and bench.png")
    p.add_argument("--check", action="store_true", help="also check losslessness in float32 (exit 1 on a difference)")
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="also a batch section, e.g. 1,4,8: left-padded batches, batched target.generate vs the tree engine "
        "(with the --moa drafter); off by default",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_main)
