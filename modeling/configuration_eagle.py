"""Configuration of the EAGLE-2-style feature drafter (Li et al. 2024, arXiv 2401.15077 / 2406.16858)."""

from transformers import PreTrainedConfig

from .configuration_moa import SIGNATURE_KEYS, target_layer_defaults, text_config_of

__all__ = ["EagleDrafterConfig", "eagle_unsupported_target_reason"]


def eagle_unsupported_target_reason(target_config) -> str | None:
    """Why an EAGLE drafter cannot serve this target, or None when it can.

    EAGLE reads only the target's post-norm final hidden state (never its key/value cache), so any decoder-only
    target with a standard config will do: sliding-window, chunked and hybrid sliding/full attention included (the
    target's own cache is rolled back by transformers' assisted generation, lossless; tests/test_sliding.py).
    """
    cfg = text_config_of(target_config)
    if getattr(cfg, "is_encoder_decoder", False):
        return f"{cfg.model_type} is an encoder-decoder model; the EAGLE drafter serves decoder-only targets"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if getattr(cfg, key, None) is None:
            return f"{cfg.model_type} config has no `{key}`; the EAGLE drafter needs a standard decoder-only config"
    return None


class EagleDrafterConfig(PreTrainedConfig):
    r"""Configuration of [`EagleDrafterModel`].

    The `target_*` fields (and `vocab_size`) are the signature of the target LLM the drafter serves (the same as
    [`MoADrafterConfig`]'s); the drafter refuses to attach to a target whose signature differs. Build one for a given
    target with [`EagleDrafterConfig.from_target_config`].

    Args:
        target_fingerprint: `target_fingerprint(target)`: the weights of the model the drafter was built for. A
            target with the same signature but other weights (a fine-tune, another model) is refused unless
            `allow_other_target=True`; the same weights attach under any name or path. None (older drafters): the
            target is recognised by the last part of its `name_or_path` instead.
        hidden_size: width of the drafter's decoder layer; must equal `target_hidden_size` (the drafter predicts the
            target's final hidden state, which the target's LM head reads).
        num_hidden_layers: decoder layers after the `fc` fusion of (previous feature, token embedding); EAGLE uses 1.
        own_embeddings: keep (and save) the drafter's own copy of the embedding and LM head, for standalone use.
            When False they are borrowed from the attached target.
    """

    model_type = "moa_eagle_drafter"
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
    # The drafter's decoder layer(s).
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 1
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    fc_bias: bool = True  # EAGLE's fusion layer has a bias
    own_embeddings: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_architecture()  # fail at construction, not only when saving

    def validate_architecture(self):
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): the "
                "drafter predicts the target's final hidden state, which the target's LM head reads"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")

    def signature(self) -> dict:
        return {key: getattr(self, key) for key in SIGNATURE_KEYS}

    @classmethod
    def from_target_config(cls, target_config, **overrides) -> "EagleDrafterConfig":
        """EAGLE's defaults for a target: one decoder layer at the target's width, heads and MLP size.

        Raises `ValueError` for targets the drafter cannot serve (see `eagle_unsupported_target_reason`).
        """
        reason = eagle_unsupported_target_reason(target_config)
        if reason is not None:
            raise ValueError(f"Cannot build an EAGLE drafter for this target: {reason}.")
        kwargs = target_layer_defaults(target_config)
        kwargs.update(overrides)
        return cls(**kwargs)
