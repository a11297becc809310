"""The benchmark's decoding methods (`BenchMethod`: vanilla, the MoA drafter through assisted generation or the
tree engine, EAGLE, an independent assistant, prompt lookup), sorted drafters' fixed and adaptive exits, and
resolving `--methods` into methods with their drafters loaded.

Which methods run which kind of drafter is the drafter-type registry's (`DrafterType.bench_methods`, in
`moa_hf.drafter_types`); this file says only how a method runs: through assisted generation (a drafter with the MoA
drafter's API, or for the fallback kind any causal LM), with config overrides (`CONFIG_OVERRIDES`), or through the
tree engine (`ENGINE_METHODS`)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import default_drafter_path
from ..drafter_types import DrafterType, drafter_type, drafter_types
from ..loading import load_drafter
from ..modeling import fixed_exit_thresholds
from ..modeling.custom_generate.engine import speculative_generate
from .counting import CallCounter, count_forward_calls, ratio
from .data import BenchError

# A drafter's assisted-generation methods that change its config (the same drafter with its prompt lookup off: what
# the network alone gives).
CONFIG_OVERRIDES = {"moa_nolookup": {"lookup_num_tokens": 0}}
# The engine's methods (`speculative_generate` with the MoA drafter) and the tree settings each passes to it; what is
# not given (None) the engine chooses from its measured costs, and lookup=None follows the drafter's config.
ENGINE_METHODS = {
    "moa_tree": {},
    "moa_tree_nolookup": {"lookup": False},
    "moa_chain": {"tree_top_k": 1, "lookup": False},
}
# The tree engine's method the batch section (`--batch-sizes`) compares with batched `target.generate`.
BATCH_METHOD = "moa_tree"
# Sorted drafters (`DrafterType.sorted_exits`): the drafter's tuned `exit_thresholds` through assisted generation / the
# tree engine are `<base>_adaptive`, fixed exits `<base>_exit<k>` (1 <= k <= num_blocks), and the shorthand
# `<base>_exits` names every exit and the adaptive one; the bases are the kind's first assisted method and its engine
# method with the engine's own settings (`moa`, `moa_tree`).
_EXIT_METHOD = re.compile(r"^(\w+)_exit(\d+)$")
# Variants of any drafter method, written after its name: `@DEPTHxTOP_KxBUDGET` fixes an engine method's tree shape
# (`moa_tree_nolookup@6x8x24`), and `_nocontext` runs a MoA method with the drafter's context vectors zeroed
# (`moa_nolookup_nocontext`, `moa_tree_nolookup@6x8x24_nocontext`): what the drafter accepts without the target's
# state, which the report sets against the same method with it (the share of the gain that comes from the target).
# `_tokenwise` runs a block drafter (`block_size` k > 1) as a chain drafter, one forward per drafted token, with the
# same weights (`moa_nolookup_tokenwise`, `moa_tree_nolookup@6x8x24_tokenwise`): its block against its own chain.
_SHAPE = re.compile(r"^(.+)@(\d+)x(\d+)x(\d+)$")
NO_CONTEXT = "_nocontext"
TOKENWISE = "_tokenwise"


@dataclass(frozen=True)
class MethodVariant:
    """What a method name asks beyond its base method: `name` without the variants, the engine's fixed tree `shape`
    ({"tree_depth", "tree_top_k", "tree_budget"}, None: the method's own) and `no_context` (context vectors zeroed)."""

    name: str
    shape: dict | None = None
    no_context: bool = False
    tokenwise: bool = False


def method_variant(name: str) -> MethodVariant:
    """`name` split into its base method and its variants (`_nocontext` last, `_tokenwise` before it, `@DxKxB`
    before that); a name without them is its own base."""
    no_context = name.endswith(NO_CONTEXT)
    base = name[: -len(NO_CONTEXT)] if no_context else name
    tokenwise = base.endswith(TOKENWISE)
    base = base[: -len(TOKENWISE)] if tokenwise else base
    match = _SHAPE.match(base)
    if match is None:
        return MethodVariant(base, None, no_context, tokenwise)
    depth, top_k, budget = (int(match[i]) for i in (2, 3, 4))
    shape = {"tree_depth": depth, "tree_top_k": top_k, "tree_budget": budget}
    return MethodVariant(match[1], shape, no_context, tokenwise)


def all_methods() -> tuple[str, ...]:
    """Every method name (sorted drafters' exits aside): vanilla, each registered kind's `bench_methods`, pld."""
    return ("vanilla", *(name for record in drafter_types() for name in record.bench_methods), "pld")


def _exit_bases(record: DrafterType) -> tuple[str, ...]:
    """(assisted, engine) base methods of a sorted kind's exit methods; () for other kinds."""
    if not record.sorted_exits:
        return ()
    engine = [n for n in record.bench_methods if ENGINE_METHODS.get(n) == {}]
    return (record.bench_methods[0], *engine[:1])


def _bases_by_suffix(suffix: str) -> dict[str, str]:
    return {f"{base}{suffix}": base for record in drafter_types() for base in _exit_bases(record)}


ADAPTIVE_METHODS = _bases_by_suffix("_adaptive")  # {"moa_adaptive": "moa", "moa_tree_adaptive": "moa_tree"}
EXIT_SHORTHANDS = _bases_by_suffix("_exits")  # {"moa_exits": "moa", "moa_tree_exits": "moa_tree"}


def method_kind(name: str) -> str | None:
    """The kind of drafter method `name` runs (exit methods and variants: their base's), None for vanilla, pld and
    unknown names."""
    name = method_variant(name).name
    parsed = exit_methods_of(name)
    name = parsed[0] if parsed else name
    return next((record.kind for record in drafter_types() if name in record.bench_methods), None)


# ---------------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------------
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


def independent_method(name: str, assistant, info: dict | None = None) -> BenchMethod:
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
    return BenchMethod(name, context, {"assistant_model": assistant}, read_stats, info)


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
        "mean_tree_size": ratio(sum(sizes), len(sizes)),
        "lookup_tokens": int(stats.lookup_tokens),
        "engine_mean_accepted_length": stats.mean_accepted_length,
    }


