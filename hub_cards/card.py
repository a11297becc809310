"""Model cards for drafter repos on the Hugging Face Hub, of any kind in the drafter-type registry with a card.

The card is rendered from `drafter_card.md` (Jinja, shipped as package data) with `huggingface_hub.ModelCard`. What it
says of the kind (name, paper, what it reads of the target, tags, citation) is the registry's (`DrafterType.card`,
`moa_hf.drafter_types`); every number comes from the drafter's config, a `training_info` dict/JSON and a benchmark JSON
written by `moa bench`; without a benchmark the card says that no measurement is available.

`training_info` (all keys optional, as `moa train` writes it): {"kind": str, "data": str, "datasets": [Hub ids],
"language": str | [str], "tokens": int, "steps": int, "wall_time_s": float, "hardware": str, "final_train_loss": float,
"acceptance_length_heldout": float, "cached_target_states": bool or {target: bool}, "learning_curve": [{"step": int,
"tokens": int, "wall_time_s": float, "acceptance_length": float}, ...]}; other keys are listed as they are.

The benchmark (`moa bench`'s JSON) needs "hardware" and "methods" with the drafter's method (its kind's first
`bench_methods`: "moa" for a MoA drafter, "eagle" for an EAGLE one); every other method in it ("vanilla", "pld", other
kinds' ...) is compared with it, and its settings ("target", "dtype", "max_new_tokens",
"questions_per_category", "date") are quoted. Older files without the newer keys still render.

Sorted and multi-target drafters (`num_blocks` K > 1, `extra_targets`): the card lists every target the drafter serves
(name, model, weight fingerprint, per-target parts) with its acceptance length and speedup, and the per-exit numbers
(fixed exits and adaptive depth: acceptance, tokens/s, tokens drafted per exit), from one `moa bench` JSON per target
(`target_benchmarks`: {target name: JSON}; the primary target's is `benchmark`) or, where none was measured, the
per-target held-out acceptance in `training_info["targets"]` ({name: {"acceptance_length_heldout": x,
"acceptance_length_exit1": y, ..., "acceptance_length_adaptive": z}}).
"""

from __future__ import annotations

import json
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..bench.report import format_exit_setting
from ..drafter_types import DrafterType, drafter_type, drafter_types
from ..embeddings import EMBEDDING_MODULES
from ..modeling import PRIMARY_TARGET

__all__ = [
    "HUB_LICENSES",
    "REQUIRED_TAGS",
    "TEMPLATE_NAME",
    "card_type",
    "load_benchmark",
    "load_target_benchmarks",
    "load_training_info",
    "render_card",
    "validate_card_metadata",
]

TEMPLATE_NAME = "drafter_card.md"
# every card's tags, before its kind's (`DrafterCard.tags`); "custom_generate": the repo carries transformers'
# custom_generate/ folder (`target.generate(custom_generate=...)`)
REQUIRED_TAGS = ("speculative-decoding", "drafter", "moa-hf", "custom_generate")
# License identifiers the Hub accepts in card metadata (https://huggingface.co/docs/hub/repositories-licenses).
HUB_LICENSES = frozenset(
    """apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 bigcode-openrail-m
    afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0
    cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0
    cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
    cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0 gfdl
    gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c ms-pl apple-ascl apple-amlr
    mpl-2.0 odc-by odbl openmdw-1.0 openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr
    deepfloyd-if-license fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 gemma
    unknown other""".split()
)
_BENCH_KEYS = ("acceptance_length", "tokens_per_s", "speedup", "theoretical_speedup")
# the speedup bound's inputs, shown when the benchmark has them
_MODEL_COLUMNS = {"alpha": "α (acceptance rate)", "gamma": "γ (drafted per cycle)", "cost_ratio": "Draft cost / step"}
BASELINE = "vanilla"  # the target alone: speedups are relative to it
_METHOD_LABELS = {
    **{t.kind: t.label for t in drafter_types()},  # a method named after a kind of drafter: "eagle", "independent"
    BASELINE: "target alone",
    "pld": "prompt lookup decoding",
}
MAX_CURVE_ROWS = 20  # longer learning curves are thinned in the card (the JSON keeps every point)
_YAML_BLOCK = re.compile(r"\A\s*---\s*\n(.*?)\n---\s*\n", re.DOTALL)
_TRAINING_EXIT_KEY = re.compile(r"^acceptance_length_(exit\d+|adaptive)$")


# ---------------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------------
def _load_json(source: str | os.PathLike | dict | None, what: str) -> dict | None:
    if source is None or isinstance(source, dict):
        return source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"The {what} file {path} does not exist; pass the path of the JSON file.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"The {what} file {path} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise ValueError(f"The {what} file {path} must hold a JSON object, got {type(data).__name__}.")
    return data


