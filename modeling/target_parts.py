"""Several targets per MoA drafter, and attaching to one: what an extra target keeps of its own (`MoATargetParts`:
its LSA input projection and `MoALoRA` low-rank deltas on the shared linear layers, `MoALinear`); `MoATargets`, the
drafter's `targets`: which targets it serves, selecting one (`select`, `using`), adding one (`add`) and recognising a
target by its weights fingerprint (`identify`); and what attaching borrows of the target (`Attachment.borrow`,
`tli_decoder_reason`).

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_moa import PRIMARY_TARGET, tli_unsupported_reason, unsupported_target_reason
from .drafting import CACHE_NAME, FeatureTap, TargetTap, decoder_of, register_hooks, weights_difference
from .drafting import target_fingerprint as fingerprint_of

__all__ = [
    "Attachment",
    "MoALinear",
    "MoALoRA",
    "MoATargetParts",
    "MoATargets",
    "full_attention_rotary",
    "tli_decoder_reason",
]


class MoALinear(nn.Linear):
    """`nn.Linear` plus the low-rank delta of the drafter's active target, if it has one (`MoATargetParts`):
    y = x W^T + (x A^T) B^T. `delta` = (A [r, in], B [out, r]) is a plain reference set by `select_target`."""

    delta: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.delta is not None:
            a, b = self.delta
            y = y + F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
        return y


class MoALoRA(nn.Module):
    """One low-rank delta of an extra target on a shared linear layer: A [r, in] (small random), B [out, r] (zero at
    first, so a new target drafts as the primary one until trained); the layer adds (x A^T) B^T."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))