def costs_dict(output) -> dict | None:
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

    settings = dict(settings or {})

    def context(target):
        return drafter.attached(target, allow_other_target=allow_other_target)

    def generate(target, **kwargs):
        return speculative_generate(target, drafter, return_dict_in_generate=True, **settings, **kwargs)

    def read_stats(handle, output) -> dict:
        info["costs"] = costs_dict(output)  # what the engine chose the tree shapes from (measured once per process)
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
    """`base`_exit1 .. `base`_exitK and (with `adaptive`) `base`_adaptive; `base` is a sorted kind's assisted method
    ("moa") or its engine method ("moa_tree")."""
    return [f"{base}_exit{k}" for k in range(1, num_blocks + 1)] + ([f"{base}_adaptive"] if adaptive else [])


def exit_methods_of(name: str) -> tuple[str, int | None] | None:
    """(base, exit) of a sorted drafter's method: base "moa" or "moa_tree", exit k (1-based; None: adaptive depth with
    the drafter's tuned thresholds); None for any other method."""
    if name in ADAPTIVE_METHODS:
        return ADAPTIVE_METHODS[name], None
    match = _EXIT_METHOD.match(name)
    return (match[1], int(match[2])) if match and f"{match[1]}_exits" in EXIT_SHORTHANDS else None


def _sorted_config(path: str | None) -> tuple[int, list[float] | None]:
    """(num_blocks, exit_thresholds) that a sorted drafter folder's config.json records; (1, None) without one."""

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


def _drafter_path(kind: str, paths: dict[str, str | None]) -> str | None:
    """The folder of the `kind` drafter: `--KIND` (`paths`), else the registry's `bench_default`."""
    return paths.get(kind, drafter_type(kind).bench_default)


def _requested_names(methods: str | None, paths: dict[str, str | None]) -> list[str]:
    """`--methods` with the shorthands expanded; by default every method, with a sorted drafter also its exits through
    assisted generation and, once tuned, its adaptive depth through both paths."""
    sorted_kinds = {}  # {kind: (num_blocks, tuned)} of the sorted kinds' drafters
    for record in (r for r in drafter_types() if r.sorted_exits):
        num_blocks, thresholds = _sorted_config(_drafter_path(record.kind, paths))
        sorted_kinds[record.kind] = num_blocks, num_blocks > 1 and thresholds is not None
    if not methods:
        names = list(all_methods())
        for kind, (num_blocks, tuned) in sorted_kinds.items():
            assisted, *engine = _exit_bases(drafter_type(kind))
            if num_blocks > 1:
                names += exit_method_names(assisted, num_blocks, tuned) + [f"{b}_adaptive" for b in engine if tuned]
        return names
    names = []
    for name in (n.strip() for n in methods.split(",") if n.strip()):
        base = EXIT_SHORTHANDS.get(name)
        names += exit_method_names(base, *sorted_kinds[method_kind(base)]) if base else [name]
    return names