def card_type(drafter_or_config) -> DrafterType:
    """The registered kind of a drafter (a model, a config or a config.json dict) whose card this builds: a kind with
    its own classes and card text (`DrafterType.card`), else a ValueError naming those kinds."""
    record = drafter_type(drafter_or_config)
    if record.card is None or record.config_class is None or not record.bench_methods:
        kinds = ", ".join(f"{t.kind!r} ({t.label})" for t in drafter_types() if t.card is not None)
        raise ValueError(
            f"Model cards describe drafters of the kind(s) {kinds}, not of kind {record.kind!r} ({record.label}): "
            "its registry entry (moa_hf/drafter_types.py) has no `card`."
        )
    return record


def _card_methods() -> tuple[str, ...]:
    """The `moa bench` method of each kind with a card: its first (`bench_methods[0]`, assisted generation)."""
    return tuple(t.bench_methods[0] for t in drafter_types() if t.card is not None and t.bench_methods)


def load_benchmark(benchmark: str | os.PathLike | dict | None, method: str | None = None) -> dict | None:
    """Read and check a benchmark JSON written by `moa bench` (path or dict); None stays None. `method`: the one whose
    numbers describe the drafter (`card_type(drafter).bench_methods[0]`); None: that of any kind with a card."""
    bench = _load_json(benchmark, "benchmark")
    if bench is None:
        return None
    problems = []
    hardware = bench.get("hardware")
    if not isinstance(hardware, dict) or not hardware:
        problems.append("'hardware' must be a non-empty object (cpu, cores, torch, device)")
    methods = bench.get("methods")
    wanted = (method,) if method else _card_methods()
    found = next((m for m in wanted if m in methods), None) if isinstance(methods, dict) else None
    if found is None:
        names = sorted(methods) if isinstance(methods, dict) else None
        problems.append(f"'methods' must contain {' or '.join(repr(m) for m in wanted)} (found {names})")
    else:
        overall = (methods[found] or {}).get("overall")
        for key in ("acceptance_length", "speedup"):
            if not isinstance(overall, dict) or not _is_number(overall.get(key)):
                problems.append(f"methods['{found}']['overall']['{key}'] must be a number")
    if problems:
        raise ValueError(
            "The benchmark JSON does not have the format written by `moa bench`: " + "; ".join(problems) + ". "
            "Pass the JSON file that `moa bench` wrote for this drafter."
        )
    return bench


def load_target_benchmarks(target_benchmarks: dict | None, method: str | None = None) -> dict[str, dict]:
    """{target name: benchmark} from {target name: path or dict} (`moa bench` JSONs measured with the drafter's other
    targets); each must hold "methods" with at least one of the drafter's methods (`method`, e.g. `moa`, and its
    variants `moa_adaptive`, `moa_exit<k>`, `moa_tree...`; None: those of any kind with a card)."""
    wanted = (method,) if method else _card_methods()
    loaded = {}
    for name, source in (target_benchmarks or {}).items():
        bench = _load_json(source, f"benchmark of target {name!r}")
        methods = bench.get("methods") if bench else None
        if not isinstance(methods, dict) or not any(m == w or m.startswith(f"{w}_") for m in methods for w in wanted):
            raise ValueError(
                f"The benchmark of target {name!r} has no method of the drafter ({', '.join(wanted)}) in 'methods' "
                f"(found {sorted(methods) if isinstance(methods, dict) else None}); pass the JSON that `moa bench "
                "--target SPEC --KIND DRAFTER` wrote."
            )
        loaded[str(name)] = bench
    return loaded


def load_training_info(training_info: str | os.PathLike | dict | None) -> dict | None:
    """Read a training-info JSON (path or dict); None stays None."""
    info = _load_json(training_info, "training info")
    if info is None:
        return None
    datasets = info.get("datasets")
    if datasets is not None and (
        not isinstance(datasets, list) or not all(isinstance(d, str) and d for d in datasets)
    ):
        raise ValueError(f"training_info['datasets'] must be a list of Hub dataset ids, got {datasets!r}.")
    curve = info.get("learning_curve")
    if curve is not None and (not isinstance(curve, list) or not all(isinstance(p, dict) for p in curve)):
        raise ValueError(
            "training_info['learning_curve'] must be a list of points (objects with step, tokens, wall_time_s and "
            f"acceptance_length) as `moa train` writes it, got {type(curve).__name__}. Fix or remove that key."
        )
    return info


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _short_name(name: str) -> str:
    return str(name).rstrip("/").split("/")[-1].lower()