class MoATargetParts(nn.Module):
    """What a drafter keeps per extra target (`MoADrafterModel.add_target`): its own LSA input projection (targets
    differ in the keys/values the LSA reads; [W, lsa_hidden] as the primary's, or [W, W] starting as the identity
    when the primary reads them directly) and, with `lora_rank` r > 0, a `MoALoRA` for every linear layer of the
    shared SA/CA blocks (`lora`, keyed by the layer's name with "." -> "__")."""

    def __init__(self, kv_width: int, lsa_hidden_size: int, linears: dict[str, nn.Linear], lora_rank: int):
        super().__init__()
        self.lsa_in_proj = nn.Linear(kv_width, lsa_hidden_size, bias=False)
        self.lsa_in_proj.identity_init = kv_width == lsa_hidden_size
        self.lora = nn.ModuleDict(
            {
                name.replace(".", "__"): MoALoRA(linear.in_features, linear.out_features, lora_rank)
                for name, linear in (linears.items() if lora_rank > 0 else ())
            }
        )

    def delta(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of the shared linear layer `name`, or None (no delta)."""
        lora = self.lora[name.replace(".", "__")] if name.replace(".", "__") in self.lora else None
        return None if lora is None else (lora.A, lora.B)


def full_attention_rotary(decoder: nn.Module) -> Callable | None:
    """The target's RoPE of its full-attention layers, which Target Layer Inference runs (`tli_unsupported_reason`):
    `decoder.rotary_emb`, with `layer_type="full_attention"` where it has one RoPE per layer type (Gemma 3)."""
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type="full_attention")
    return rotary


@dataclass
class Attachment:
    """References to the target's modules the drafter borrows (plain references: not submodules, never saved)."""

    target: nn.Module
    embed: nn.Module
    lm_head: nn.Module
    tli_layers: list
    final_norm: nn.Module | None
    rotary: Callable | None
    tap: TargetTap
    handles: list
    features: FeatureTap | None = None  # the target's final hidden states, for `context_final_hidden`

    @classmethod
    def borrow(
        cls, target: nn.Module, tap: TargetTap, num_tli_layers: int, features: FeatureTap | None = None
    ) -> "Attachment":
        """Borrow the target's embedding, LM head (and last `num_tli_layers` layers with its final norm and RoPE) and
        register `tap`'s hooks on it (and `features`' on its decoder, when given; all removed again with
        `handles`)."""
        n, decoder = num_tli_layers, decoder_of(target)
        handles = register_hooks(target, tap)
        if features is not None:
            try:
                handles += register_hooks(decoder, features)
            except BaseException:
                for handle in handles:
                    handle.remove()
                raise
        return cls(
            target=target,
            embed=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            tli_layers=list(decoder.layers[len(decoder.layers) - n :]) if n > 0 else [],
            final_norm=getattr(decoder, "norm", None) if n > 0 else None,
            rotary=full_attention_rotary(decoder) if n > 0 else None,
            tap=tap,
            handles=handles,
            features=features,
        )

    def final_hidden(self, start: int, end: int) -> torch.Tensor:
        """The target's final hidden states [B, end-start, D] of verified positions [start, end), as the hook on its
        decoder (`features`) recorded them (a drafter with `context_final_hidden`)."""
        if self.features is None or self.features.length < end:
            raise RuntimeError(
                f"The target's final hidden states up to position {end - 1} were not recorded: the drafter reads them "
                "with a hook on the target's decoder, which missed a target call (was the target called outside "
                "`generate` between drafting calls?). Start a new `generate` call."
            )
        return self.features.features[:, start:end]

    @property
    def tli_dtype(self) -> torch.dtype:
        """The dtype of the borrowed last layers (their keys/values and masks take it)."""
        return next(self.tli_layers[0].parameters()).dtype

    def run_tli(self, h: torch.Tensor, positions: torch.Tensor, tli_cache, mask=None) -> torch.Tensor:
        """Target Layer Inference: the borrowed last N layers (their keys/values of earlier positions in `tli_cache`)
        and final norm on h [B, T, d] at `positions` [1, T]; `mask`: additive [B, 1, T, S] or None."""
        x = h.to(self.tli_dtype)
        position_ids = positions.expand(h.shape[0], -1)  # [B, T]
        cos_sin = self.rotary(x, position_ids)
        for layer in self.tli_layers:
            x = layer(
                x,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=cos_sin,
                **{CACHE_NAME: tli_cache},
            )
            x = x[0] if isinstance(x, tuple) else x
        return self.final_norm(x).to(h.dtype)


def tli_decoder_reason(target: nn.Module, num_tli_layers: int) -> str | None:
    """Why the target's decoder cannot run Target Layer Inference over its last `num_tli_layers` layers (a
    sentence), or None."""
    if num_tli_layers <= 0:
        return None
    decoder = decoder_of(target)
    for attr in ("layers", "norm", "rotary_emb"):
        if not hasattr(decoder, attr):
            return (
                f"target_layer_inference={num_tli_layers} needs the target's decoder to expose `{attr}` "
                f"({type(decoder).__name__} does not). Use target_layer_inference=0 for this target."
            )
    return None


class MoATargets:
    """The targets a `MoADrafterModel` serves and the one it drafts for (the drafter's `targets`, as PEFT's tuner
    layers hold their adapters): `PRIMARY_TARGET` ("main"), served by the shared weights alone, then one per
    `config.extra_targets` entry with parts of its own (`MoATargetParts`, in `parts`: the drafter's `target_parts`
    module dict, so their state-dict keys are `target_parts.<name>.…`).

    `shared_linears()` gives the linear layers of the drafter's SA/CA blocks (read at each call: a layer replaced
    after construction is seen), on which `select` sets the selected target's low-rank deltas.
    """

    def __init__(self, config, parts: nn.ModuleDict, shared_linears: Callable[[], dict[str, MoALinear]]):
        self.config = config
        self.parts = parts
        self.shared_linears = shared_linears
        self.active = PRIMARY_TARGET

    @property
    def names(self) -> list[str]:
        """`PRIMARY_TARGET` first, then `config.extra_targets`."""
        return [PRIMARY_TARGET, *(self.config.extra_targets or {})]

    def paths(self) -> dict[str, str | None]:
        """{name: target_name_or_path} of every target served, the primary first."""
        extra = {n: spec.get("target_name_or_path") for n, spec in (self.config.extra_targets or {}).items()}
        return {PRIMARY_TARGET: self.config.target_name_or_path, **extra}

    def describe(self) -> str:
        """The targets served, for error messages: "'main' (path), 'ft' (path)"."""
        return ", ".join(f"{n!r} ({path})" for n, path in self.paths().items())

    def check_name(self, name: str) -> None:
        if name not in self.names:
            raise ValueError(
                f"Unknown target {name!r}: this drafter serves {self.describe()}. Add one with "
                "`drafter.add_target(name, model)`."
            )

    def select(self, name: str) -> None:
        """Draft (and train) with the parts of target `name`: its LSA input projection and low-rank deltas; "main":
        the shared weights alone."""
        self.check_name(name)
        parts = self.parts[name] if name != PRIMARY_TARGET else None
        for layer_name, linear in self.shared_linears().items():
            linear.delta = parts.delta(layer_name) if parts is not None else None  # plain references, not submodules
        self.active = name

    @contextlib.contextmanager
    def using(self, name: str | None):
        """`with targets.using(name):` the parts of `name` inside (None: the active ones), the previous selection
        restored after."""
        previous = self.active
        self.select(previous if name is None else name)
        try:
            yield self
        finally:
            self.select(previous)

    def lsa_in_proj(self, primary: nn.Module | None) -> nn.Module | None:
        """The active target's LSA input projection (`primary`: the primary target's, None where the LSA reads the
        keys/values directly)."""
        return primary if self.active == PRIMARY_TARGET else self.parts[self.active].lsa_in_proj

    def part_parameters(self, name: str, primary: nn.Module | None) -> list[nn.Parameter]:
        """The parameters only target `name` uses: its LSA input projection and low-rank deltas (for "main", the
        `primary` LSA input projection, if any)."""
        self.check_name(name)
        if name == PRIMARY_TARGET:
            return [] if primary is None else list(primary.parameters())
        return list(self.parts[name].parameters())

    def new_parts(self, lora_rank: int) -> MoATargetParts:
        c = self.config
        return MoATargetParts(c.lsa_input_width, c.lsa_hidden_size, self.shared_linears(), lora_rank)

    @torch.no_grad()
    def add(
        self,
        name: str,
        target: PreTrainedModel | None = None,
        *,
        target_name_or_path: str | None = None,
        target_fingerprint: str | None = None,
        lora_rank: int = 0,
        signature_differences: tuple[str, ...] | list[str] = (),
        primary: nn.Module | None = None,
        device=None,
        dtype=None,
    ) -> None:
        """Serve another target of the primary one's signature (e.g. a fine-tune of it) with parts of its own: an LSA
        input projection copied from `primary` (the primary's; the identity where the primary reads the keys/values
        directly) and, with `lora_rank` > 0, low-rank deltas on every linear layer of the SA/CA blocks, zero at first
        (so it first drafts as for the primary). Train them alone with `part_parameters(name)` (see
        docs/training.md). `target` (the model, whose `signature_differences` from the primary's must be none) gives
        the name and fingerprint by which `identify` recognises it; without it pass them, or `select` it."""
        if target is not None:
            if signature_differences:
                raise ValueError(
                    f"Target {name!r} cannot share this drafter: its signature differs from the primary target's ("
                    + "; ".join(signature_differences)
                    + "). A drafter serves targets of one architecture and vocabulary; train another for this one."
                )
            target_name_or_path = target_name_or_path or getattr(target.config, "name_or_path", None) or None
            target_fingerprint = target_fingerprint or fingerprint_of(target)
        spec = {"target_name_or_path": target_name_or_path, "target_fingerprint": target_fingerprint}
        if name in self.names:
            raise ValueError(f"This drafter already serves a target named {name!r}: choose another name.")
        extra = {**(self.config.extra_targets or {}), name: {**spec, "lora_rank": int(lora_rank)}}
        self.config.validate_sorted(extra)  # raises before anything changes
        parts = self.new_parts(int(lora_rank))
        if primary is not None:
            parts.lsa_in_proj.weight.copy_(primary.weight)
        else:
            nn.init.eye_(parts.lsa_in_proj.weight)
        self.config.extra_targets = extra
        self.parts[name] = parts.to(device=device, dtype=dtype)
        self.select(self.active)

    def identify(self, target: PreTrainedModel) -> str | None:
        """The name of the served target whose recorded fingerprint `target`'s weights have (the primary first), or
        None (no match, or no fingerprints to compare)."""
        recorded = {PRIMARY_TARGET: self.config.target_fingerprint}
        recorded.update({n: s.get("target_fingerprint") for n, s in (self.config.extra_targets or {}).items()})
        if not any(recorded.values()):
            return None
        actual = fingerprint_of(target)
        return next((n for n, fp in recorded.items() if fp and weights_difference(fp, actual) == ""), None)

    def check(
        self,
        target: PreTrainedModel,
        allow_other_target: bool,
        check_signature: Callable[[PreTrainedModel, bool], None],
        other_target_reason: Callable[[PreTrainedModel], str | None],
    ) -> str | None:
        """Raise a `ValueError` saying what is wrong if the drafter cannot serve `target`; else the name of the served
        target it is (None: another model, accepted with `allow_other_target`). `check_signature(target, allow)` and
        `other_target_reason(target)`: the drafter's checks of the primary target (`DrafterMixin`)."""
        n = self.config.target_layer_inference
        reason = unsupported_target_reason(target.config) or tli_unsupported_reason(target.config, n)
        if reason is not None:
            raise ValueError(f"This target cannot be served by a MoA drafter: {reason}.")
        name = self.identify(target) if self.config.extra_targets else None
        try:
            check_signature(target, allow_other_target or name is not None)
        except ValueError as err:
            if not self.config.extra_targets:
                raise
            raise ValueError(f"{err} This drafter serves: {self.describe()}.") from None
        reason = tli_decoder_reason(target, n)
        if reason is not None:
            raise ValueError(reason)
        return name if name is not None else (None if other_target_reason(target) else PRIMARY_TARGET)