def resolve_method_names(methods: str | None, paths: dict[str, str | None]) -> list[str]:
    """The method names of `--methods` (default all), `vanilla` first; errors for unknown names or missing drafters.

    `paths`: {kind: its drafter folder} (`moa bench --KIND`; a kind left out: its registry `bench_default`).
    `moa_exits` / `moa_tree_exits` stand for `moa_exit1` .. `moa_exitK` (`moa_tree_...`) and, when the drafter has
    tuned exit thresholds, `moa_adaptive` (`moa_tree_adaptive`); K is the --moa drafter's `num_blocks`.
    """
    names = _requested_names(methods, paths)
    unknown = [n for n in names if (b := method_variant(n).name) not in all_methods() and exit_methods_of(b) is None]
    if unknown:
        exits = ", ".join(f"{base}_exit<k>" for base in EXIT_SHORTHANDS.values())
        raise BenchError(
            f"Unknown method(s) {unknown} in --methods; choose from {','.join(all_methods())}, or for a sorted "
            f"drafter {exits}, {', '.join(ADAPTIVE_METHODS)}, {', '.join(EXIT_SHORTHANDS)}; variants: "
            f"<engine method>@DEPTHxTOP_KxBUDGET (e.g. moa_tree_nolookup@6x8x24), <MoA method>{NO_CONTEXT}."
        )
    for name in names:
        _check_variant(name)
    names = ["vanilla"] + [n for n in dict.fromkeys(names) if n != "vanilla"]  # the speedup baseline is always run
    for name in names:
        kind = method_kind(name)
        if kind is not None and not _drafter_path(kind, paths):
            raise BenchError(
                f"Method '{name}' needs a drafter: {drafter_type(kind).build_hint}, or leave it out with "
                f"--methods {','.join(n for n in names if n != name)}."
            )
    for kind in drafter_kinds_of(names):
        path = _drafter_path(kind, paths)
        used = [n for n in names if method_kind(n) == kind]
        if path != "default" and not (Path(path) / "config.json").is_file():
            raise BenchError(
                f"--{kind} {path} is not a saved model folder (no config.json there); "
                f"{drafter_type(kind).build_hint}, or leave {','.join(used)} out with --methods."
            )
    return names


def _check_variant(name: str) -> None:
    """Refuse variants that do not apply to `name`'s base method, saying which methods take them."""
    variant = method_variant(name)
    base = (exit_methods_of(variant.name) or (variant.name,))[0]
    if variant.shape is not None:
        if base not in ENGINE_METHODS:
            raise BenchError(
                f"'{name}': a tree shape (@DEPTHxTOP_KxBUDGET) is for the engine's methods "
                f"({', '.join(ENGINE_METHODS)}), not {variant.name}."
            )
        fixed = ENGINE_METHODS[base].get("tree_top_k")
        if fixed is not None and variant.shape["tree_top_k"] != fixed:
            raise BenchError(f"'{name}': {base} drafts with top-k {fixed}; write {base}@DEPTHx{fixed}xBUDGET.")
        if min(variant.shape.values()) < 1:
            raise BenchError(f"'{name}': depth, top-k and budget of a tree shape are positive integers.")
    if variant.no_context and method_kind(name) is None:
        raise BenchError(f"'{name}': {NO_CONTEXT} zeroes a MoA drafter's context vectors; {variant.name} has none.")


def _load_drafter(kind: str, path: str, target):
    """The `kind` drafter at `path` (or `default`) on the target's device and in its dtype (`moa_hf.loading`)."""

    try:
        return load_drafter(path, target=target, kind=kind)
    except (OSError, ValueError) as err:
        raise BenchError(
            f"Cannot load the {kind} drafter from {path}: {err} ({drafter_type(kind).build_hint})."
        ) from err