def _check_repo_id(repo_id: str, what: str, fix: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{what} {repo_id!r} is not a valid Hub repo id ({err}). {fix}") from err


# ---------------------------------------------------------------------------------------------------------------------
# Template values
# ---------------------------------------------------------------------------------------------------------------------
def _fmt_count(n: int) -> str:
    if n >= 1_000_000_000:
        return f"{n / 1e9:.2f} B"
    if n >= 100_000:
        return f"{n / 1e6:.1f} M"
    return f"{n:,}"


def _fmt(key: str, value: Any) -> str:
    if not _is_number(value):
        return "–"
    if key in ("speedup", "theoretical_speedup"):
        return f"{value:.2f}×"
    if key == "tokens_per_s":
        return f"{value:.1f}"
    if key == "cost_ratio":
        return f"{value:.3f}"
    return f"{value:.2f}"


def _fmt_duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def _exit_thresholds(config, target: str):
    """The exit thresholds a sorted drafter drafts with for `target` (None: none set, or no exits)."""
    thresholds = getattr(config, "target_exit_thresholds", None)
    return thresholds(target) if thresholds is not None else None


def _target_list(config) -> list[dict]:
    """The targets the drafter serves, the primary one first: name, model (name or path), fingerprint, LoRA rank and
    the exit thresholds it drafts with (its own, else the primary's)."""
    targets = [
        {
            "name": PRIMARY_TARGET,
            "name_or_path": config.target_name_or_path,
            "fingerprint": getattr(config, "target_fingerprint", None),
            "lora_rank": 0,
            "exit_thresholds": _exit_thresholds(config, PRIMARY_TARGET),
        }
    ]
    for name, entry in (getattr(config, "extra_targets", None) or {}).items():
        targets.append(
            {
                "name": name,
                "name_or_path": entry.get("target_name_or_path"),
                "fingerprint": entry.get("target_fingerprint"),
                "lora_rank": int(entry.get("lora_rank") or 0),
                "exit_thresholds": _exit_thresholds(config, name),
            }
        )
    return targets


def _architecture(drafter_or_config, record: DrafterType) -> tuple[Any, dict]:
    """(config, the card's `arch` values) of a drafter or its config, of the kind `record`."""
    if isinstance(drafter_or_config, torch.nn.Module):
        config, model = drafter_or_config.config, drafter_or_config
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    else:
        config = drafter_or_config
        with torch.device("meta"):  # counts parameters without allocating them
            model = record.model_class(record.config_class.from_dict(config.to_dict()))
        dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    total = sum(p.numel() for p in model.parameters())
    own = bool(config.own_embeddings)
    if own:
        emb = sum(p.numel() for name, p in model.named_parameters() if name.split(".")[0] in EMBEDDING_MODULES)
        parameters = f"{_fmt_count(total)} ({_fmt_count(total - emb)} without its embedding and LM head copies)"
        embeddings_row = "own copies, saved in this repo (usable without the target's weights for those two layers)"
        embeddings_sentence = "keeps its own copy of the target's token embedding and LM head."
    else:
        parameters = f"{_fmt_count(total)} (the embedding and LM head are the target's and not counted)"
        embeddings_row = "borrowed from the target when attached (not stored in this repo)"
        embeddings_sentence = "borrows the target's token embedding and LM head when attached."
    gen = getattr(drafter_or_config, "generation_config", None) or record.model_class.default_generation_config()
    arch = {
        "target_model_type": config.target_model_type or "decoder-only",
        "target_layers": config.target_num_hidden_layers,
        "target_hidden_size": config.target_hidden_size,
        "target_kv_heads": config.target_num_key_value_heads,
        "target_head_dim": config.target_head_dim,
        "vocab_size": config.vocab_size,
        "target_fingerprint": getattr(config, "target_fingerprint", None),  # None: drafters that do not record it
        "hidden_size": config.hidden_size,
        "layers": getattr(config, "num_hidden_layers", None),  # a drafter of decoder layers (not one of LSA blocks)
        "lsa_hidden_size": getattr(config, "lsa_hidden_size", None),  # Layer Self-Attention over the target's cache
        "tli": getattr(config, "target_layer_inference", 0),
        "own_embeddings": own,
        "parameters": parameters,
        "embeddings_row": embeddings_row,
        "embeddings_sentence": embeddings_sentence,
        "dtype": dtype,
        "num_assistant_tokens": getattr(gen, "num_assistant_tokens", None),
        "confidence_threshold": getattr(gen, "assistant_confidence_threshold", None),
        "lookup": getattr(model, "lookup_settings", None),  # `LookupSettings` from the config's `lookup_*`, None: off
        "num_blocks": int(getattr(config, "num_blocks", 1) or 1),
        "final_hidden": bool(getattr(config, "context_final_hidden", False)),
        "latest_context": bool(getattr(config, "ca_latest_context", False)),
        "targets": _target_list(config),
    }
    return config, arch


def _kind_values(record: DrafterType, arch: dict) -> dict:
    """What the card says of the drafter's kind (`DrafterType.card`), `{target_layers}` filled in."""
    card = record.card
    return {
        "label": record.label,
        "summary": card.summary,
        "paper": card.paper,
        "reads": card.reads.format(target_layers=arch["target_layers"]),
        "limitation": card.limitation,
        "citation": card.citation,
        "method": record.bench_methods[0],
    }


_TRAINING_LABELS = {
    "kind": "Drafter kind",
    "data": "Data",
    "datasets": "Datasets",
    "tokens": "Training tokens",
    "steps": "Optimizer steps",
    "wall_time_s": "Wall time",
    "total_tokens": "Training tokens, all runs",
    "total_steps": "Optimizer steps, all runs",
    "total_wall_time_s": "Wall time, all runs",
    "hardware": "Hardware",
    "cached_target_states": "Trained on cached target states",
    "final_train_loss": "Final training loss",
    "acceptance_length_heldout": "Held-out acceptance length (end of training)",
    "acceptance_length_heldout_no_context": "Held-out acceptance length, context vectors zeroed",
    "top1_heldout": "Held-out top-1 agreement with the target",
    "top1_first_heldout": "Held-out top-1 agreement, first drafted token of a cycle",
    "top1_heldout_no_context": "Held-out top-1 agreement, context vectors zeroed",
    "acceptance_heldout_by_target": "Held-out acceptance length per target",
    "tokens_per_target": "Training tokens per target",
    "acceptance_eval_time_s": "Time measuring held-out acceptance (part of the wall time)",
    "trainable_parameters": "Trainable parameters",
    "num_blocks": "Blocks",
    "exit_loss_weights": "Exit loss weights",
    "trained": "Trained",
    "init_drafter": "Started from (`--init-from`)",
}
_POOLED = ("acceptance_length_heldout", "acceptance_length_heldout_no_context")  # pooled over a run's targets


def _rounded(value: Any) -> Any:
    """Floats to 3 decimals, inside dicts and lists too (a card shows measurements, not float noise)."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return [_rounded(v) for v in value] if isinstance(value, list) else value


def _fmt_training(key: str, value: Any) -> str:
    if key == "datasets":
        return ", ".join(f"[`{d}`](https://huggingface.co/datasets/{d})" for d in value)
    if key in ("tokens", "steps", "total_tokens", "total_steps", "trainable_parameters") and _is_number(value):
        return f"{value:,}"
    if key == "tokens_per_target" and isinstance(value, dict) and all(map(_is_number, value.values())):
        return "; ".join(f"{name} {n:,}" for name, n in value.items())
    if (
        key == "acceptance_heldout_by_target"
        and isinstance(value, dict)
        and all(isinstance(v, dict) for v in value.values())
    ):
        texts = {name: _acceptance_text(by_exit) for name, by_exit in value.items()}
        return "; ".join(f"{name} {text}" for name, text in texts.items() if text)
    if key in ("wall_time_s", "total_wall_time_s", "acceptance_eval_time_s") and _is_number(value):
        return _fmt_duration(value)
    if key == "hardware" and isinstance(value, dict):
        return _hardware_text(value)
    if key == "cached_target_states" and isinstance(value, bool):
        return "yes" if value else "no"
    if key == "cached_target_states" and isinstance(value, dict):
        return "; ".join(f"{name} {'yes' if cached else 'no (online)'}" for name, cached in value.items())
    if key == "final_train_loss" and _is_number(value):
        return f"{value:.4f}"
    if key == "acceptance_length_heldout" and _is_number(value):
        return f"{value:.2f}"
    value = _rounded(value)
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _acceptance_text(by_exit: dict) -> str:
    """One target's held-out acceptance: "1.58", or per exit "1.58 (exit1 1.40, exit2 1.52)"."""
    numbers = {k: v for k, v in by_exit.items() if _is_number(v)}
    head = f"{numbers['default']:.2f}" if "default" in numbers else ""
    rest = ", ".join(f"{k} {v:.2f}" for k, v in numbers.items() if k != "default")
    return f"{head} ({rest})".strip() if rest and head else head or rest


def _training_rows(info: dict | None) -> list[tuple[str, str]]:
    if not info:
        return []
    keys = [k for k in _TRAINING_LABELS if k in info] + [k for k in info if k not in _TRAINING_LABELS]
    rows = []
    for key in keys:
        value = info[key]
        if key in ("language", "learning_curve", "previous_runs", "targets") or value in (None, "", []):
            continue  # metadata; the learning curve and the targets have their own tables; runs are in the totals
        label = _TRAINING_LABELS.get(key, key.replace("_", " ").capitalize())
        if key in _POOLED and len(info.get("targets") or {}) > 1:
            label += ", pooled over the targets"
        rows.append((label, _fmt_training(key, value).replace("|", "\\|")))
    return rows


def _curve_rows(info: dict | None) -> dict | None:
    """The learning curve as table rows (thinned to at most MAX_CURVE_ROWS, first and last kept); None if absent."""
    curve = (info or {}).get("learning_curve") or []
    points = [p for p in curve if _is_number(p.get("acceptance_length"))]
    if not points:
        return None
    shown = points
    if len(points) > MAX_CURVE_ROWS:
        picks = sorted({round(i * (len(points) - 1) / (MAX_CURVE_ROWS - 1)) for i in range(MAX_CURVE_ROWS)})
        shown = [points[i] for i in picks]
    rows = [
        {
            "step": f"{p['step']:,}" if _is_number(p.get("step")) else "–",
            "tokens": f"{p['tokens']:,}" if _is_number(p.get("tokens")) else "–",
            "wall_time": _fmt_duration(p["wall_time_s"]) if _is_number(p.get("wall_time_s")) else "–",
            "acceptance_length": f"{p['acceptance_length']:.2f}",
        }
        for p in shown
    ]
    first, last = points[0]["acceptance_length"], points[-1]["acceptance_length"]
    return {"rows": rows, "total": len(points), "shown": len(rows), "first": f"{first:.2f}", "last": f"{last:.2f}"}


def _hardware_text(hardware: dict) -> str:
    parts = []
    device = hardware.get("device")
    if device:
        parts.append(str(device))
    cpu, cores = hardware.get("cpu"), hardware.get("cores")
    if cpu or cores:
        parts.append("CPU " + ", ".join(str(x) for x in (cpu, f"{cores} cores" if cores else None) if x))
    if hardware.get("torch"):
        parts.append(f"torch {hardware['torch']}")
    parts += [f"{k} {v}" for k, v in hardware.items() if k not in ("device", "cpu", "cores", "torch") and v]
    return "; ".join(parts)


def _metric_row(name: str, values: dict | None, keys: tuple[str, ...] = _BENCH_KEYS) -> dict:
    values = values if isinstance(values, dict) else {}
    return {"name": name, **{k: _fmt(k, values.get(k)) for k in keys}}


def _bench_rows(method: dict, per_category: bool) -> list[dict]:
    rows = [_metric_row("**overall**", method["overall"])]
    if per_category:
        for cat, values in (method.get("per_category") or {}).items():
            rows.append(_metric_row(str(cat), values))
    return rows


def _method_label(name: str, method: dict, drafter_method: str) -> str:
    if name == drafter_method:
        return f"**`{name}` (this drafter)**"
    kind = _METHOD_LABELS.get(name) or (method.get("info") or {}).get("kind")
    return f"`{name}` ({kind})" if kind else f"`{name}`"


def _verdict(methods: dict, method: str) -> list[str]:
    """Plain sentences on how the drafter (`method`) did, including when it is slower than the target alone."""
    drafter = methods[method]
    overall = drafter["overall"]
    speedup, acceptance = overall["speedup"], overall["acceptance_length"]
    tps = overall.get("tokens_per_s")
    base_tps = ((methods.get(BASELINE) or {}).get("overall") or {}).get("tokens_per_s")
    both = _is_number(tps) and _is_number(base_tps)
    rates = f" ({tps:.1f} vs {base_tps:.1f} tokens/s)" if both else ""
    if speedup < 1:
        why = (
            f"although each target forward pass produced {acceptance:.2f} tokens on average: drafting and verifying "
            "cost more time than the saved target passes."
            if acceptance > 1
            else f"as almost no drafted token was accepted ({acceptance:.2f} tokens per target forward pass)."
        )
        sentences = [
            f"**On this hardware the drafter is slower than plain decoding with the target alone: speedup "
            f"{speedup:.2f}×, below 1{rates}**, {why}"
        ]
    elif speedup == 1:
        sentences = [f"On this hardware the drafter is as fast as the target alone (speedup {speedup:.2f}×){rates}."]
    else:
        sentences = [
            f"On this hardware the drafter decodes {speedup:.2f}× as fast as the target alone{rates}, with "
            f"{acceptance:.2f} tokens per target forward pass on average."
        ]
    slow = [
        f"{cat} ({values['speedup']:.2f}×)"
        for cat, values in (drafter.get("per_category") or {}).items()
        if isinstance(values, dict) and _is_number(values.get("speedup")) and values["speedup"] < 1
    ]
    if slow and speedup >= 1:
        sentences.append(f"It is slower than the target alone in: {', '.join(slow)}.")
    elif slow and len(slow) < len(drafter.get("per_category") or {}):
        sentences.append(f"Categories where it is slower than the target alone: {', '.join(slow)}.")
    others = {
        name: m["overall"]["speedup"]
        for name, m in methods.items()
        if name not in (method, BASELINE)
        and isinstance(m, dict)
        and isinstance(m.get("overall"), dict)
        and _is_number(m["overall"].get("speedup"))
    }
    if others:
        best = max(others, key=others.get)
        if others[best] > speedup:
            faster = ", ".join(
                f"`{n}` ({v:.2f}×)" for n, v in sorted(others.items(), key=lambda kv: -kv[1]) if v > speedup
            )
            sentences.append(f"Faster than the drafter in this run: {faster}.")
        else:
            sentences.append(f"It is the fastest of the {len(others) + 1} speculative methods measured in this run.")
    return sentences


def _category_speedups(methods: dict, method: str) -> dict | None:
    """Per-category speedup of the drafter (`method`) and the other methods (vanilla is the 1.00× reference); None if
    absent."""
    names = [method] + [
        n
        for n, m in methods.items()
        if n not in (method, BASELINE) and isinstance(m, dict) and isinstance(m.get("per_category"), dict)
    ]
    if len(names) < 2 or not methods[method].get("per_category"):
        return None
    categories = list(dict.fromkeys(c for n in names for c in methods[n].get("per_category") or {}))
    rows = []
    for cat in categories:
        values = [((methods[n].get("per_category") or {}).get(cat) or {}).get("speedup") for n in names]
        best = max((v for v in values if _is_number(v)), default=None)
        cells = [
            ("**" + _fmt("speedup", v) + "**") if _is_number(v) and v == best else _fmt("speedup", v) for v in values
        ]
        rows.append({"name": str(cat), "cells": cells})
    return {"methods": [f"`{n}`" for n in names], "rows": rows}


def _check_text(check: Any) -> str | None:
    """One line on `moa bench --check` (greedy tokens vs the target alone in float32), when the benchmark ran it."""
    if not isinstance(check, dict) or not check:
        return None
    parts = []
    for name, entry in check.items():
        if isinstance(entry, dict) and "passed" in entry:
            n = entry.get("questions")
            tail = f" on {n} questions" if _is_number(n) else ""
            parts.append(f"`{name}` {'identical' if entry['passed'] else 'NOT identical'}{tail}")
    return "; ".join(parts) or None


def _bench_values(bench: dict | None, base_model: str, method: str) -> dict | None:
    if bench is None:
        return None
    measured = bench.get("target")
    if measured and _short_name(measured) != _short_name(base_model):
        raise ValueError(
            f"The benchmark was measured with target '{measured}', but this drafter serves '{base_model}'. Pass the "
            "benchmark JSON that `moa bench` wrote for this drafter and its target."
        )
    methods = bench["methods"]
    drafter_rows = _bench_rows(methods[method], per_category=True)
    compared = {n: m for n, m in methods.items() if isinstance(m, dict) and isinstance(m.get("overall"), dict)}
    model_keys = tuple(k for k in _MODEL_COLUMNS if any(k in m["overall"] for m in compared.values()))
    other_rows = (
        [
            {**_metric_row(_method_label(n, m, method), m["overall"], _BENCH_KEYS + model_keys)}
            for n, m in compared.items()
        ]
        if len(compared) > 1
        else []  # a comparison, if any
    )
    settings = [("Hardware", _hardware_text(bench["hardware"])), ("Target", f"`{base_model}`")]
    for key, label in (
        ("dtype", "Target dtype"),
        ("max_new_tokens", "Max new tokens per prompt"),
        ("questions_per_category", "Questions per category"),
        ("repeats", "Repeats per question"),
        ("date", "Date"),
    ):
        if bench.get(key) not in (None, ""):
            settings.append((label, str(bench[key]).replace("|", "\\|")))
    return {
        "hardware": _hardware_text(bench["hardware"]),
        "date": bench.get("date"),
        "target": base_model,  # the same model (checked above); a local path the benchmark may record is not shown
        "dtype": bench.get("dtype", "the default dtype"),
        "max_new_tokens": bench.get("max_new_tokens", "–"),
        "questions_per_category": bench.get("questions_per_category"),
        "settings": settings,
        "verdict": " ".join(_verdict(methods, method)),
        "method": method,
        "drafter_rows": drafter_rows,
        "other_rows": other_rows,
        "model_columns": [(k, _MODEL_COLUMNS[k]) for k in model_keys],
        "category_speedups": _category_speedups(compared, method),
        "check": _check_text(bench.get("check")),
    }


def _headline(bench: dict | None, method: str) -> tuple[str, dict] | None:
    """(method, overall metrics) describing the drafter in a benchmark: its adaptive depth when measured, else
    `method` (e.g. `moa`), else the engine's (`moa_tree`); None without any."""
    methods = (bench or {}).get("methods") or {}
    for name in (f"{method}_adaptive", method, f"{method}_tree_adaptive", f"{method}_tree"):
        overall = (methods.get(name) or {}).get("overall")
        if isinstance(overall, dict):
            return name, overall
    return None


def _prompts_text(bench: dict) -> str:
    if bench.get("prompts"):
        return "natural held-out prompts (" + ", ".join(f"`{p}`" for p in bench["prompts"]) + ")"
    return "Spec-Bench" if bench.get("questions") or bench.get("questions_per_category") else "its benchmark"


def _parts_text(target: dict) -> str:
    if target["name"] == PRIMARY_TARGET:
        return "the shared network (primary target)"
    lora = f" and rank-{target['lora_rank']} LoRA deltas on the blocks" if target["lora_rank"] else ""
    return f"its own LSA input projection{lora}"


def _check_measured_target(target: dict, bench: dict) -> None:
    recorded, measured = target["fingerprint"], bench.get("target_fingerprint")
    if recorded and measured and recorded != measured:
        raise ValueError(
            f"The benchmark given for target {target['name']!r} was measured with a model of fingerprint {measured}, "
            f"but the drafter records {recorded} for {target['name']!r}. Pass the `moa bench` JSON of that target."
        )


def _exit_rows(name: str, bench: dict | None, drafter_method: str) -> list[dict]:
    """A benchmark's fixed-exit and adaptive methods of the sorted drafter (`moa_exit2`, `moa_tree_adaptive`, ... for
    `drafter_method` "moa": through assisted generation or the engine), for target `name`."""
    exit_method = re.compile(rf"^{re.escape(drafter_method)}(_tree)?_(exit\d+|adaptive)$")
    rows = []
    for method, m in ((bench or {}).get("methods") or {}).items():
        overall = m.get("overall") if isinstance(m, dict) else None
        if exit_method.match(method) and isinstance(overall, dict):
            counts = overall.get("exit_counts") or []
            rows.append(
                {
                    "target": name,
                    "method": method,
                    "setting": format_exit_setting(m.get("info") or {}),
                    **{k: _fmt(k, overall.get(k)) for k in ("acceptance_length", "tokens_per_s", "speedup")},
                    "exit_counts": " / ".join(str(c) for c in counts) or "–",
                }
            )
    return rows


def _targets_values(
    arch: dict, bench: dict | None, target_benches: dict, info: dict | None, method: str
) -> dict | None:
    """The targets and exits section of a sorted or multi-target drafter (None for a one-block, one-target one)."""

    targets = arch["targets"]
    names = [t["name"] for t in targets]
    if unknown := sorted(set(target_benches) - set(names)):
        raise ValueError(f"Benchmarks were given for targets {unknown} that the drafter does not serve ({names}).")
    if arch["num_blocks"] < 2 and len(targets) < 2:
        return None
    benches = {**({PRIMARY_TARGET: bench} if bench else {}), **target_benches}
    trained = (info or {}).get("targets") or {}
    rows, exit_rows, training_exit_rows = [], [], []
    for target in targets:
        measured = benches.get(target["name"])
        if measured:
            _check_measured_target(target, measured)
        head = _headline(measured, method)
        held = trained.get(target["name"]) if isinstance(trained.get(target["name"]), dict) else {}
        if head:
            numbers = (
                _fmt("acceptance_length", head[1].get("acceptance_length")),
                _fmt("speedup", head[1].get("speedup")),
            )
            source = f"`{head[0]}` on {_prompts_text(measured)}"
        else:
            numbers = (_fmt("acceptance_length", held.get("acceptance_length_heldout")), "–")
            source = "held-out prompts at the end of training" if numbers[0] != "–" else "not measured"
        rows.append(
            {
                "name": target["name"],
                "model": target["name_or_path"] or "–",
                "fingerprint": target["fingerprint"] or "–",
                "parts": _parts_text(target),
                "acceptance_length": numbers[0],
                "speedup": numbers[1],
                "source": source,
            }
        )
        exit_rows += _exit_rows(target["name"], measured, method)
        for key, value in held.items():
            if (match := _TRAINING_EXIT_KEY.match(key)) and _is_number(value):
                training_exit_rows.append(
                    {"target": target["name"], "exit": match[1], "acceptance_length": f"{value:.2f}"}
                )
    num_blocks = arch["num_blocks"]
    tuned = [t for t in targets if t["exit_thresholds"] is not None]
    same = len({tuple(t["exit_thresholds"]) for t in tuned}) <= 1 and len(tuned) == len(targets)
    return {
        "num_blocks": num_blocks,
        "several": len(targets) > 1,
        "threshold_rows": [  # one row when every target drafts with the same thresholds
            {
                "name": None if same else t["name"],
                "list": [float(v) for v in t["exit_thresholds"]],
                "first_exit_only": float(t["exit_thresholds"][0]) <= 0.0,
            }
            for t in (tuned[:1] if same else tuned)
        ],
        "rows": rows,
        "exit_rows": exit_rows,
        "exit_header": " / ".join(str(k) for k in range(1, num_blocks + 1)),
        "training_exit_rows": training_exit_rows,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Rendering and validation
# ---------------------------------------------------------------------------------------------------------------------
def render_card(
    drafter_or_config,
    benchmark: str | os.PathLike | dict | None = None,
    training_info: str | os.PathLike | dict | None = None,
    *,
    repo_id: str,
    base_model: str | None = None,
    license: str = "apache-2.0",
    target_benchmarks: dict | None = None,
) -> ModelCard:
    """The README.md of a drafter repo, as a `huggingface_hub.ModelCard` (validated with `validate_card_metadata`).

    `drafter_or_config`: a drafter, or its config, of a kind with a card in the registry (`card_type`). `base_model`
    defaults to the drafter's `config.target_name_or_path`; it must be a Hub repo id. `benchmark` is the primary
    target's measurement (its numbers: the kind's first `bench_methods`, e.g. `moa`); `target_benchmarks` ({target
    name: path or dict}) those of a multi-target drafter's other targets.
    """
    _check_repo_id(repo_id, "repo_id", "Use ORG/NAME, e.g. 'my-org/smollm2-moa-drafter'.")
    record = card_type(drafter_or_config)
    method = record.bench_methods[0]  # the `moa bench` method whose numbers describe this drafter
    config, arch = _architecture(drafter_or_config, record)
    base_model = base_model or config.target_name_or_path
    if not base_model:
        raise ValueError(
            "The drafter does not record its target (config.target_name_or_path is empty); pass base_model='ORG/NAME' "
            "(the Hub id of the target model)."
        )
    _check_repo_id(
        base_model, "The target", "Pass base_model='ORG/NAME' with the Hub id of the target model (not a local path)."
    )
    bench = load_benchmark(benchmark, method)
    info = load_training_info(training_info)
    targets = _targets_values(arch, bench, load_target_benchmarks(target_benchmarks, method), info, method)
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",  # no pipeline_tag: the drafter is not a stand-alone text-generation model
        license=license,
        tags=[*REQUIRED_TAGS, *record.card.tags],
        datasets=list(info["datasets"]) if info and info.get("datasets") else None,
        language=info.get("language") if info else None,
    )
    with resources.as_file(resources.files(__package__) / TEMPLATE_NAME) as template:
        card = ModelCard.from_template(
            card_data,
            template_path=str(template),
            title=repo_id.split("/")[-1],
            repo_id=repo_id,
            arch=arch,
            kind=_kind_values(record, arch),
            training_rows=_training_rows(info),
            curve=_curve_rows(info),
            bench=_bench_values(bench, base_model, method),
            targets=targets,
        )
    validate_card_metadata(card)
    return card


def validate_card_metadata(card: ModelCard | str) -> dict:
    """Parse the card's YAML header back and check the keys and types the Hub expects; returns the metadata.

    `ModelCard.validate` asks the Hub, so this checks offline what this package writes. Raises `ValueError`.
    """
    text = card.content if isinstance(card, ModelCard) else str(card)
    match = _YAML_BLOCK.match(text)
    if match is None:
        raise ValueError("The model card has no YAML metadata block ('---' lines) at its top.")
    meta = yaml.safe_load(match.group(1))
    if not isinstance(meta, dict):
        raise ValueError(f"The model card metadata must be a YAML mapping, got {type(meta).__name__}.")
    problems = []
    if isinstance(card, ModelCard) and card.data.to_dict() != meta:
        problems.append("card.data does not match the YAML block")
    if meta.get("library_name") != "transformers":
        problems.append(f"library_name must be 'transformers', got {meta.get('library_name')!r}")
    base = meta.get("base_model")
    if not isinstance(base, str):
        problems.append(f"base_model must be the target's Hub id (a string), got {base!r}")
    else:
        try:
            validate_repo_id(base)
        except HFValidationError as err:
            problems.append(f"base_model {base!r} is not a Hub repo id ({err})")
    tags = meta.get("tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        problems.append(f"tags must be a list of strings, got {tags!r}")
    elif missing := [t for t in REQUIRED_TAGS if t not in tags]:
        problems.append(f"tags lack {missing}")
    lic = meta.get("license")
    if lic not in HUB_LICENSES:
        problems.append(f"license must be a Hub license id (e.g. 'apache-2.0'), got {lic!r}")
    elif lic == "other" and not (
        isinstance(meta.get("license_name"), str) and isinstance(meta.get("license_link"), str)
    ):
        problems.append("license 'other' needs license_name and license_link")
    datasets = meta.get("datasets")
    if datasets is not None:
        if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
            problems.append(f"datasets must be a list of Hub dataset ids, got {datasets!r}")
        else:
            for d in datasets:
                try:
                    validate_repo_id(d)
                except HFValidationError:
                    problems.append(f"dataset {d!r} is not a Hub dataset id")
    language = meta.get("language")
    if language is not None and not (
        isinstance(language, str) or (isinstance(language, list) and all(isinstance(x, str) for x in language))
    ):
        problems.append(f"language must be a string or a list of strings, got {language!r}")
    if "pipeline_tag" in meta and not isinstance(meta["pipeline_tag"], str):
        problems.append(f"pipeline_tag must be a string, got {meta['pipeline_tag']!r}")
    if problems:
        raise ValueError("Invalid model card metadata: " + "; ".join(problems) + ".")
    return meta
