"""Several targets per MoA drafter, and attaching to one: what an extra target keeps of its own (`MoATargetParts`:
its LSA input projection and `MoALoRA` low-rank deltas on the shared linear layers, `MoALinear`), selecting them
(`select_target`, `using_target`), adding one (`add_target`), recognising a target by its weights fingerprint
(`target_for`) and attaching to it (`attach`, `check_target`), as `TargetPartsMixin`, a base of `MoADrafterModel`.

This file ships inside every Hub repo as remote code (a sibling of modeling_moa.py): it imports only torch,
transformers and its sibling files.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_moa import PRIMARY_TARGET, tli_unsupported_reason, unsupported_target_reason
from .drafting import TargetTap, decoder_of, register_hooks, weights_difference
from .drafting import target_fingerprint as fingerprint_of

if TYPE_CHECKING:  # annotations only
    from .modeling_moa import MoADrafterModel

__all__ = ["Attachment", "MoALinear", "MoALoRA", "MoATargetParts", "TargetPartsMixin", "full_attention_rotary"]


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


class TargetPartsMixin:
    """The per-target parts and attaching of `MoADrafterModel` (which provides `config`, `lsa_in_proj`, the blocks
    and the drafting session)."""

    def _shared_linears(self) -> dict[str, MoALinear]:
        """The linear layers of the SA/CA blocks, which an extra target's low-rank deltas adapt."""
        return {
            name: m
            for name, m in self.named_modules()
            if isinstance(m, MoALinear) and name.split(".")[0] in ("self_attention", "cross_attention", "blocks")
        }

    def _new_parts(self, lora_rank: int) -> MoATargetParts:
        c = self.config
        return MoATargetParts(c.target_kv_width, c.lsa_hidden_size, self._shared_linears(), lora_rank)

    @property
    def target_names(self) -> list[str]:
        """The targets this drafter serves: `PRIMARY_TARGET` ("main") first, then `config.extra_targets`."""
        return [PRIMARY_TARGET, *(self.config.extra_targets or {})]

    @property
    def active_target(self) -> str:
        return self._active_target

    def select_target(self, name: str) -> None:
        """Draft (and train, see `forward`'s `target_name`) with the parts of target `name`: its LSA input projection
        and low-rank deltas; "main" (`PRIMARY_TARGET`): the shared weights alone. `attach` selects by fingerprint."""
        self._check_target_name(name)
        parts = self.target_parts[name] if name != PRIMARY_TARGET else None
        for layer_name, linear in self._shared_linears().items():
            linear.delta = parts.delta(layer_name) if parts is not None else None  # plain references, not submodules
        self._active_target = name

    def _check_target_name(self, name: str) -> None:
        if name not in self.target_names:
            known = ", ".join(f"{n!r} ({path})" for n, path in self._target_paths().items())
            raise ValueError(
                f"Unknown target {name!r}: this drafter serves {known}. Add one with "
                "`drafter.add_target(name, model)`."
            )

    def _target_paths(self) -> dict[str, str | None]:
        """{name: target_name_or_path} of every target the drafter serves, the primary first."""
        extra = {n: spec.get("target_name_or_path") for n, spec in (self.config.extra_targets or {}).items()}
        return {PRIMARY_TARGET: self.config.target_name_or_path, **extra}

    @contextlib.contextmanager
    def using_target(self, name: str | None):
        """`with drafter.using_target(name):` the parts of `name` inside (None: the active ones), the previous
        selection restored after."""
        previous = self._active_target
        self.select_target(previous if name is None else name)
        try:
            yield self
        finally:
            self.select_target(previous)

    def target_part_parameters(self, name: str) -> list[nn.Parameter]:
        """The parameters only target `name` uses (to train a new target's parts alone): its LSA input projection and
        low-rank deltas; for "main", the primary LSA input projection (none when the LSA reads the keys/values
        directly)."""
        self._check_target_name(name)
        if name == PRIMARY_TARGET:
            return [] if self.lsa_in_proj is None else list(self.lsa_in_proj.parameters())
        return list(self.target_parts[name].parameters())

    @torch.no_grad()
    def add_target(
        self,
        name: str,
        target: PreTrainedModel | None = None,
        *,
        target_name_or_path: str | None = None,
        target_fingerprint: str | None = None,
        lora_rank: int = 0,
    ) -> None:
        """Serve another target of the primary one's signature (e.g. a fine-tune of it) with parts of its own
        (`MoATargetParts`): an LSA input projection copied from the primary's and, with `lora_rank` > 0, low-rank
        deltas on every linear layer of the SA/CA blocks, zero at first (so it first drafts as for the primary). Train
        them alone with `target_part_parameters(name)` (see docs/training.md). `target` (the model) gives the name
        and fingerprint by which `attach` recognises it; without it pass them, or select it with `select_target`."""
        if target is not None:
            diffs = self._signature_differences(target)
            if diffs:
                raise ValueError(
                    f"Target {name!r} cannot share this drafter: its signature differs from the primary target's ("
                    + "; ".join(diffs)
                    + "). A drafter serves targets of one architecture and vocabulary; train another for this one."
                )
            target_name_or_path = target_name_or_path or getattr(target.config, "name_or_path", None) or None
            target_fingerprint = target_fingerprint or fingerprint_of(target)
        if name in self.target_names:
            raise ValueError(f"This drafter already serves a target named {name!r}: choose another name.")
        spec = {"target_name_or_path": target_name_or_path, "target_fingerprint": target_fingerprint}
        extra = {**(self.config.extra_targets or {}), name: {**spec, "lora_rank": int(lora_rank)}}
        self.config.validate_sorted(extra)  # raises before anything changes
        parts = self._new_parts(int(lora_rank))
        if self.lsa_in_proj is not None:
            parts.lsa_in_proj.weight.copy_(self.lsa_in_proj.weight)
        else:  # the primary reads the keys/values directly: start from the identity
            nn.init.eye_(parts.lsa_in_proj.weight)
        self.config.extra_targets = extra
        if getattr(self, "target_parts", None) is None:
            self.target_parts = nn.ModuleDict()
        self.target_parts[name] = parts.to(device=self.device, dtype=self.dtype)
        self.select_target(self._active_target)

    def target_for(self, target: PreTrainedModel) -> str | None:
        """The name of the served target whose recorded fingerprint `target`'s weights have (the primary first), or
        None (no match, or no fingerprints to compare)."""
        recorded = {PRIMARY_TARGET: self.config.target_fingerprint}
        recorded.update({n: s.get("target_fingerprint") for n, s in (self.config.extra_targets or {}).items()})
        if not any(recorded.values()):
            return None
        actual = fingerprint_of(target)
        return next((n for n, fp in recorded.items() if fp and weights_difference(fp, actual) == ""), None)

    # ----------------------------------------------------------------------------------------------------------------
    # Attaching to the target
    # -----------------------------------------------------------------------------------------------------------------
    def attach(self, target: PreTrainedModel, allow_other_target: bool = False) -> "MoADrafterModel":
        """Borrow the target's embedding, LM head (and last N layers) and install hooks that expose its cache.

        Nothing on the target is modified: two forward hooks are registered and removed again by `detach`.
        """
        if self._attachment is not None:
            if self._attachment.target is target:
                return self
            self.detach()
        name = self.check_target(target, allow_other_target=allow_other_target)
        self.select_target(name or PRIMARY_TARGET)
        n = self.config.target_layer_inference
        decoder = decoder_of(target)
        tli_layers = list(decoder.layers[len(decoder.layers) - n :]) if n > 0 else []
        tap = TargetTap(on_new_session=self._start_session)
        handles = register_hooks(target, tap)
        self._attachment = Attachment(
            target=target,
            embed=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            tli_layers=tli_layers,
            final_norm=getattr(decoder, "norm", None) if n > 0 else None,
            rotary=full_attention_rotary(decoder) if n > 0 else None,
            tap=tap,
            handles=handles,
        )
        self._start_session()
        return self

    def check_target(self, target: PreTrainedModel, allow_other_target: bool = False) -> str | None:
        """Raise a `ValueError` saying what is wrong if this drafter cannot serve `target`; else return the name of
        the recorded target it is (None: another model, accepted with `allow_other_target`)."""
        reason = unsupported_target_reason(target.config) or tli_unsupported_reason(
            target.config, self.config.target_layer_inference
        )
        if reason is not None:
            raise ValueError(f"This target cannot be served by a MoA drafter: {reason}.")
        name = self.target_for(target) if self.config.extra_targets else None
        try:
            self._check_signature(target, allow_other_target or name is not None)
        except ValueError as err:
            if not self.config.extra_targets:
                raise
            known = ", ".join(f"{n!r} ({path})" for n, path in self._target_paths().items())
            raise ValueError(f"{err} This drafter serves: {known}.") from None
        n = self.config.target_layer_inference
        if n > 0:
            decoder = decoder_of(target)
            for attr in ("layers", "norm", "rotary_emb"):
                if not hasattr(decoder, attr):
                    raise ValueError(
                        f"target_layer_inference={n} needs the target's decoder to expose `{attr}` "
                        f"({type(decoder).__name__} does not). Use target_layer_inference=0 for this target."
                    )
        return name if name is not None else (None if self._other_target_reason(target) else PRIMARY_TARGET)