def checked_drafter(name: str, kind: str, path: str | None, target, allow_other_target: bool, engine: bool = False):
    """(drafter, its folder) for `name` (a method, or the batch section): the `kind` drafter at `path` (or `default`),
    checked against the target, and with `engine` against the tree engine's drafter API."""

    if not path:
        raise BenchError(f"'{name}' needs a drafter: {drafter_type(kind).build_hint}.")
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


def drafter_kinds_of(names: list[str]) -> list[str]:
    """The kinds of drafter the methods `names` run, in registry order."""
    used = {method_kind(name) for name in names}
    return [record.kind for record in drafter_types() if record.kind in used]


def build_methods(
    names: list[str],
    target,
    paths: dict[str, str | None] | None = None,
    *,
    pld_tokens: int = 10,
    allow_other_target: bool = False,
) -> list[BenchMethod]:
    """The methods `names` for `target`, their drafters loaded in the target's dtype from `paths` ({kind: folder};
    a kind left out: its registry `bench_default`), one drafter per method (`moa_nolookup` and the exit methods change
    their drafter's config)."""
    paths = paths or {}
    methods = []
    for name in names:
        kind = method_kind(name)
        if name == "vanilla":
            methods.append(vanilla_method())
        elif name == "pld":
            methods.append(pld_method(pld_tokens))
        elif kind is None:
            raise BenchError(f"Unknown method '{name}'; choose from {','.join(all_methods())}.")
        elif drafter_type(kind).is_fallback:  # any causal LM as the assistant
            path = _drafter_path(kind, paths)
            if not path:
                raise BenchError(f"Method '{name}' needs a drafter: {drafter_type(kind).build_hint}.")
            lm = _load_drafter(kind, path, target)  # checks it shares the target's vocabulary
            methods.append(independent_method(name, lm, {"drafter": str(path)}))
        else:
            methods.append(_drafter_method(name, kind, _drafter_path(kind, paths), target, allow_other_target))
    return methods


def _drafter_method(name: str, kind: str, path: str | None, target, allow_other_target: bool) -> BenchMethod:
    """Method `name` with a drafter of the MoA drafter's API: through assisted generation (with `CONFIG_OVERRIDES`)
    or the tree engine (`ENGINE_METHODS`, or the name's fixed tree shape), a sorted drafter at one exit or adaptive
    (`<base>_exit<k>`), with its context vectors zeroed for a `_nocontext` name."""
    _check_variant(name)
    variant = method_variant(name)
    base, exit = exit_methods_of(variant.name) or (variant.name, False)
    engine = base in ENGINE_METHODS
    drafter, path = checked_drafter(name, kind, path, target, allow_other_target, engine=engine)
    info = {"drafter": str(path)}
    if exit is not False:
        _set_exit(name, drafter, exit, target)
        info["exit"] = "adaptive" if exit is None else exit
    for key, value in CONFIG_OVERRIDES.get(variant.name, {}).items():
        setattr(drafter.config, key, value)
    if variant.tokenwise:
        if getattr(drafter.config, "block_size", 1) < 2:
            raise BenchError(f"'{name}': {TOKENWISE} drafts a block drafter token by token; {path} is not one.")
        drafter.config.block_size = 1  # the same weights, one forward per drafted token
        info["tokenwise"] = True
    if engine:  # the exit methods run the engine as their base does: its chosen tree settings, lookup as configured
        settings = {**ENGINE_METHODS[base], **(variant.shape or {})}
        method = engine_method(name, drafter, settings, allow_other_target, info)
    else:
        method = drafter_method(name, drafter, allow_other_target, info)
    return without_context(method, drafter) if variant.no_context else method


def without_context(method: BenchMethod, drafter) -> BenchMethod:
    """`method` changed to run with `drafter`'s context vectors zeroed (`drafter.context_ablated()`, around the context
    it had): the drafter without the target's state. Only a MoA drafter has context vectors."""
    if not hasattr(drafter, "context_ablated"):
        raise BenchError(
            f"'{method.name}': a {type(drafter).__name__} has no context vectors to zero; {NO_CONTEXT} is for MoA "
            "drafters."
        )
    inner = method.context

    @contextlib.contextmanager
    def context(target):
        with drafter.context_ablated(), inner(target) as handle:
            yield handle

    method.context = context
    method.info["context"] = "zeroed"  # in place: the method's `read_stats` records into this same dict
    return method
