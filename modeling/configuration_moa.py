"""Configuration of the Mixture-of-Attentions (MoA) drafter (Zimmer et al., ICLR 2025, arXiv 2410.03804)."""

from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .lookup import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM, LookupSettings

__all__ = [
    "PRIMARY_TARGET",
    "READABLE_CACHE_LAYERS",
    "SIGNATURE_KEYS",
    "MoADrafterConfig",
    "check_exit_thresholds",
    "fixed_exit_thresholds",
    "target_layer_defaults",
    "target_layer_types",
    "target_layer_windows",
    "target_signature",
    "text_config_of",
    "tli_unsupported_reason",
    "unsupported_target_reason",
]

# Attributes of a target config that the drafter depends on ("the target's signature").
SIGNATURE_KEYS = (
    "target_hidden_size",
    "target_num_hidden_layers",
    "target_num_key_value_heads",
    "target_head_dim",
    "vocab_size",
)


def text_config_of(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def target_signature(target_config) -> dict:
    """The target attributes a drafter is built against, named as in `MoADrafterConfig`."""
    cfg = text_config_of(target_config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None)
    rope_theta = (rope or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return {
        "target_model_type": cfg.model_type,
        "target_hidden_size": cfg.hidden_size,
        "target_num_hidden_layers": cfg.num_hidden_layers,
        "target_num_attention_heads": heads,
        "target_num_key_value_heads": kv_heads,
        "target_head_dim": head_dim,
        "target_rope_theta": float(rope_theta),
        "vocab_size": cfg.vocab_size,
    }


# The target cache layers the LSA reads: one key/value per token, for every position (full attention) or for the newest
# window-1 (sliding-window and chunked attention). A cycle reads newly verified positions, which are the newest, so
# every such layer still holds them; older ones a sliding layer dropped stay out of the CA memory (`read_context`).
READABLE_CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def target_layer_types(target_config) -> list[str]:
    """transformers' name for the kind of every target layer: the config's `layer_types` where it has them, else
    sliding attention for a config with a `sliding_window` in use, chunked attention for one with an
    `attention_chunk_size`, full attention otherwise."""
    cfg = text_config_of(target_config)
    if getattr(cfg, "layer_types", None) is not None:
        return [str(kind) for kind in cfg.layer_types]
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True) is not False:
        kind = "sliding_attention"
    elif getattr(cfg, "attention_chunk_size", None) is not None:
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    return [kind] * cfg.num_hidden_layers


def target_layer_windows(target_config) -> dict[str, int | None]:
    """{layer type: its window (None: full attention)} of a target config, as transformers' masks read it: the masks
    the speculative engine and serving's batching build. A ValueError (saying what to use instead) for any other
    layer type."""
    cfg = text_config_of(target_config)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = window is not None and getattr(cfg, "use_sliding_window", True) is not False
        types = ["sliding_attention" if sliding else "full_attention"]
    windows = {}
    for kind in set(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(
                f"The speculative engine builds full and sliding-window attention masks; this target has "
                f"'{kind}' layers. Use `target.generate(..., assistant_model=drafter)` for it."
            )
        windows[kind] = window if kind == "sliding_attention" else None
    return windows


def _cache_layers(target_config) -> list[tuple[str, object]]:
    """(layer type, cache layer) per target layer: the cache transformers builds for the target in `generate`."""
    layers = DynamicCache(config=target_config).layers
    names = target_layer_types(target_config)
    if len(names) != len(layers):
        names = [type(layer).__name__ for layer in layers]
    return list(zip(names, layers))


def unsupported_target_reason(target_config) -> str | None:
    """Why the drafter cannot serve this target, or None when it can.

    The drafter reads the per-token keys/values of every target layer from the target's cache (LSA), so every layer
    must keep them: full attention, sliding-window or chunked attention (whose cache keeps the newest positions, the
    ones a cycle reads; see `READABLE_CACHE_LAYERS`). Layers with a recurrent state (linear attention, state-space,
    convolution) or without a cache of their own (shared keys/values) are refused.
    """
    cfg = text_config_of(target_config)
    if getattr(cfg, "is_encoder_decoder", False):
        return f"{cfg.model_type} is an encoder-decoder model; the MoA drafter serves decoder-only targets"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if getattr(cfg, key, None) is None:
            return f"{cfg.model_type} config has no `{key}`; the MoA drafter needs a standard decoder-only config"
    other = {
        f"{name} ({type(layer).__name__})"
        for name, layer in _cache_layers(target_config)
        if type(layer) not in READABLE_CACHE_LAYERS
    }
    if other:
        return (
            f"{cfg.model_type} has layers of type {sorted(other)} (cache layer in brackets), which keep no per-token "
            "keys/values: a recurrent or convolution state that summarises the past, or another layer's cache. The "
            "MoA drafter reads every layer's per-token keys/values; it serves targets whose layers are full, "
            "sliding-window or chunked attention. Serving this one would need the LSA to read the attention layers "
            "alone (masking the others out) and a target cache that transformers rolls back after a rejected draft"
        )
    return None


def tli_unsupported_reason(target_config, target_layer_inference: int) -> str | None:
    """Why Target Layer Inference with the target's last `target_layer_inference` layers cannot serve this target,
    or None when it can: those layers run inside the drafter on a copy of their cache with full-attention masks, so
    they must all be full-attention layers."""
    n = target_layer_inference
    if n <= 0:
        return None
    layers = _cache_layers(target_config)
    windowed = sorted(
        {name for name, layer in layers[len(layers) - n :] if isinstance(layer, DynamicSlidingWindowLayer)}
    )
    if not windowed:
        return None
    full_tail = next((i for i, (_, layer) in enumerate(reversed(layers)) if type(layer) is not DynamicLayer), 0)
    return (
        f"target_layer_inference={n} runs the target's last {n} layer(s) inside the drafter with full-attention "
        f"masks, but some of them are {windowed} layers, whose window the drafter does not apply. Use "
        "target_layer_inference=0"
        + (f" (or at most {full_tail}: the target's last {full_tail} layers are full attention)" if full_tail else "")
    )


def target_layer_defaults(target_config) -> dict:
    """Config fields of a drafter layer at the target's own shape: the target's signature plus its width, heads,
    MLP size, RoPE theta, norm eps, context length and special token ids (shared by every drafter type)."""
    cfg = text_config_of(target_config)
    sig = target_signature(cfg)
    return dict(
        sig,
        target_name_or_path=getattr(target_config, "name_or_path", None) or None,
        hidden_size=sig["target_hidden_size"],
        intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * sig["target_hidden_size"],
        num_attention_heads=sig["target_num_attention_heads"],
        num_key_value_heads=sig["target_num_key_value_heads"],
        head_dim=sig["target_head_dim"],
        rope_theta=sig["target_rope_theta"],
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )


LSA_KEYS = ("rotated", "unrotated", "none")  # see `MoADrafterConfig.lsa_keys`
LSA_POOLING = ("mean", "last")
PRIMARY_TARGET = "main"  # the name of a drafter's primary target (its `target_*` fields)


def fixed_exit_thresholds(exit: int, num_blocks: int) -> list[float]:
    """The `exit_thresholds` that always draft with exit `exit` (1-based) of a drafter with `num_blocks` blocks:
    never leave before it (2.0 > any probability), always leave there (0.0)."""
    if not 1 <= exit <= num_blocks:
        raise ValueError(f"exit must be in [1, num_blocks={num_blocks}], got {exit}")
    return [2.0] * (exit - 1) + [0.0] * (num_blocks - exit)


def check_exit_thresholds(thresholds, num_blocks: int) -> list[float]:
    """`exit_thresholds` as floats, or a `ValueError` saying what is wrong with them."""
    values = list(thresholds)
    if len(values) != num_blocks - 1 or any(not isinstance(t, (int, float)) or t < 0 for t in values):
        raise ValueError(
            f"exit_thresholds must hold num_blocks - 1 = {num_blocks - 1} numbers >= 0 (a token leaves at exit k < "
            f"num_blocks when its top probability is >= the k-th; 0: always, > 1: never), got {thresholds!r}. Use "
            "None to always draft with the last exit, or `fixed_exit_thresholds(exit, num_blocks)` for a fixed one."
        )
    return [float(t) for t in values]


class MoADrafterConfig(PreTrainedConfig):
    r"""Configuration of [`MoADrafterModel`].

    The `target_*` fields (and `vocab_size`) are the signature of the target LLM the drafter serves; the drafter
    refuses to attach to a target whose signature differs. Build one for a given target with
    [`MoADrafterConfig.from_target_config`].

    Args:
        target_fingerprint: `target_fingerprint(target)`: the weights of the model the drafter was built for. A
            target with the same signature but other weights (a fine-tune, another model) is refused unless
            `allow_other_target=True`; the same weights attach under any name or path. None (older drafters): the
            target is recognised by the last part of its `name_or_path` instead.
        hidden_size: width of the SA/CA layers; must equal `target_hidden_size` (their output feeds the target's head
            or its last layers).
        lsa_hidden_size: width of the Layer Self-Attention that runs across the target's layers for each verified
            token. Defaults to `2 * target_num_key_value_heads * target_head_dim` (one key and value per KV head).
        lsa_keys: how the LSA reads the target's keys: "rotated" (as the cache holds them, after RoPE: the paper),
            "unrotated" (RoPE undone at each token's position with the target's own rotation, so a key's features do
            not depend on where the token stands; plain RoPE targets only) or "none" (values only).
        lsa_layers: the target layers the LSA reads (indices, in order; None: every layer).
        lsa_pooling: how the LSA's per-layer outputs become one vector per token: "mean" over layers (the paper) or
            "last" (the output at the last layer read).
        context_final_hidden: the context vector of token j also reads the target's post-norm final hidden state at
            j (what its LM head reads: its own next-token prediction, which no key or value holds), projected by
            `Eh2E` and added to the LSA's. At inference the drafter reads those states with a hook on the target's
            decoder (the `assistant_model` path) or from the engine's verification forward. False: the paper's
            drafter, keys/values only.
        ca_latest_context: the CA's input also adds a projection (`latest_proj`) of the newest context vector the
            position may read (of token start(i)-1: the last verified one), so the target's latest state reaches
            every drafted token directly, as an EAGLE drafter feeds it the previous feature, besides through
            attention over all verified tokens.
        block_size: k > 1 makes a block drafter: one forward over [the last verified token, k-1 learned placeholder
            slots] proposes k tokens (slot j predicts the token j+1 after the last verified one; the slots attend
            causally to each other and to every verified token, their CA reads the verified context only). It still
            drafts chains token by token beyond a block. 1: a chain drafter only (the paper's).
        block_markov_rank: r > 0 adds to a block slot's logits a bias from the token drafted before it, through a
            rank-r table (`markov_in` [V, r], `markov_out` [r, V'], DSpark's Markov head): slot j's proposal then
            depends on slot j-1's token (teacher-forced in training), at the cost of one table row and an r x V'
            product per drafted token. 0: none. Needs `block_size` > 1 and a draft vocabulary.
        target_layer_inference: N in the paper. 0: the target's LM head reads the CA output. N > 0: the CA output is
            the predicted activation after target layer L-N, and the target's last N layers, final norm and head run.
        own_embeddings: keep (and save) the drafter's own copy of the embedding and LM head, for standalone use
            (e.g. on a client device). When False they are borrowed from the attached target.
        draft_vocab_size: if set, the drafter predicts only this many tokens (the most frequent ones of the target's
            own outputs, ids saved in the `draft_ids` buffer) with its own small head, and scatters them back into
            the full vocabulary (-inf elsewhere). Sampling stays exact: the target verifies against its full
            distribution. None: the full vocabulary through the target's (or its own copy of the) LM head.
        lookup_num_tokens: prompt lookup inside the drafter (0: off). Before running its network, the drafter looks
            for the longest suffix n-gram of the verified text earlier in it (`lookup_max_ngram` down to
            `lookup_min_ngram` tokens) and, on a match, proposes up to this many tokens that followed it (capped by
            the generation config's `num_assistant_tokens`). Such a cycle costs no forward pass; copy-heavy text
            (summaries, RAG, code edits) gains most, and output stays exact as the target verifies every token.
        lookup_max_ngram: the longest n-gram matched by the lookup.
        lookup_min_ngram: the shortest n-gram match that drafts by lookup; shorter matches leave the cycle to the
            network.
        lookup_halve_per_ngram: a lookup match one token shorter than `lookup_max_ngram` proposes half as many
            tokens (a quarter for two shorter, ...; at least 1).
        num_blocks: K stacked SA + CA blocks with an exit after each (S2D's sorted sub-models: exit k runs blocks
            1..k and the shared head). 1: the paper's drafter.
        exit_thresholds: K-1 confidences. While drafting, a token leaves at the first exit k < K whose top draft
            probability is >= `exit_thresholds[k-1]`, else at exit K (0: always leave there; > 1: never). None:
            always exit K. See `fixed_exit_thresholds` for a fixed exit. Serves every target without its own.
        extra_targets: targets served besides the primary one (`target_name_or_path` / `target_fingerprint`, named
            `PRIMARY_TARGET`): {name: {"target_name_or_path", "target_fingerprint", "lora_rank"}} and optionally
            "exit_thresholds" (that target's own, as tuned by `moa tune` on it). Each has its own LSA input
            projection and, with `lora_rank` > 0, low-rank deltas on the linear layers of every block; `attach` picks
            the parts of the target whose fingerprint it recognises.
    """

    model_type = "moa_drafter"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    # The target's signature.
    target_model_type: str | None = None
    target_name_or_path: str | None = None
    target_fingerprint: str | None = None  # of the target's weights (`target_fingerprint(model)`)
    target_hidden_size: int = 576
    target_num_hidden_layers: int = 30
    target_num_attention_heads: int = 9
    target_num_key_value_heads: int = 3
    target_head_dim: int = 64
    target_rope_theta: float = 10000.0
    vocab_size: int = 49152
    # SA and CA layers.
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    # Layer Self-Attention.
    lsa_hidden_size: int | None = None
    lsa_num_attention_heads: int | None = None
    lsa_num_key_value_heads: int | None = None
    lsa_intermediate_size: int | None = None
    lsa_keys: str = "rotated"
    lsa_layers: list[int] | None = None
    lsa_pooling: str = "mean"
    context_final_hidden: bool = False
    ca_latest_context: bool = False
    block_size: int = 1
    block_markov_rank: int = 0
    # Target Layer Inference.
    target_layer_inference: int = 0
    own_embeddings: bool = False
    draft_vocab_size: int | None = None
    # Prompt lookup (see `LookupSettings`).
    lookup_num_tokens: int = 0
    lookup_max_ngram: int = LOOKUP_MAX_NGRAM
    lookup_min_ngram: int = LOOKUP_MIN_NGRAM
    lookup_halve_per_ngram: bool = False
    # Sorted blocks (S2D) and several targets.
    num_blocks: int = 1
    exit_thresholds: list[float] | None = None
    extra_targets: dict[str, dict] | None = None
    initializer_range: float = 0.02
    num_hidden_layers: int = 1  # one SA layer: what `GenerationMixin` and cache utilities read
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        kv_width = 2 * self.target_num_key_value_heads * self.target_head_dim
        if self.lsa_layers is not None:  # a negative index counts from the target's last layer
            self.lsa_layers = [i + self.target_num_hidden_layers if i < 0 else i for i in self.lsa_layers]
        if self.lsa_hidden_size is None:
            self.lsa_hidden_size = kv_width
        if self.lsa_num_attention_heads is None:
            self.lsa_num_attention_heads = max(1, self.lsa_hidden_size // 64)
        if self.lsa_num_key_value_heads is None:
            heads = self.lsa_num_attention_heads
            self.lsa_num_key_value_heads = heads // 4 if heads % 4 == 0 else heads
        if self.lsa_intermediate_size is None:
            self.lsa_intermediate_size = 3 * self.lsa_hidden_size // 2
        super().__post_init__(**kwargs)
        self.validate_lookup()  # fail at construction, not when drafting
        self.validate_sorted()
        self.validate_lsa()
        self.validate_block()

    def validate_block(self):
        """Check `block_size` and what it combines with."""
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1 (1: a chain drafter), got {self.block_size!r}.")
        if not isinstance(self.block_markov_rank, int) or self.block_markov_rank < 0:
            raise ValueError(f"block_markov_rank must be an integer >= 0, got {self.block_markov_rank!r}.")
        if self.block_markov_rank and (self.block_size < 2 or self.draft_vocab_size is None):
            raise ValueError(
                f"block_markov_rank={self.block_markov_rank} biases a block drafter's slots over its draft vocabulary"
                ": "
                f"it needs block_size > 1 and draft_vocab_size (got {self.block_size} and {self.draft_vocab_size})."
            )
        if self.block_size > 1 and (self.num_blocks > 1 or self.target_layer_inference > 0):
            raise ValueError(
                f"block_size={self.block_size} (a block drafter) needs num_blocks=1 and target_layer_inference=0, got "
                f"{self.num_blocks} and {self.target_layer_inference}: a block's placeholder slots have no exit of "
                "their own and no target keys/values for the target's last layers. Use one of them."
            )

    def validate_lsa(self):
        """Check `lsa_keys`, `lsa_layers` and `lsa_pooling`."""
        if self.lsa_keys not in LSA_KEYS or self.lsa_pooling not in LSA_POOLING:
            raise ValueError(
                f"lsa_keys must be one of {LSA_KEYS} and lsa_pooling one of {LSA_POOLING}, got {self.lsa_keys!r} and "
                f"{self.lsa_pooling!r}."
            )
        layers, num = self.lsa_layers, self.target_num_hidden_layers
        bad = layers is not None and (not layers or any(not 0 <= i < num for i in layers))
        if bad or (layers is not None and len(set(layers)) < len(layers)):
            raise ValueError(f"lsa_layers must list distinct target layers in [0, {num}) (None: all), got {layers!r}.")

    def validate_sorted(self, extra_targets: dict | None = None):
        """Check `num_blocks`, `exit_thresholds` and `extra_targets` (or the given `extra_targets` instead)."""
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1 (1: the paper's drafter), got {self.num_blocks!r}")
        if self.num_blocks > 1 and self.target_layer_inference > 0:
            raise ValueError(
                f"num_blocks={self.num_blocks} (sorted exits) needs target_layer_inference=0, got "
                f"{self.target_layer_inference}: every exit feeds the LM head directly. Use one of the two."
            )
        if self.exit_thresholds is not None:
            self.exit_thresholds = check_exit_thresholds(self.exit_thresholds, self.num_blocks)
        for name, spec in ((self.extra_targets if extra_targets is None else extra_targets) or {}).items():
            if not isinstance(name, str) or not name.isidentifier() or name == PRIMARY_TARGET:
                raise ValueError(
                    f"An extra target's name must be a Python identifier other than {PRIMARY_TARGET!r} (the primary "
                    f"target's), got {name!r}: rename it, e.g. 'pydoc'."
                )
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("lora_rank", 0), int)
                or spec.get("lora_rank", 0) < 0
            ):
                raise ValueError(
                    f"extra_targets[{name!r}] must be a dict with 'target_name_or_path', 'target_fingerprint' and an "
                    f"integer 'lora_rank' >= 0 (0: no low-rank deltas), got {spec!r}."
                )
            if spec.get("exit_thresholds") is not None:  # this target's own; else `exit_thresholds` serves it too
                spec["exit_thresholds"] = check_exit_thresholds(spec["exit_thresholds"], self.num_blocks)

    def validate_lookup(self):
        LookupSettings.from_config(self)  # raises a ValueError naming the field for invalid settings

    def validate_architecture(self):
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): the CA "
                "output is read by the target's LM head (or its last layers)"
            )
        for prefix in ("", "lsa_"):
            heads = getattr(self, f"{prefix}num_attention_heads")
            kv = getattr(self, f"{prefix}num_key_value_heads")
            if heads % kv != 0:
                raise ValueError(
                    f"{prefix}num_attention_heads ({heads}) must be a multiple of {prefix}num_key_value_heads ({kv})"
                )
        if self.lsa_hidden_size % self.lsa_num_attention_heads != 0:
            raise ValueError(
                f"lsa_hidden_size ({self.lsa_hidden_size}) must be a multiple of lsa_num_attention_heads "
                f"({self.lsa_num_attention_heads})"
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )
        if not 0 <= self.target_layer_inference <= self.target_num_hidden_layers:
            raise ValueError(
                f"target_layer_inference must be in [0, {self.target_num_hidden_layers}], "
                f"got {self.target_layer_inference}"
            )

    @property
    def target_kv_width(self) -> int:
        """Size of one target layer's key and value for one token, joined per KV head."""
        return 2 * self.target_num_key_value_heads * self.target_head_dim

    @property
    def lsa_input_width(self) -> int:
        """Size of what the LSA reads of one target layer for one token: key and value, or the value only."""
        return self.target_kv_width // 2 if self.lsa_keys == "none" else self.target_kv_width

    def target_exit_thresholds(self, name: str) -> list[float] | None:
        """The exit thresholds target `name` drafts with: its own (`extra_targets[name]["exit_thresholds"]`), else
        `exit_thresholds` (None: every token leaves at the last exit)."""
        own = (self.extra_targets or {}).get(name, {}).get("exit_thresholds")
        return own if own is not None else self.exit_thresholds

    def signature(self) -> dict:
        return {key: getattr(self, key) for key in SIGNATURE_KEYS}

    @classmethod
    def from_target_config(cls, target_config, **overrides) -> "MoADrafterConfig":
        """The paper's defaults for a target: one SA and one CA layer at the target's width, LSA over its K/V cache.

        Raises `ValueError` for targets the drafter cannot serve (see `unsupported_target_reason`).
        """
        reason = unsupported_target_reason(target_config) or tli_unsupported_reason(
            target_config, overrides.get("target_layer_inference", 0)
        )
        if reason is None and overrides.get("lsa_keys") == "unrotated":
            rope = getattr(text_config_of(target_config), "rope_parameters", None) or {}
            partial = getattr(text_config_of(target_config), "partial_rotary_factor", 1) != 1
            if rope.get("rope_type", "default") != "default" or partial:
                reason = (
                    f"lsa_keys='unrotated' undoes plain RoPE only, and this target's is {rope.get('rope_type')!r}"
                    " (or partial); use lsa_keys='rotated' or 'none'"
                )
        if reason is not None:
            raise ValueError(f"Cannot build a MoA drafter for this target: {reason}.")
        kwargs = target_layer_defaults(target_config)
        kwargs.update(overrides)
        return cls(**kwargs)
