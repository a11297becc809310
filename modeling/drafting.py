"""The drafting runtime every drafter of this library shares (`MoADrafterModel`, `EagleDrafterModel`).

A drafter is attached to its target with forward hooks (`TargetTap`: the target's cache, calls and time), and
transformers' assisted generation calls the drafter's `generate` once per drafting cycle (`DrafterMixin.generate`):
prompt lookup first where the drafter has it (`lookup.py`), else the chain-drafting loop (`chain.py`) over the
drafter's own `next_logits`. Per-call statistics (`SpeculationStats`) and the rollback convention of the drafter caches
(`RollbackCache`) live here as well, and what the drafters share for the tree drafting of the engine in
custom_generate/ (`TreeState`: per-row valid slots, the tree's ancestor mask, row selection; `DrafterMixin.tree_*`).

This file ships inside every Hub repo as remote code: it imports only torch, transformers and its sibling files.
"""

import contextlib
import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .chain import Chain, draft_chain, sample_multinomial
from .configuration_moa import target_signature
from .lookup import LookupSettings, pop_legacy_lookup_keys

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache` (the old name works, with
# a warning, until 6.0): calls pass the installed version's name (`model(**{CACHE_NAME: cache})`, `getattr(out,
# CACHE_NAME)`), and what transformers passes is read under either name (`cache_argument`).
CACHE_NAME = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def cache_argument(kwargs: dict):
    """The cache in the keyword arguments of a transformers call, under either name (None if neither is given)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


__all__ = [
    "CACHE_NAME",
    "DrafterMixin",
    "DraftingSession",
    "FeatureTap",
    "LayerKV",
    "RollbackCache",
    "SpeculationStats",
    "TargetTap",
    "TreeState",
    "cache_argument",
    "decoder_of",
    "one_hot_scores",
    "register_hooks",
    "target_fingerprint",
]


# -------------------------------------------------------------------------------------------------------------------
# Caches, hooks, statistics
# ---------------------------------------------------------------------------------------------------------------------
class RollbackCache:
    """What both drafter caches share: the tokens they were computed from (`tokens`, [B, T]), their longest
    still-valid prefix, and transformers' `crop` convention on top of each cache's own `truncate(length)`."""

    tokens: torch.Tensor | None = None

    def common_prefix(self, input_ids: torch.Tensor) -> int:
        """Length of the longest prefix of `input_ids` that the cached keys/values were computed from."""
        if self.tokens is None:
            return 0
        n = min(self.tokens.shape[1], input_ids.shape[1])
        differ = (self.tokens[:, :n] != input_ids[:, :n]).any(0).nonzero()
        return int(differ[0]) if differ.numel() else n

    def crop(self, n: int) -> None:
        """transformers' convention: `crop(-k)` drops the last k positions and `crop(0)` none (assisted generation
        calls it so after a fully accepted draft); a positive `n` keeps positions < n (see `truncate`)."""
        self.truncate(max(0, self.get_seq_length() + n) if n <= 0 else n)


@dataclass
class SpeculationStats:
    """What happened in the drafter's last `generate` session.

    `accepted_lengths[i]`: tokens the target added in cycle i, counting its own token (plain decoding = 1.0).
    `exit_counts[k-1]`: tokens the network drafted at exit k (one entry for a drafter with one exit; prompt lookup's
    tokens are not in it: they sum to `drafted_tokens - lookup_tokens`).
    """

    accepted_lengths: list[int] = field(default_factory=list)
    target_calls: int = 0
    drafted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    lookup_cycles: int = 0  # cycles whose draft came from prompt lookup (see `DrafterMixin.lookup_settings`)
    lookup_tokens: int = 0  # tokens of `drafted_tokens` proposed by prompt lookup
    exit_counts: list[int] = field(default_factory=list)  # tokens the network drafted per exit (sorted drafters: K)

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(1, len(self.accepted_lengths))

    @property
    def generated_tokens(self) -> int:
        return sum(self.accepted_lengths)

    def as_dict(self) -> dict:
        return {
            "accepted_lengths": list(self.accepted_lengths),
            "mean_accepted_length": self.mean_accepted_length,
            "target_calls": self.target_calls,
            "drafted_tokens": self.drafted_tokens,
            "generated_tokens": self.generated_tokens,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "lookup_cycles": self.lookup_cycles,
            "lookup_tokens": self.lookup_tokens,
            "exit_counts": list(self.exit_counts),
        }


class TargetTap:
    """Forward hooks on the target: the cache of its latest call, and how many calls / how long they took.

    The drafter reads from that cache only the positions the target has verified (see `MoADrafterModel._sync`).
    """

    def __init__(self, on_new_session):
        self.cache = None
        self.calls = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self.on_new_session = on_new_session  # a target call with a new cache = a generate call the drafter missed

    def pre_hook(self, module, args, kwargs):
        cache = cache_argument(kwargs)
        if cache is not None:
            if self.cache is not None and cache is not self.cache:
                self.on_new_session()
            self.cache = cache
        self.calls += 1
        self._t0 = time.perf_counter()

    def post_hook(self, module, args, kwargs, output):
        self.seconds += time.perf_counter() - self._t0


class FeatureTap:
    """Forward hooks on the target's decoder: its post-norm final hidden states by position, [B, P, d].

    Each decoder call covers positions start..start+T-1, start = the length of the cache it was given; it overwrites
    whatever was stored from `start` on (positions of rejected drafts get recomputed). Only positions the target has
    verified are ever read (see `EagleDrafterModel._sync`, and `MoADrafterModel._sync` with `context_final_hidden`).
    """

    def __init__(self):
        self.features: torch.Tensor | None = None
        self._start = 0

    def reset(self) -> None:
        self.features = None

    @property
    def length(self) -> int:
        return 0 if self.features is None else self.features.shape[1]

    def pre_hook(self, module, args, kwargs):
        cache = cache_argument(kwargs)
        self._start = cache.get_seq_length() if cache is not None else 0

    def post_hook(self, module, args, kwargs, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        hidden = hidden.detach()  # [B, T_new, d]
        if self._start == 0:
            self.features = hidden
        elif self._start <= self.length and hidden.shape[0] == self.features.shape[0]:
            self.features = torch.cat([self.features[:, : self._start], hidden], dim=1)
        else:  # a gap (calls the drafter did not see): earlier positions are unknown, keep nothing
            self.features = None


def register_hooks(module: nn.Module, tap) -> list:
    """Register `tap.pre_hook` and `tap.post_hook` as forward hooks (with kwargs) on `module`; returns the handles,
    which `DrafterMixin.detach` removes (both are removed here if the second cannot be registered)."""
    handles = [module.register_forward_pre_hook(tap.pre_hook, with_kwargs=True)]
    try:
        handles.append(module.register_forward_hook(tap.post_hook, with_kwargs=True))
    except BaseException:
        handles[0].remove()
        raise
    return handles


@dataclass
class DraftingSession:
    """Book-keeping of one `target.generate` call (a new session starts when the assistant cache is None)."""

    calls: list = field(default_factory=list)  # (input length, target calls so far) at each drafting call
    tap_calls0: int = 0
    tap_seconds0: float = 0.0
    drafted_tokens: int = 0
    draft_time_s: float = 0.0
    lookup_cycles: int = 0
    lookup_tokens: int = 0
    exit_counts: list = field(default_factory=list)  # tokens the network drafted per exit (`record_exits`)
    context_reads: list = field(default_factory=list)  # (start, end) target positions read, per cycle


# ---------------------------------------------------------------------------------------------------------------------
# Tree drafting (the engine of custom_generate/engine.py): the state every drafter shares
# ---------------------------------------------------------------------------------------------------------------------
class LayerKV:
    """Keys/values of one drafter attention layer, [B, Hkv, S, hd] (what `MoADecoderLayer` appends to)."""

    def __init__(self):
        self.keys = self.values = None

    def append_self(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.keys, self.values = k, v
        return k, v

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]

    @staticmethod
    def concat(layers: list["LayerKV"]) -> "LayerKV":
        """The rows of `layers` (each with keys of the same width) in one."""
        out = LayerKV()
        if all(layer.keys is not None for layer in layers):
            out.keys = torch.cat([layer.keys for layer in layers], dim=0)
            out.values = torch.cat([layer.values for layer in layers], dim=0)
        elif any(layer.keys is not None for layer in layers):
            raise ValueError("Cannot join drafting states with and without self-attention keys/values.")
        return out


@dataclass
class TreeState:
    """A drafter's state during the engine's tree drafting (a drafter's `tree_start` to the end of the call), B rows.

    The self-attention caches (`layers`, one `LayerKV` per drafter layer) hold per row S = V + K slots: V verified
    slots, appended by each `tree_catch_up` (its [B, n] right-aligned tokens, so a row's left padding leaves slots
    that `valid` [B, V] marks False and no query ever sees), then the K tree nodes fed by `tree_step` this cycle,
    which `end_tree` drops. `ancestors` [B, K, K]: node j is node i or one of its ancestors (what node i sees).
    Subclasses add the drafter's own per-row tensors (first dimension B), which `select_rows` keeps as well.
    """

    layers: list[LayerKV]
    valid: torch.Tensor  # [B, V] bool
    ancestors: torch.Tensor  # [B, K, K] bool

    @staticmethod
    def empty_fields(batch_size: int, num_layers: int, device) -> dict:
        """The fields of a state without any slot (the base class's), for a subclass's constructor."""
        return {
            "layers": [LayerKV() for _ in range(num_layers)],
            "valid": torch.zeros(batch_size, 0, dtype=torch.bool, device=device),  # [B, 0]
            "ancestors": torch.zeros(batch_size, 0, 0, dtype=torch.bool, device=device),  # [B, 0, 0]
        }

    @property
    def num_verified(self) -> int:
        return self.valid.shape[1]

    @property
    def num_nodes(self) -> int:
        return self.ancestors.shape[1]

    def add_verified(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Record n newly verified slots (`new_valid` bool [B, n]); returns the bool self-attention mask
        [B, 1, n, V+n] of their queries: the row's valid verified slots, the valid new ones up to itself, and
        itself (a padding query too: no all-masked row)."""
        B, n = new_valid.shape
        own = torch.eye(n, dtype=torch.bool, device=new_valid.device)  # [n, n]
        causal = torch.ones(n, n, dtype=torch.bool, device=new_valid.device).tril()  # [n, n]
        new = (causal & new_valid[:, None, :]) | own  # [B, n, n]
        mask = torch.cat([self.valid[:, None, :].expand(B, n, -1), new], dim=-1)  # [B, n, V+n]
        self.valid = torch.cat([self.valid, new_valid], dim=1)  # [B, V+n]
        return mask[:, None]  # [B, 1, n, V+n]

    def add_nodes(self, parents: torch.Tensor) -> torch.Tensor:
        """Record k tree nodes whose `parents` [B, k] index earlier nodes of this cycle (-1: the root, which is the
        last verified slot, or a filler); returns the bool self-attention mask [B, 1, k, V+K+k] of their queries:
        the row's valid verified slots, their ancestors and themselves."""
        B, k = parents.shape
        K = self.num_nodes
        rows = torch.zeros(B, k, K, dtype=torch.bool, device=parents.device)  # [B, k, K]
        if K:
            index = parents.clamp(min=0)[:, :, None].expand(B, k, K)  # [B, k, K]
            rows = self.ancestors.gather(1, index) & (parents >= 0)[:, :, None]  # the parent's ancestors-or-self
        own = torch.eye(k, dtype=torch.bool, device=parents.device).expand(B, k, k)  # [B, k, k]
        rows = torch.cat([rows, own], dim=-1)  # [B, k, K+k]
        previous = torch.cat([self.ancestors, self.ancestors.new_zeros(B, K, k)], dim=-1)  # [B, K, K+k]
        self.ancestors = torch.cat([previous, rows], dim=1)  # [B, K+k, K+k]
        return torch.cat([self.valid[:, None, :].expand(B, k, -1), rows], dim=-1)[:, None]  # [B, 1, k, V+K+k]

    def end_tree(self) -> None:
        """Drop this cycle's tree nodes (their keys/values): only verified slots remain."""
        for layer in self.layers:
            layer.crop(self.num_verified)
        self.ancestors = self.ancestors[:, :0, :0]  # [B, 0, 0]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (LongTensor [B']) in this order, in every field."""
        rows = rows.to(self.valid.device)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value[rows])
        for layer in self.layers:
            layer.select_rows(rows)

    # Continuous batching (vLLM's proposer): rows join and leave between cycles, so slots are re-laid per row.
    def map_slots(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Replace every per-verified-slot tensor t by fn(t, slot_dim): `valid` [B, V] (dim 1) and every layer's
        keys/values [B, Hkv, V, hd] (dim 2); subclasses add theirs. Tree nodes must have been dropped (`end_tree`)."""
        if self.num_nodes:
            raise RuntimeError("map_slots needs a state without tree nodes: call end_tree first.")
        self.valid = fn(self.valid, 1)
        for layer in self.layers:
            if layer.keys is not None:
                layer.keys, layer.values = fn(layer.keys, 2), fn(layer.values, 2)

    def pad_left(self, width: int) -> None:
        """Add invalid slots at the left of every row until it has `width` verified slots."""
        n = width - self.num_verified

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)  # zeros: False for the validity masks

        if n > 0:
            self.map_slots(pad)

    def compact(self) -> None:
        """Move each row's valid slots to the right end, in order, and drop the slots that no row needs any more
        (left by padding and by rows that verified fewer tokens than others). Attention sees the same slots."""
        counts = self.valid.sum(1)  # [B]
        width = int(counts.max()) if counts.numel() else 0
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)  # [B, V] valid slots first, in order
        B, V = self.valid.shape
        dest = torch.arange(width, device=self.valid.device)[None, :] - (width - counts)[:, None]  # [B, width]
        keep = dest >= 0  # [B, width] False: padding at the left
        index = order.gather(1, dest.clamp(min=0, max=max(V - 1, 0))) if V else dest.clamp(min=0)  # [B, width]

        def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
            idx = index.view(B, *([1] * (dim - 1)), width, *([1] * (t.ndim - dim - 1))).expand(
                *t.shape[:dim], width, *t.shape[dim + 1 :]
            )
            out = t.gather(dim, idx)
            if t.dtype == torch.bool:
                out = out & keep.view(B, *([1] * (dim - 1)), width, *([1] * (t.ndim - dim - 1)))
            return out

        self.map_slots(gather)

    @classmethod
    def concat_rows(cls, states: list["TreeState"]) -> "TreeState":
        """One state holding the rows of `states` in order (each padded on the left to the widest)."""
        width = max(s.num_verified for s in states)
        for s in states:
            s.pad_left(width)
        first = states[0]
        fields = {}
        for f in dataclasses.fields(first):
            values = [getattr(s, f.name) for s in states]
            if isinstance(values[0], torch.Tensor):
                fields[f.name] = torch.cat(values, dim=0)
            elif f.name == "layers":
                fields[f.name] = [LayerKV.concat([s.layers[i] for s in states]) for i in range(len(first.layers))]
            else:
                fields[f.name] = cls._concat_field(f.name, values)
        return type(first)(**fields)

    @staticmethod
    def _concat_field(name: str, values: list):
        raise ValueError(f"Cannot join drafting states: unknown field {name!r}.")


def decoder_of(target: nn.Module) -> nn.Module:
    """The target's decoder (the module with its `layers`, final `norm` and `rotary_emb`)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    if not hasattr(decoder, "layers"):  # e.g. Llama 4's text model, whose `get_decoder()` returns itself
        decoder = getattr(target, "model", decoder)
    if not hasattr(decoder, "layers"):
        raise ValueError(
            f"Cannot find the decoder layers of {type(target).__name__} (expected `.get_decoder().layers`)."
        )
    return decoder


def _short_name(name_or_path: str) -> str:
    return str(name_or_path).rstrip("/").split("/")[-1].lower()


# ---------------------------------------------------------------------------------------------------------------------
# The target's weights fingerprint
# ---------------------------------------------------------------------------------------------------------------------
_FINGERPRINT_VERSION = "sign1"
_FINGERPRINT_ROWS = 64  # evenly spaced rows read from each sampled matrix


def _fixed_rows(weight: torch.Tensor) -> torch.Tensor:
    """`_FINGERPRINT_ROWS` evenly spaced rows of `weight` (all of them when it has fewer)."""
    rows = weight.detach().reshape(-1, weight.shape[-1])  # [R, in]: a stacked [E, out, in] expert weight too
    index = torch.linspace(0, rows.shape[0] - 1, min(_FINGERPRINT_ROWS, rows.shape[0])).round().long()
    return rows[index.to(rows.device)]  # [n, in]


def _sign_digest(matrices: list[torch.Tensor]) -> str | None:
    """12 hex digits hashing the shapes and the sign bits of fixed rows of `matrices`; None when one of them cannot
    be read (integer-quantised, offloaded to "meta") or there is none."""
    if not matrices:
        return None
    digest = hashlib.sha256()
    for weight in matrices:
        if not weight.is_floating_point() or weight.device.type == "meta":
            return None
        bits = torch.signbit(_fixed_rows(weight)).flatten().to(torch.uint8)  # [N]
        bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)  # [N/8, 8], zero-padded
        packed = (bits << torch.arange(8, dtype=torch.uint8, device=bits.device)).sum(1)  # [N/8]: 8 bits a byte
        digest.update(str(tuple(weight.shape)).encode())
        digest.update(bytes(packed.tolist()))
    return digest.hexdigest()[:12]


def target_fingerprint(model: nn.Module) -> str | None:
    """A fingerprint of a target model's weights, e.g. "sign1:embed=3f0c...,layer0=...,layer15=...,layer29=...".

    The same for the same weights under any name or path, in fp32 / bf16 / fp16 and whether loaded from safetensors
    or dequantised from GGUF; another one for a fine-tune or another model of the same architecture. Each part hashes
    the sign bits of fixed rows of the input embedding, or of every matrix of the first, middle and last decoder
    layer: a sign bit survives every rounding between float dtypes (an underflow to +-0 included), and a fine-tune
    flips those of its weights near zero. Cheap: at most 64 rows of each matrix are read (~1M sign bits for a 135M
    model, tens of milliseconds on a CPU).

    None when the weights cannot be read: integer-quantised (bitsandbytes, GPTQ, ...), offloaded to the "meta"
    device, or no `get_input_embeddings()` / decoder `layers` to sample.
    """
    embed = model.get_input_embeddings()
    try:
        layers = decoder_of(model).layers
    except ValueError:
        return None
    if embed is None or getattr(embed, "weight", None) is None or len(layers) == 0:
        return None
    parts = {"embed": [embed.weight]}
    for i in sorted({0, len(layers) // 2, len(layers) - 1}):
        parts[f"layer{i}"] = [p for p in layers[i].parameters() if p.ndim >= 2]
    digests = {name: _sign_digest(matrices) for name, matrices in parts.items()}
    if None in digests.values():
        return None
    return f"{_FINGERPRINT_VERSION}:" + ",".join(f"{name}={digest}" for name, digest in digests.items())


def _fingerprint_parts(fingerprint: str | None) -> dict[str, str] | None:
    """{part: digest} of a fingerprint of this version, else None."""
    version, _, body = (fingerprint or "").partition(":")
    if version != _FINGERPRINT_VERSION:
        return None
    try:
        return dict(part.split("=", 1) for part in body.split(","))
    except ValueError:  # a part without "=": not a fingerprint this code wrote
        return None


def weights_difference(recorded: str | None, actual: str | None) -> str | None:
    """What differs between the recorded and the actual fingerprint ("" when nothing does); None when they cannot be
    compared (one is missing or of another version)."""
    old, new = _fingerprint_parts(recorded), _fingerprint_parts(actual)
    if old is None or new is None or old.keys() != new.keys():
        return None
    differ = [name for name in old if old[name] != new[name]]
    if not differ:
        return ""
    layers = [name.removeprefix("layer") for name in differ if name != "embed"]
    names = (["the input embedding"] if "embed" in differ else []) + (
        [f"decoder layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}"] if layers else []
    )
    subject = f"{' and '.join(names)} {'differs' if len(differ) == 1 else 'differ'}"
    if len(differ) == len(old):
        return f"{subject}: another model of the same architecture, or another quantisation of it?"
    return f"{subject}, the rest matches: a fine-tune?"


def one_hot_scores(tokens: torch.Tensor, config) -> list[torch.Tensor]:
    """n x [1, V] scores of proposed `tokens` [n]: one-hot, i.e. the proposal distribution of a deterministic
    proposer, so speculative sampling against the target stays exact."""
    scores = torch.full((tokens.shape[0], config.vocab_size), -float("inf"), device=tokens.device)  # [n, V]
    scores[torch.arange(tokens.shape[0]), tokens] = 0.0
    return list(scores[:, None].unbind(0))


class DrafterMixin:
    """What every drafter of this library shares (`MoADrafterModel`, `EagleDrafterModel`): speculation
    defaults, detaching, the target signature check, borrowed or own embedding / head, and session statistics.

    A drafter sets `self._attachment` (with `target`, `embed`, `lm_head`, `tap`, `handles`) in its `attach` and
    `self._session` in `_start_session`; its config has `signature()`, `target_name_or_path` and `own_embeddings`
    (and the `lookup_*` fields where `supports_prompt_lookup`).
    """

    _attachment = None
    _session: "DraftingSession | None" = None
    supports_prompt_lookup = False  # True where `generate` drafts from `lookup_proposal` first

    @staticmethod
    def default_generation_config(generation_config: GenerationConfig | None = None) -> GenerationConfig:
        """Speculation defaults read by transformers' assisted generation (override any of them per call or here).

        - `num_assistant_tokens`: the most tokens drafted per cycle.
        - `num_assistant_tokens_schedule`: "constant" keeps it; "heuristic" grows it by 2 after a fully accepted
          draft and shrinks it by 1 otherwise (and writes it back into this config).
        - `assistant_confidence_threshold`: stop drafting early once the drafter's probability of its own token
          falls below this value (0 drafts always `num_assistant_tokens`).

        Prompt lookup is not a generation setting: it is in the drafter's config (`lookup_*`, see `lookup_settings`).
        Keys of it that older checkpoints kept here are removed.
        """
        gc = generation_config if generation_config is not None else GenerationConfig()
        gc._from_model_config = False  # our own settings: transformers drops extra keys of a "from model config" one
        gc.num_assistant_tokens = 5
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.3
        pop_legacy_lookup_keys(gc)
        return gc

    def adjust_generation_fn(self, *args, **kwargs):
        """After `from_pretrained` loads the generation config: prompt lookup settings that older checkpoints kept
        in it (`prompt_lookup_num_tokens`, `max_matching_ngram_size`, `prompt_lookup_min_ngram`,
        `prompt_lookup_halve_per_ngram`) move into the config's `lookup_*` fields (dropped for a drafter without
        prompt lookup)."""
        super().adjust_generation_fn(*args, **kwargs)
        legacy = pop_legacy_lookup_keys(self.generation_config)
        if self.supports_prompt_lookup and legacy:
            for name, value in legacy.items():
                setattr(self.config, name, value)
            LookupSettings.from_config(self.config)  # raises a ValueError naming the field for invalid settings

    # ----------------------------------------------------------------------------------------------------------------
    # Attaching to the target
    # -----------------------------------------------------------------------------------------------------------------
    def detach(self) -> "DrafterMixin":
        """Remove every hook from the target and drop the borrowed modules."""
        if self._attachment is not None:
            for handle in self._attachment.handles:
                handle.remove()
        self._attachment = None
        self._session = None
        return self

    @contextlib.contextmanager
    def attached(self, target: PreTrainedModel, allow_other_target: bool = False):
        """`with drafter.attached(target): ...`: attached inside, detached on leaving (also on an exception)."""
        self.attach(target, allow_other_target=allow_other_target)
        try:
            yield self
        finally:
            self.detach()

    @property
    def is_attached(self) -> bool:
        return self._attachment is not None

    @property
    def attached_target(self) -> PreTrainedModel | None:
        """The target model this drafter is attached to, None when detached."""
        return None if self._attachment is None else self._attachment.target

    def _signature_differences(self, target: PreTrainedModel) -> list[str]:
        """What differs between the target's signature and the drafter's ("key: drafter x != target y")."""
        sig = target_signature(target.config)
        head = target.get_output_embeddings()
        if head is not None and hasattr(head, "weight"):
            sig["vocab_size"] = head.weight.shape[0]
        return [
            f"{key}: drafter {value} != target {sig.get(key)}"
            for key, value in self.config.signature().items()
            if sig.get(key) != value
        ]

    def _check_signature(self, target: PreTrainedModel, allow_other_target: bool) -> None:
        """The target's signature must equal the drafter's, and another model than the drafter's target (see
        `_other_target_reason`) needs `allow_other_target`."""
        diffs = self._signature_differences(target)
        if diffs:
            raise ValueError(
                "The target's signature does not match the one this drafter was built for ("
                + "; ".join(diffs)
                + "). Use a drafter trained for this target, or build one with "
                f"`{type(self.config).__name__}.from_target_config(target.config)`."
            )
        reason = None if allow_other_target else self._other_target_reason(target)
        if reason is not None:
            raise ValueError(
                f"{reason} Their signatures match, so it will run, but its acceptance may be poor. Use a drafter "
                "trained for this target, or pass `allow_other_target=True` to attach anyway."
            )

    def _other_target_reason(self, target: PreTrainedModel) -> str | None:
        """Why `target` (of the drafter's signature) is another model than the one the drafter was trained for, or
        None. By the weights where the drafter records `target_fingerprint` and the target's can be read (the same
        weights pass under any name or path); else (older drafters, integer-quantised targets) by the last part of
        `name_or_path`."""
        expected = self.config.target_name_or_path
        actual = getattr(target.config, "name_or_path", "") or ""
        recorded = getattr(self.config, "target_fingerprint", None)
        if recorded:
            difference = weights_difference(recorded, target_fingerprint(target))
            if difference == "":
                return None
            if difference is not None:
                return (
                    f"This drafter was trained for target '{expected}' but '{actual or type(target).__name__}' has "
                    f"other weights ({difference})."
                )
        if expected and actual and _short_name(expected) != _short_name(actual):
            return f"This drafter was trained for target '{expected}' but is being attached to '{actual}'."
        return None

    # ----------------------------------------------------------------------------------------------------------------
    # Borrowed or own embedding / head
    # -----------------------------------------------------------------------------------------------------------------
    def get_input_embeddings(self):
        if self.config.own_embeddings:
            return self.embed_tokens
        return self._attachment.embed if self._attachment is not None else None

    def get_output_embeddings(self):
        if self.config.own_embeddings:
            return self.lm_head
        return self._attachment.lm_head if self._attachment is not None else None

    def _require(self, what: str):
        if not self.config.own_embeddings and self._attachment is None:
            raise RuntimeError(
                f"The drafter needs the target's {what}: call `drafter.attach(target)` first (or use "
                "`with drafter.attached(target):`), or build the drafter with `own_embeddings=True`."
            )

    def copy_embeddings_from(self, target: PreTrainedModel) -> None:
        """Copy the target's embedding and LM head into the drafter's own (`own_embeddings=True`)."""
        if not self.config.own_embeddings:
            raise ValueError("copy_embeddings_from needs a drafter built with `own_embeddings=True`.")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            self.lm_head.weight.copy_(target.get_output_embeddings().weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._require("embedding")
        return self.get_input_embeddings()(input_ids).to(self.dtype)

    # ----------------------------------------------------------------------------------------------------------------
    # One drafting call of assisted generation
    # -----------------------------------------------------------------------------------------------------------------
    def new_cache(self):
        raise NotImplementedError

    def _prepare_draft(self, input_ids: torch.Tensor, cache, max_new_tokens: int, min_new_tokens: int):
        """Bring `cache` up to date with the verified `input_ids` [1, n]; return `(next_logits, max_new_tokens)`:
        `next_logits(token)` gives the [1, V] logits of the next drafted token (token None: the first, after
        `input_ids`; else after the drafted [1, 1] `token`)."""
        raise NotImplementedError

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig | None = None,
        logits_processor=None,
        past_key_values=None,
        cache=None,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        **kwargs,
    ) -> GenerateDecoderOnlyOutput:
        """Draft tokens after `input_ids` (all verified). Called by transformers' `AssistedCandidateGenerator`.

        Returns the sequences, the processed scores of every drafted token (so speculative sampling is exact) and
        the drafter's cache. A call without a cache (`past_key_values`, or `cache` from transformers 5.24) starts a
        new session.
        """
        past_key_values = cache if cache is not None else past_key_values
        t0 = time.perf_counter()
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"{type(self).__name__} drafts for one sequence at a time (got batch size {input_ids.shape[0]}); "
                "transformers' assisted generation supports batch size 1 only. Loop over the prompts."
            )
        gc = generation_config if generation_config is not None else self.generation_config
        if max_new_tokens is None:
            max_new_tokens = gc.max_new_tokens if gc.max_new_tokens is not None else gc.num_assistant_tokens
        min_new_tokens = min_new_tokens or 0
        processors = LogitsProcessorList(logits_processor or [])
        threshold = getattr(gc, "assistant_confidence_threshold", None) or 0.0
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), device=input_ids.device)
        if past_key_values is None:
            past_key_values = self.new_cache()
            self._start_session()
        session = self._session
        if session is not None:
            session.calls.append((input_ids.shape[1], self._attachment.tap.calls if self._attachment else 0))
        proposal = self.lookup_proposal(input_ids, max_new_tokens, min_new_tokens, eos)
        if proposal is not None:  # no forward pass: the caches catch up lazily at the next network cycle
            ids, scores = torch.cat([input_ids, proposal[None]], dim=-1), one_hot_scores(proposal, self.config)
            if session is not None:
                session.lookup_cycles += 1
                session.lookup_tokens += len(scores)
        else:
            ids, scores = self._draft_with_network(
                input_ids, past_key_values, gc, processors, eos, threshold, max_new_tokens, min_new_tokens
            )
            if not self.records_exits:  # one exit: every token the network drafted
                self.record_exits([len(scores)])
        if session is not None:
            session.drafted_tokens += len(scores)
            session.draft_time_s += time.perf_counter() - t0
        return GenerateDecoderOnlyOutput(sequences=ids, scores=tuple(scores), **{CACHE_NAME: past_key_values})

    def _draft_with_network(
        self, input_ids, cache, gc, processors, eos, threshold, max_new_tokens: int, min_new_tokens: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The sequence with up to `max_new_tokens` drafted tokens (`draft_chain` on the drafter's `next_logits`),
        and the processed [1, V] scores of each."""
        next_logits, max_new_tokens = self._prepare_draft(input_ids, cache, max_new_tokens, min_new_tokens)
        chain = draft_chain(
            next_logits, max_new_tokens, eos=eos, threshold=threshold, min_tokens=min_new_tokens, ids=input_ids,
            process=processors if processors else None, sample=sample_multinomial if gc.do_sample else None,
        )  # fmt: skip
        return chain.ids, chain.scores

    # ----------------------------------------------------------------------------------------------------------------
    # Tree drafting: what the engine (custom_generate/engine.py) calls; each drafter implements `tree_start`,
    # `tree_catch_up` and `tree_step` on a `TreeState` of its own
    # -----------------------------------------------------------------------------------------------------------------
    needs_target_hidden = False  # True: `tree_catch_up` reads the target's final hidden states (`prev_hidden`)

    def tree_unsupported_reason(self) -> str | None:
        """Why this drafter cannot draft trees (a sentence), or None when it can."""
        return None

    def _check_tree(self) -> None:
        reason = self.tree_unsupported_reason()
        if reason is not None:
            raise ValueError(reason)
        self._require("embedding")

    def tree_end(self, state: TreeState) -> None:
        """Forget this cycle's tree nodes: the next `tree_catch_up` feeds the accepted ones again as verified."""
        state.end_tree()

    def tree_select_rows(self, state: TreeState, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (LongTensor [B']) of `state`, in this order."""
        state.select_rows(rows)

    # Continuous batching (vLLM's proposer) re-lays slots between cycles: states settle first (`tree_settle`)
    def tree_settle(self, state: TreeState) -> None:
        """Bring `state` to where its slots can be re-laid: nothing for a drafter that keeps no slot pending."""

    def tree_compact(self, state: TreeState) -> None:
        """`TreeState.compact` on a settled state."""
        self.tree_settle(state)
        state.compact()

    def tree_concat_rows(self, states: list[TreeState]) -> TreeState:
        """`TreeState.concat_rows` of settled states: one state holding their rows in order."""
        for state in states:
            self.tree_settle(state)
        return type(states[0]).concat_rows(states)

    def tree_chain(
        self, state: TreeState, root_logits: torch.Tensor, positions: torch.Tensor, max_tokens: int, **stops
    ) -> Chain:
        """Greedy chains of up to `max_tokens` tokens per row on a tree drafting state caught up on every row's
        verified tokens (`root_logits` [B, V] from `tree_catch_up`; `positions` [B] the first drafted token's): one
        `tree_step` per position for all rows, each token the child of the one before (`draft_chain`; `stops`: its
        `eos` and `threshold`). What the vLLM proposer drafts; `build_tree` at top-k 1 drafts the same tokens. The
        nodes stay in `state` until `tree_end`."""
        device = root_logits.device
        pos = positions.to(device)[:, None]  # [B, 1] the next token's position
        parents = torch.full_like(pos, -1)  # [B, 1] its parent: the root, then the token before

        def next_logits(token: torch.Tensor | None) -> torch.Tensor:
            nonlocal pos, parents
            if token is None:
                return root_logits
            logits = self.tree_step(state, token, pos, parents)[:, -1]  # [B, V]
            pos, parents = pos + 1, parents + 1
            return logits

        if stops.get("eos") is not None:
            stops["eos"] = stops["eos"].to(device)
        limit = getattr(self, "draft_depth_limit", None)  # a block drafter drafts one block per cycle
        return draft_chain(next_logits, min(max_tokens, limit or max_tokens), **stops)

    # ----------------------------------------------------------------------------------------------------------------
    # Prompt lookup: drafts that cost no forward pass
    # -----------------------------------------------------------------------------------------------------------------
    @property
    def lookup_settings(self) -> LookupSettings | None:
        """The drafter's prompt lookup settings (its config's `lookup_*` fields); None when off or when the drafter
        has no prompt lookup (`supports_prompt_lookup`)."""
        if not self.supports_prompt_lookup or not self.config.lookup_num_tokens:
            return None
        return LookupSettings.from_config(self.config)

    def lookup_proposal(
        self, input_ids: torch.Tensor, max_new_tokens: int, min_new_tokens: int, eos: torch.Tensor
    ) -> torch.Tensor | None:
        """The tokens [n] that prompt lookup proposes after `input_ids` [1, T], or None (lookup off or no match):
        at most `max_new_tokens`, up to and including the first `eos` token (or before it while fewer than
        `min_new_tokens` were drafted). Settings from the drafter's config (see `lookup_settings`)."""
        settings = self.lookup_settings
        return None if settings is None else settings.propose(input_ids[0], max_new_tokens, min_new_tokens, eos)

    # ----------------------------------------------------------------------------------------------------------------
    # Session statistics
    # -----------------------------------------------------------------------------------------------------------------
    records_exits = False  # True: the drafter calls `record_exits` per drafted token itself (MoA: `draft_step`)

    @property
    def num_exits(self) -> int:
        """The drafter's exits (`num_blocks` of a sorted MoA drafter, else 1)."""
        return int(getattr(self.config, "num_blocks", 1) or 1)

    def record_exits(self, counts: list[int]) -> None:
        """Add tokens drafted by the network at each exit (`counts[k-1]` at exit k) to the session's statistics."""
        s = self._session
        if s is not None:
            s.exit_counts = [a + b for a, b in itertools.zip_longest(s.exit_counts, counts, fillvalue=0)]

    def _start_session(self) -> None:
        tap = self._attachment.tap if self._attachment is not None else None
        if tap is not None:
            tap.cache = None  # the target's cache of an earlier generate call is stale
        features = getattr(self._attachment, "features", None)
        if features is not None:
            features.reset()  # the final hidden states of an earlier generate call are stale too
        self._session = DraftingSession(
            tap_calls0=tap.calls if tap else 0,
            tap_seconds0=tap.seconds if tap else 0.0,
            exit_counts=[0] * self.num_exits,
        )

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Statistics of the last `generate` session (see `SpeculationStats`)."""
        s, att = self._session, self._attachment
        if s is None or att is None:
            return SpeculationStats()
        tap = att.tap
        if not s.calls:  # the drafter was never asked (e.g. a single new token): plain decoding
            accepted = [1] * (tap.calls - s.tap_calls0)
        else:
            accepted = [b[0] - a[0] for a, b in zip(s.calls, s.calls[1:])]
        if s.calls and tap.cache is not None:
            final_len = tap.cache.get_seq_length() + 1  # the target cache holds all verified tokens but the last
            last_len, last_calls = s.calls[-1]
            extra_calls = tap.calls - last_calls
            if extra_calls > 0 and final_len > last_len:
                accepted.append(final_len - last_len - (extra_calls - 1))
                accepted.extend([1] * (extra_calls - 1))
        return SpeculationStats(
            accepted_lengths=accepted,
            target_calls=tap.calls - s.tap_calls0,
            drafted_tokens=s.drafted_tokens,
            draft_time_s=s.draft_time_s,
            verify_time_s=tap.seconds - s.tap_seconds0,
            lookup_cycles=s.lookup_cycles,
            lookup_tokens=s.lookup_tokens,
            exit_counts=list(s.exit_counts),
        )
