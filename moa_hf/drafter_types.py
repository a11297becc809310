"""The drafter-type registry: what each kind of drafter is, declared once (as PEFT registers its tuners).

A `DrafterType` names a kind (`moa train --kind`, `load_drafter(kind=...)`), its model and config classes, its
training adapter, how cards and reports name it, how to build one, and what runs it: the tree engine
(`speculative_generate`), the vLLM route, `moa publish` (a Hub repo with remote code) and `moa tune --write`.
Loading, training, `moa bench`, `moa tune`, the Hub code and the vLLM route read it:

```python
from moa_hf.drafter_types import drafter_type

record = drafter_type(drafter)  # a model, a config, a config.json dict, a model_type or a kind
record.kind, record.engine_support, record.vllm_support
```

Adding an architecture: its modeling files (config and model class), its training adapter (a
`moa_hf.training.drafters.DrafterAdapter`), and one `register_drafter_type(DrafterType(...))` call below. The
registry is filled at import by the registrations in this file; a kind registered elsewhere works the same. What
varies per kind outside its own files is here: the `moa bench` methods that run it and its `--KIND` flag
(`bench_methods`, `bench_default`), a Hub repo's remote code and `auto_map` (`remote_code_files`, `auto_map`,
derived from its classes) and what its model card says of it (`card`); `tests/test_layout.py` checks that bench,
tune, hub, the model card and loading name no kind.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .modeling import EagleDrafterConfig, EagleDrafterModel, MoADrafterConfig, MoADrafterModel

__all__ = [
    "DrafterCard",
    "DrafterType",
    "drafter_kinds",
    "drafter_type",
    "drafter_types",
    "register_drafter_type",
]


@dataclass(frozen=True)
class DrafterCard:
    """What a Hub model card (`moa_hf.hub_cards`) says of a kind; the rest of the card comes from the drafter's config.

    summary: the kind, with its article ("A **... drafter**"). paper: markdown link(s) to its paper. reads: what it
    reads of the target, after "It reads" (`{target_layers}`: the target's layer count). limitation: what the target
    must offer for it. tags: the card's Hub tags for it (besides `hub_cards.REQUIRED_TAGS`). citation: BibTeX.
    """

    summary: str
    paper: str
    reads: str
    limitation: str
    tags: tuple[str, ...]
    citation: str


@dataclass(frozen=True)
class DrafterType:
    """One kind of drafter.

    kind: its `--kind` name. model_class / config_class: the classes it loads with (None, None: any causal LM,
    loaded with `AutoModelForCausalLM`; at most one kind is that fallback). training_adapter: "module:Class" of its
    training adapter (the training package imports moa_hf, never the other way). label: how cards and reports name
    it. build_hint: how to get one, for error messages. engine_support: the tree engine drafts with it (the
    `tree_*` protocol). vllm_support: `moa_hf.vllm` serves it. publishable: `moa publish` makes a Hub repo of it,
    whose card describes its config. tunable: `moa tune --write` stores tuned settings in its config.
    bench_methods: the `moa bench` methods that run it, the first through assisted generation (the others are
    `moa_hf.bench.methods`' engine methods or config overrides of it); its folder is `moa bench --KIND`, whose default
    is bench_default (None: the methods need the flag). sorted_exits: a config with `num_blocks` > 1 drafts from
    several exits (`moa bench` adds per-exit methods of its first assisted and engine methods). card: what its Hub
    model card says of it (None: no card; a publishable kind needs one), whose numbers are its first bench method's.
    """

    kind: str
    model_class: type | None
    config_class: type | None
    training_adapter: str
    label: str
    build_hint: str
    engine_support: bool = False
    vllm_support: bool = False
    publishable: bool = False
    tunable: bool = False
    bench_methods: tuple[str, ...] = ()
    bench_default: str | None = None
    sorted_exits: bool = False
    card: DrafterCard | None = None

    @property
    def remote_code_files(self) -> tuple[str, ...]:
        """The files of `modeling/` a Hub repo of this kind carries for `trust_remote_code`: its modeling file and
        every file it imports relatively (what transformers copies and loads), sorted; () for the fallback."""
        if self.model_class is None:
            return ()
        from transformers.dynamic_module_utils import get_relative_import_files

        source = inspect.getfile(self.model_class)
        return tuple(sorted({Path(f).name for f in get_relative_import_files(source)} | {Path(source).name}))

    @property
    def auto_map(self) -> dict[str, str] | None:
        """config.json's `auto_map` of a Hub repo of this kind (its classes by remote-code file); None: fallback."""
        if self.model_class is None or self.config_class is None:
            return None
        classes = (self.config_class, self.model_class)
        config, model = (f"{c.__module__.rpartition('.')[2]}.{c.__name__}" for c in classes)
        return {"AutoConfig": config, "AutoModel": model}

    @property
    def model_type(self) -> str | None:
        """The config's `model_type` that identifies it (None: the fallback, any other causal LM)."""
        return None if self.config_class is None else self.config_class.model_type

    @property
    def is_fallback(self) -> bool:
        return self.config_class is None


_REGISTRY: dict[str, DrafterType] = {}


def register_drafter_type(record: DrafterType) -> DrafterType:
    """Add a kind of drafter to the registry (a kind or model_type registered twice is an error)."""
    if record.kind in _REGISTRY:
        raise ValueError(f"A drafter kind {record.kind!r} is already registered; choose another name.")
    for other in _REGISTRY.values():
        if other.model_type == record.model_type:
            what = f"model_type {record.model_type!r}" if record.model_type else "the fallback (any causal LM)"
            raise ValueError(f"{what} is already the drafter kind {other.kind!r}; register it once.")
    _REGISTRY[record.kind] = record
    return record


def drafter_types() -> tuple[DrafterType, ...]:
    """Every registered kind, in registration order."""
    return tuple(_REGISTRY.values())


def drafter_kinds() -> tuple[str, ...]:
    """The registered kind names, e.g. ("moa", "eagle", "independent")."""
    return tuple(_REGISTRY)


def _model_type_of(obj) -> str | None:
    if isinstance(obj, Mapping):  # a config.json
        return obj.get("model_type")
    config = getattr(obj, "config", obj)  # a model (also one loaded as Hub remote code), or a config
    if isinstance(config, type):  # a model or config class
        config = getattr(config, "config_class", config)
    return getattr(config, "model_type", None)


def drafter_type(obj) -> DrafterType:
    """The registered kind of `obj`: a kind name ("moa"), a model, a config, a config.json dict, a model or config
    class, or a model_type string. A model or config of no registered model_type is the fallback kind (any causal
    LM: "independent"); an unknown kind name is a ValueError listing the known ones."""
    if isinstance(obj, str):
        if obj in _REGISTRY:
            return _REGISTRY[obj]
        found = next((t for t in _REGISTRY.values() if t.model_type == obj), None)
        if found is not None:
            return found
        raise ValueError(f"Unknown drafter kind {obj!r}; use one of {', '.join(_REGISTRY)}.")
    model_type = _model_type_of(obj)
    found = next((t for t in _REGISTRY.values() if t.model_type is not None and t.model_type == model_type), None)
    if found is None:
        found = next((t for t in _REGISTRY.values() if t.is_fallback), None)
    if found is None:
        raise ValueError(f"{type(obj).__name__} (model_type {model_type!r}) is no registered kind of drafter.")
    return found


# ---------------------------------------------------------------------------------------------------------------------
# The registrations
# ---------------------------------------------------------------------------------------------------------------------
register_drafter_type(
    DrafterType(
        kind="moa",
        model_class=MoADrafterModel,
        config_class=MoADrafterConfig,
        training_adapter="moa_hf.training.drafters:MoAAdapter",
        label="MoA drafter",
        build_hint="train one with `moa train` (see README) or pass --moa PATH",
        engine_support=True,
        vllm_support=True,
        publishable=True,
        tunable=True,
        bench_methods=("moa", "moa_nolookup", "moa_tree", "moa_tree_nolookup", "moa_chain"),
        bench_default="default",
        sorted_exits=True,
        card=DrafterCard(
            summary="A **Mixture-of-Attentions (MoA) drafter**",
            paper="[Zimmer et al., ICLR 2025](https://arxiv.org/abs/2410.03804)",
            reads="the target's key/value cache (Layer Self-Attention across all {target_layers} target layers)",
            limitation="The target must keep per-token keys/values in every layer (full, sliding-window or chunked "
            "attention; no linear-attention or state-space layers), as the drafter reads them from its cache.",
            tags=("mixture-of-attentions",),
            citation="""@inproceedings{zimmer2025moa,
  title     = {Mixture of Attentions For Speculative Decoding},
  author    = {Zimmer, Matthieu and Gritta, Milan and Lampouras, Gerasimos and Bou Ammar, Haitham and Wang, Jun},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2025},
  url       = {https://arxiv.org/abs/2410.03804}
}""",
        ),
    )
)
register_drafter_type(
    DrafterType(
        kind="eagle",
        model_class=EagleDrafterModel,
        config_class=EagleDrafterConfig,
        training_adapter="moa_hf.training.drafters:EagleAdapter",
        label="EAGLE drafter",
        build_hint="build one with `moa train --kind eagle ...` and pass --eagle PATH",
        engine_support=True,
        bench_methods=("eagle",),
        card=DrafterCard(
            summary="An **EAGLE-style feature drafter**",
            paper="[Li et al., ICML 2024](https://arxiv.org/abs/2401.15077)",
            reads="the target's final hidden state (the feature its LM head reads) of every verified token, never "
            "its key/value cache,",
            limitation="The target must be a decoder-only model with a standard config (hidden size, layers, "
            "attention heads, vocabulary), whose final hidden state the drafter reads.",
            tags=("eagle",),
            citation="""@inproceedings{li2024eagle,
  title     = {{EAGLE}: Speculative Sampling Requires Rethinking Feature Uncertainty},
  author    = {Li, Yuhui and Wei, Fangyun and Zhang, Chao and Zhang, Hongyang},
  booktitle = {International Conference on Machine Learning (ICML)},
  year      = {2024},
  url       = {https://arxiv.org/abs/2401.15077}
}""",
        ),
    )
)
register_drafter_type(
    DrafterType(
        kind="independent",
        model_class=None,
        config_class=None,
        training_adapter="moa_hf.training.drafters:IndependentAdapter",
        label="independent draft model",
        build_hint="build one with `moa train --kind independent ...` and pass --independent PATH",
        bench_methods=("independent",),
    )
)
