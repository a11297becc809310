"""One training adapter per drafter class: how the training code builds, prepares, runs and reads a drafter.

`ADAPTERS` maps a drafter class to its adapter (as PEFT maps a model type to its tuner); `adapter_for` picks the
adapter of a model (under any PEFT / DDP / torch.compile wrapper) by its class, `adapter_named` the one a name picks
(`moa train --kind`). The MoA and EAGLE-style drafters' `forward` takes the target's states itself; any other causal
LM is an independent assistant, distilled from the target's next-token distribution alone.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Iterator

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import PreTrainedModel

from moa_hf import EagleDrafterConfig, EagleDrafterModel, MoADrafterModel, build_drafter, target_fingerprint
from moa_hf.drafter_types import DrafterType, drafter_types
from moa_hf.modeling import PRIMARY_TARGET, fixed_exit_thresholds

from .builders import build_independent, frequent_tokens
from .builders import init_from_target_layer as copy_target_layer
from .states import TargetStates

__all__ = [
    "ADAPTERS",
    "KINDS",
    "DrafterAdapter",
    "ExitStates",
    "EagleAdapter",
    "IndependentAdapter",
    "MoAAdapter",
    "adapter_for",
    "adapter_named",
    "build_for_kind",
    "drafter_kind",
    "unwrap_drafter",
    "unwrap_model",
]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / FSDP / DeepSpeed / torch.compile (accelerate's `extract_model_from_parallel`) and PEFT
    wrappers (itself when unwrapped)."""
    seen = extract_model_from_parallel(model, keep_torch_compile=False)
    while hasattr(seen, "get_base_model"):  # peft.PeftModel
        seen = extract_model_from_parallel(seen.get_base_model(), keep_torch_compile=False)
    return seen


# (student [B, T, d]: the hidden states the drafter's head reads at one exit, feature [B, T, d]: its prediction of the
# target's feature there, or None when it has none); a drafter returns one pair per exit, exit 1 first.
ExitStates = list[tuple[torch.Tensor, "torch.Tensor | None"]]


