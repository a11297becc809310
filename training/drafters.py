"""One training adapter per drafter class: how the training code builds, prepares, runs and reads a drafter.

`ADAPTERS` maps a drafter class to its adapter (as PEFT maps a model type to its tuner); `adapter_for` picks the
adapter of a model (under any PEFT / DDP / torch.compile wrapper) by its class, `adapter_named` the one a name picks
(`moa train --kind`). The MoA and EAGLE-style drafters' `forward` takes the target's states itself; any other causal
LM is an independent assistant, distilled from the target's next-token distribution alone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import PreTrainedModel

from moa_hf import EagleDrafterConfig, EagleDrafterModel, MoADrafterModel, build_drafter, target_fingerprint

from .builders import build_independent, frequent_tokens
from .builders import init_from_target_layer as copy_target_layer
from .states import TargetStates

__all__ = [
    "ADAPTERS",
    "KINDS",
    "DrafterAdapter",
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


# ---------------------------------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------------------------------
class DrafterAdapter:
    """What the training code needs to know about one class of drafter.

    Attributes:
        model_class: the drafters it serves (and their subclasses, unless one has its own adapter).
        name: the `moa train --kind` choice that picks it.
        options: `moa train` drafter options (`DrafterArguments` fields) -> the keyword of `build` each one sets.
        simulates_cycles: trained through simulated drafting cycles (the staircase of the target's states).
        needs_target_kv: reads the target's keys/values (cached target states must hold them).
    """

    model_class: type[torch.nn.Module]
    name: str = ""
    options: dict[str, str] = {}
    simulates_cycles: bool = False
    needs_target_kv: bool = False

    def build(self, target: PreTrainedModel, *, data=None, **overrides) -> torch.nn.Module:
        """A fresh fp32 drafter for `target`; `overrides`: its config fields (see `options`); `data`: the training
        dataset, for initialisations that read it."""
        raise NotImplementedError

    def prepare(self, drafter: torch.nn.Module, target: PreTrainedModel) -> None:
        """Before training `drafter` (unwrapped) against `target`."""

    def target_layer_inference(self, drafter: torch.nn.Module) -> int:
        """N: the target's last N layers run inside the drafter (their inputs are part of the target's states)."""
        return 0

    def training_forward(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        states: TargetStates,
        cycle_starts: torch.Tensor | None = None,
        sa_mask: torch.Tensor | None = None,
        feature_noise: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(student [B, T, d]: the hidden states the drafter's head reads, feature [B, T, d]: its prediction of the
        target's feature, or None when it has none) for a training batch. `model` may be wrapped (PEFT / DDP)."""
        raise NotImplementedError

    def student_head(self, drafter: torch.nn.Module):
        """(head, column ids): what turns the drafter's hidden states [n, d] into its logits, and the
        full-vocabulary ids of those logits' columns (None: the full vocabulary itself)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def generating(self, drafter: torch.nn.Module, target: PreTrainedModel) -> Iterator[None]:
        """`drafter` ready to draft for `target` in `target.generate(assistant_model=...)` inside the block, with the
        library's default speculation settings (comparable points of a learning curve)."""
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

    def student_head(self, drafter):
        return drafter.head, None

    @contextlib.contextmanager
    def generating(self, drafter, target) -> Iterator[None]:
        if not drafter.is_attached:
            drafter.attach(target, allow_other_target=True)
        own = getattr(drafter, "generation_config", None)
        lookup = drafter.config.lookup_num_tokens if drafter.supports_prompt_lookup else 0
        drafter.generation_config = drafter.default_generation_config(copy.deepcopy(own))
        if lookup:
            drafter.config.lookup_num_tokens = 0  # the network alone: no prompt lookup
        try:
            yield
        finally:
            drafter.generation_config = own
            if lookup:
                drafter.config.lookup_num_tokens = lookup


class MoAAdapter(_AttachingAdapter):
    """`MoADrafterModel`: reads the target's keys/values of every layer through simulated drafting cycles."""

    name = "moa"
    model_class = MoADrafterModel
    options = {
        "own_embeddings": "own_embeddings",
        "target_layer_inference": "target_layer_inference",
        "draft_vocab_size": "draft_vocab_size",
        "lsa_hidden_size": "lsa_hidden_size",
        "init_from_target_layer": "init_from_target_layer",
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

    def target_layer_inference(self, drafter) -> int:
        return drafter.config.target_layer_inference

    def training_forward(self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0):
        outputs = model(
            input_ids=inputs["input_ids"],
            target_kv=states.target_kv,
            target_kv_held=states.target_kv_held,
            cycle_starts=cycle_starts,
            sa_mask=sa_mask,
            target_tli_kv=states.tli_kv,
            return_logits=False,
        )
        feature = outputs.hidden_states  # [B, T, d]
        student = outputs.final_hidden_states if outputs.final_hidden_states is not None else feature
        return student, feature

    def student_head(self, drafter):
        if drafter.config.draft_vocab_size is not None:
            return drafter.draft_logits, drafter.draft_ids
        return drafter.head, None


class EagleAdapter(_AttachingAdapter):
    """`EagleDrafterModel`: teacher-forced, input i reads the target's final hidden state of token i-1."""

    name = "eagle"
    model_class = EagleDrafterModel
    options = {"init_from_target_layer": "init_from_target_layer"}

    def new_drafter(self, target, data=None, **overrides):
        overrides = {"target_fingerprint": target_fingerprint(target), **overrides}
        return EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config, **overrides)).float()

    def training_forward(self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0):
        outputs = model(
            input_ids=inputs["input_ids"],
            target_hidden=states.final_hidden,
            attention_mask=inputs.get("attention_mask"),
            noise_std=feature_noise,
        )
        return outputs.hidden_states, outputs.hidden_states  # [B, T, d]: its head reads its feature


class IndependentAdapter(DrafterAdapter):
    """Any other causal LM: an ordinary assistant with its own embedding and head (`build_independent`: the target's
    first layers), trained on the soft cross-entropy to the target alone."""

    name = "independent"
    model_class = PreTrainedModel
    options = {"independent_layers": "num_layers"}

    def build(self, target, *, data=None, **overrides):
        return build_independent(target, **overrides)

    def training_forward(self, model, inputs, states, cycle_starts=None, sa_mask=None, feature_noise=0.0):
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs.get("attention_mask"),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return outputs.hidden_states[-1], None  # [B, T, d]: its own final (post-norm) hidden states

    def student_head(self, drafter):
        return drafter.get_output_embeddings(), None


ADAPTERS: dict[type, DrafterAdapter] = {
    adapter.model_class: adapter for adapter in (MoAAdapter(), EagleAdapter(), IndependentAdapter())
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
    """The MoA (or EAGLE-style) drafter inside `model` (itself, or under a PEFT / DDP / compile wrapper)."""
    seen = unwrap_model(model)
    if not isinstance(seen, (MoADrafterModel, EagleDrafterModel)):
        raise TypeError(
            f"Expected a MoADrafterModel or EagleDrafterModel (optionally wrapped by PEFT/DDP), got "
            f"{type(model).__name__}."
        )
    return seen