# ---------------------------------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------------------------------
class DrafterAdapter:
    """What the training code needs to know about one class of drafter.

    An adapter is built from its registration (`moa_hf.drafter_types`), which names it as `training_adapter`.

    Attributes:
        record: its `DrafterType` registration.
        model_class: the drafters it serves (and their subclasses, unless one has its own adapter): the registered
            model class, `PreTrainedModel` for the fallback kind (any causal LM).
        name: the `moa train --kind` choice that picks it (the registered kind).
        options: `moa train` drafter options (`DrafterArguments` fields) -> the keyword of `build` each one sets.
        simulates_cycles: trained through simulated drafting cycles (the staircase of the target's states).
        needs_target_kv: reads the target's keys/values (cached target states must hold them).
    """

    options: dict[str, str] = {}
    simulates_cycles: bool = False
    needs_target_kv: bool = False

    def __init__(self, record: DrafterType):
        self.record = record
        self.name = record.kind
        self.model_class: type[torch.nn.Module] = record.model_class or PreTrainedModel

    def build(self, target: PreTrainedModel, *, data=None, **overrides) -> torch.nn.Module:
        """A fresh fp32 drafter for `target`; `overrides`: its config fields (see `options`); `data`: the training
        dataset, for initialisations that read it."""
        raise NotImplementedError

    def prepare(self, drafter: torch.nn.Module, target: PreTrainedModel) -> None:
        """Before training `drafter` (unwrapped) against `target`."""

    def target_layer_inference(self, drafter: torch.nn.Module) -> int:
        """N: the target's last N layers run inside the drafter (their inputs are part of the target's states)."""
        return 0

    def num_exits(self, drafter: torch.nn.Module) -> int:
        """How many exits (depths that each draft with the shared head) the drafter has."""
        return getattr(drafter.config, "num_blocks", 1) if hasattr(drafter, "config") else 1

    def add_targets(self, drafter: torch.nn.Module, targets: dict[str, PreTrainedModel], lora_rank: int = 0) -> list:
        """Give `drafter` parts for every target of `targets` (name -> model) beyond its primary one that it lacks;
        the names added."""
        others = [name for name in targets if name != PRIMARY_TARGET]
        if others:
            raise ValueError(
                f"A {type(drafter).__name__} serves one target (`{PRIMARY_TARGET}`), not {others}: train a MoA "
                "drafter for several targets."
            )
        return []

    def train_only_target_parts(self, drafter: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
        """Freeze every parameter of `drafter` except the per-target parts of target `name`; those parameters."""
        raise ValueError(f"A {type(drafter).__name__} has no per-target parts; train a MoA drafter.")

    def train_deeper_blocks(
        self, drafter: torch.nn.Module, frozen: int, others: list[str]
    ) -> list[torch.nn.Parameter]:
        """Freeze blocks 1..`frozen` and everything the primary target's first exits read; train the deeper blocks
        and the parts of targets `others`. Those parameters."""
        raise ValueError(f"A {type(drafter).__name__} has no blocks to grow; train a sorted MoA drafter.")

    def use_target(self, drafter: torch.nn.Module, target: PreTrainedModel) -> None:
        """Before a batch of `target`'s data: borrow that target's modules (embedding, head) where the drafter
        does."""

    def select_target(self, drafter: torch.nn.Module, name: str | None) -> None:
        """Draft with the parts of target `name` (None: as chosen when attaching)."""
        if name not in (None, PRIMARY_TARGET):
            raise ValueError(f"A {type(drafter).__name__} serves one target (`{PRIMARY_TARGET}`), not {name!r}.")

    def training_forward(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        states: TargetStates,
        cycle_starts: torch.Tensor | None = None,
        sa_mask: torch.Tensor | None = None,
        feature_noise: float = 0.0,
        target_name: str | None = None,
    ) -> ExitStates:
        """[(student, feature)] per exit (see `ExitStates`) for a training batch of target `target_name`'s data
        (None: the drafter's active target). `model` may be wrapped (PEFT / DDP)."""
        raise NotImplementedError

    def context_ablated(self, drafter: torch.nn.Module):
        """A context manager inside which `drafter` runs without the target's state (MoA: zero context vectors)."""
        raise ValueError(
            f"A {type(drafter).__name__} has no context vectors to withhold: --eval-context-ablation is for MoA "
            "drafters."
        )

    def student_head(self, drafter: torch.nn.Module):
        """(head, column ids): what turns the drafter's hidden states [n, d] into its logits, and the
        full-vocabulary ids of those logits' columns (None: the full vocabulary itself)."""
        raise NotImplementedError

    @torch.no_grad()
    def top1(self, drafter: torch.nn.Module, hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """The drafter's most likely next token (full-vocabulary ids) [n] for the hidden states [n, d] its head
        (`student_head`) reads, `chunk` rows at a time."""
        head, draft_ids = self.student_head(drafter)
        top = torch.cat([head(hidden[i : i + chunk]).argmax(-1) for i in range(0, max(len(hidden), 1), chunk)])
        return top if draft_ids is None else draft_ids.to(top.device)[top]

    @contextlib.contextmanager
    def generating(
        self,
        drafter: torch.nn.Module,
        target: PreTrainedModel,
        target_name: str | None = None,
        exit: int | None = None,
    ) -> Iterator[None]:
        """`drafter` ready to draft for `target` (with its parts of target `target_name`, when given) in
        `target.generate(assistant_model=...)` inside the block, with the library's default speculation settings
        (comparable points of a learning curve); `exit` (1-based): always draft from that exit (None: as the drafter
        does by default)."""
        if exit not in (None, 1):
            raise ValueError(f"A {type(drafter).__name__} has one exit, not {exit}.")
        yield


class _AttachingAdapter(DrafterAdapter):
    """A drafter of this library: it attaches to the target (borrowed embedding / head, hooks reading the target's
    states)."""

    def build(self, target, *, data=None, init_from_target_layer: int | None = None, **overrides):
        """`new_drafter`; with `init_from_target_layer` (an index), its decoder layers start from that target
        layer's weights."""
        drafter = self.new_drafter(target, data=data, **overrides)
        if init_from_target_layer is not None:
            copy_target_layer(drafter, target, init_from_target_layer)
        return drafter

    def new_drafter(self, target: PreTrainedModel, data=None, **overrides) -> torch.nn.Module:
        """A fresh fp32 drafter for `target` (`overrides`: its config fields); its config records
        `target_fingerprint(target)`, the weights it serves without `allow_other_target`."""
        raise NotImplementedError

    def prepare(self, drafter, target) -> None:
        if getattr(drafter.config, "own_embeddings", False):  # frozen copies of the target's embedding / head
            drafter.embed_tokens.requires_grad_(False)
            drafter.lm_head.requires_grad_(False)
        drafter.attach(target, allow_other_target=True)

    def use_target(self, drafter, target) -> None:
        drafter.attach(target, allow_other_target=True)  # nothing to do when attached to it already

    def student_head(self, drafter):
        return drafter.head, None

    @contextlib.contextmanager
    def generating(self, drafter, target, target_name=None, exit=None) -> Iterator[None]:
        num_exits = self.num_exits(drafter)
        if exit is not None and not 1 <= exit <= num_exits:
            raise ValueError(f"This drafter has exits 1..{num_exits}, not {exit}.")
        drafter.attach(target, allow_other_target=True)  # the target it drafts for (a no-op when attached already)
        self.select_target(drafter, target_name)
        own = getattr(drafter, "generation_config", None)
        lookup = drafter.config.lookup_num_tokens if drafter.supports_prompt_lookup else 0
        drafter.generation_config = drafter.default_generation_config(copy.deepcopy(own))
        if lookup:
            drafter.config.lookup_num_tokens = 0  # the network alone: no prompt lookup
        fixed = fixed_exit_thresholds(exit, num_exits) if exit is not None and num_exits > 1 else None
        try:
            with drafter.override_exit_thresholds(fixed) if fixed is not None else contextlib.nullcontext():
                yield  # always exit `exit`, or the target's own thresholds
        finally:
            drafter.generation_config = own
            if lookup:
                drafter.config.lookup_num_tokens = lookup


def _train_only(drafter: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Freeze every parameter of `drafter` but `params`; returns `params`."""
    drafter.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


class MoAAdapter(_AttachingAdapter):
    """`MoADrafterModel`: reads the target's keys/values of every layer through simulated drafting cycles."""

    options = {
        "own_embeddings": "own_embeddings",
        "target_layer_inference": "target_layer_inference",
        "draft_vocab_size": "draft_vocab_size",
        "lsa_hidden_size": "lsa_hidden_size",
        "intermediate_size": "intermediate_size",
        "lsa_keys": "lsa_keys",
        "lsa_layers": "lsa_layers",
        "lsa_pooling": "lsa_pooling",
        "context_final_hidden": "context_final_hidden",
        "ca_latest_context": "ca_latest_context",
        "init_from_target_layer": "init_from_target_layer",
        "num_blocks": "num_blocks",
        "block_size": "block_size",
        "block_markov_rank": "block_markov_rank",
    }
    simulates_cycles = True
    needs_target_kv = True

    def new_drafter(self, target, data=None, **overrides):
        """`moa_hf.build_drafter`; with a draft vocabulary and `data`, the `draft_vocab_size` most frequent tokens of
        the target's responses in `data`."""
        drafter = build_drafter(target, **overrides)
        size = drafter.config.draft_vocab_size
        if size and data is not None:
            ids = frequent_tokens(data, size, target.config.get_text_config().vocab_size)
            drafter.init_draft_vocab(ids, target.get_output_embeddings().weight)
        return drafter

    def context_ablated(self, drafter):
        return unwrap_model(drafter).context_ablated()

    def target_layer_inference(self, drafter) -> int:
        return drafter.config.target_layer_inference

    def select_target(self, drafter, name) -> None:
        if name is not None:
            drafter.select_target(name)

    def add_targets(self, drafter, targets, lora_rank=0) -> list:
        """`MoADrafterModel.add_target` for every non-primary target of `targets` that `drafter` lacks."""
        added = [name for name in targets if name != PRIMARY_TARGET and name not in drafter.target_names]
        for name in added:
            drafter.add_target(name, targets[name], lora_rank=lora_rank)
        return added

    def train_only_target_parts(self, drafter, name) -> list:
        if name not in drafter.target_names:
            raise ValueError(
                f"The drafter has no target {name!r} (it has {drafter.target_names}); name that target's model with "
                f"--target {name}=SPEC so that its parts are created first."
            )
        params = list(drafter.target_part_parameters(name))
        if not params:
            raise ValueError(f"Target {name!r} of this drafter has no parameters of its own to train.")
        return _train_only(drafter, params)

    def train_deeper_blocks(self, drafter, frozen, others) -> list:
        num_blocks = drafter.config.num_blocks
        if not 1 <= frozen < num_blocks:
            raise ValueError(
                f"freeze_blocks={frozen}, but the drafter has {num_blocks} block(s): freeze 1..{num_blocks - 1} "
                "of them (add blocks with --num-blocks)."
            )
        params = [p for block in drafter.blocks[frozen - 1 :] for p in block.parameters()]  # blocks holds 2..K
        params += [p for name in others for p in drafter.target_part_parameters(name)]
        return _train_only(drafter, params)

    def training_forward(
        self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0, target_name=None,
        block_anchors=None,
    ):  # fmt: skip
        outputs = model(
            input_ids=inputs["input_ids"],
            block_anchors=block_anchors,
            target_kv=states.kv,
            target_hidden=states.final_hidden,
            target_kv_held=states.held,
            cycle_starts=cycle_starts,
            sa_mask=sa_mask,
            target_tli_kv=states.tli_kv,
            return_logits=False,
            exits="all",
            target_name=target_name,
        )
        features = outputs.exit_hidden_states  # K x [B, T, d], exit 1 first
        if outputs.final_hidden_states is None:
            return [(feature, feature) for feature in features]
        if len(features) > 1:  # TLI: the target's last layers run after the last exit only
            raise ValueError("Target layer inference (target_layer_inference > 0) needs num_blocks=1.")
        return [(outputs.final_hidden_states, features[0])]

    def student_head(self, drafter):
        if drafter.config.draft_vocab_size is not None:
            return drafter.draft_logits, drafter.draft_ids
        return drafter.head, None


class EagleAdapter(_AttachingAdapter):
    """`EagleDrafterModel`: teacher-forced, input i reads the target's final hidden state of token i-1."""

    options = {"init_from_target_layer": "init_from_target_layer"}

    def new_drafter(self, target, data=None, **overrides):
        overrides = {"target_fingerprint": target_fingerprint(target), **overrides}
        return EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config, **overrides)).float()

    def training_forward(
        self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0, target_name=None,
        block_anchors=None,
    ):  # fmt: skip
        outputs = model(
            input_ids=inputs["input_ids"],
            block_anchors=block_anchors,
            target_hidden=states.final_hidden,
            attention_mask=inputs.get("attention_mask"),
            noise_std=feature_noise,
        )
        return [(outputs.hidden_states, outputs.hidden_states)]  # [B, T, d]: its head reads its feature


class IndependentAdapter(DrafterAdapter):
    """Any other causal LM: an ordinary assistant with its own embedding and head (`build_independent`: the target's
    first layers), trained on the soft cross-entropy to the target alone."""

    options = {"independent_layers": "num_layers"}

    def build(self, target, *, data=None, **overrides):
        return build_independent(target, **overrides)

    def training_forward(
        self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0, target_name=None,
        block_anchors=None,
    ):  # fmt: skip
        outputs = model(
            input_ids=inputs["input_ids"],
            block_anchors=block_anchors,
            attention_mask=inputs.get("attention_mask"),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return [(outputs.hidden_states[-1], None)]  # [B, T, d]: its own final (post-norm) hidden states

    def student_head(self, drafter):
        return drafter.get_output_embeddings(), None


def _registered_adapter(record: DrafterType) -> DrafterAdapter:
    """The training adapter a registration names ("module:Class")."""
    module, _, name = record.training_adapter.partition(":")
    return getattr(importlib.import_module(module), name)(record)


# one adapter per registered kind of drafter (`moa_hf.drafter_types`), by the class it serves
ADAPTERS: dict[type, DrafterAdapter] = {
    adapter.model_class: adapter for adapter in (_registered_adapter(record) for record in drafter_types())
}
KINDS = tuple(adapter.name for adapter in ADAPTERS.values())


# ---------------------------------------------------------------------------------------------------------------------
# Lookups
# ---------------------------------------------------------------------------------------------------------------------
def adapter_for(model: torch.nn.Module) -> DrafterAdapter:
    """The adapter of `model` (under any PEFT / DDP / compile wrapper): its class's nearest registered base."""
    seen = unwrap_model(model)
    for cls in type(seen).__mro__:
        if cls in ADAPTERS:
            return ADAPTERS[cls]
    raise TypeError(
        f"No training adapter for {type(seen).__name__}; train a MoADrafterModel, an EagleDrafterModel or a "
        "transformers causal LM (a PreTrainedModel)."
    )


def adapter_named(kind: str) -> DrafterAdapter:
    """The adapter a `moa train --kind` name picks."""
    for adapter in ADAPTERS.values():
        if adapter.name == kind:
            return adapter
    raise ValueError(f"Unknown drafter kind {kind!r}; use one of {', '.join(KINDS)}.")


def build_for_kind(kind: str, target: PreTrainedModel, **overrides) -> torch.nn.Module:
    """A fresh fp32 drafter of `kind` (one of `KINDS`) for `target` (`overrides`: see the adapter's `build`)."""
    return adapter_named(kind).build(target, **overrides)


def drafter_kind(model: torch.nn.Module) -> str:
    """The `--kind` name of `model`'s adapter (under any PEFT / DDP / compile wrapper)."""
    return adapter_for(model).name


def unwrap_drafter(model: torch.nn.Module) -> MoADrafterModel | EagleDrafterModel:
    """The drafter of a registered class (MoA, EAGLE-style; not the fallback, any causal LM) inside `model` (itself,
    or under a PEFT / DDP / compile wrapper)."""
    seen = unwrap_model(model)
    classes = tuple(t.model_class for t in drafter_types() if t.model_class is not None)
    if not isinstance(seen, classes):
        raise TypeError(
            f"Expected a {' or '.join(c.__name__ for c in classes)} (optionally wrapped by PEFT/DDP), got "
            f"{type(model).__name__}."
        )
    return seen
