"""EAGLE-2-style feature drafter for speculative decoding (Li et al. 2024, arXiv 2401.15077 / 2406.16858).

The drafter predicts the target's post-norm final hidden state ("feature") f_i, which the target's LM head reads:
  input at position i: concat(f_{i-1}, embed(x_i)) -> fc: Linear(2d, d) -> causal decoder layer(s) -> h_i ~ f_i,
  logits for x_{i+1} = target LM head(h_i). Position 0 has no previous feature: zeros.
At inference f_{i-1} is the target's true feature for verified positions and the drafter's own prediction h_{i-1}
for drafted ones (chain drafting, as `target.generate(..., assistant_model=drafter)` verifies a chain; in a draft
tree, `tree_step`, a node's parent's prediction).

This file ships inside every Hub repo as remote code next to configuration_eagle.py, configuration_moa.py,
modeling_moa.py (whose building blocks it reuses), drafting.py and lookup.py: it imports only torch, transformers and
its sibling files.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel

from .configuration_eagle import EagleDrafterConfig, eagle_unsupported_target_reason
from .drafting import (
    DrafterMixin,
    DraftingSession,
    FeatureTap,
    LayerKV,
    RollbackCache,
    TargetTap,
    TreeState,
    decoder_of,
)
from .modeling_moa import MoADecoderLayer, MoADrafterOutput, MoAPreTrainedModel, MoARotaryEmbedding
from .target_parts import Attachment

__all__ = ["EagleDrafterCache", "EagleDrafterModel", "EaglePreTrainedModel", "EagleTreeState"]


# -------------------------------------------------------------------------------------------------------------------
# Caches and hooks
# ---------------------------------------------------------------------------------------------------------------------
class EagleDrafterCache(RollbackCache):
    """Everything the EAGLE drafter keeps between drafting calls; all of it rolls back to any length with `crop`.

    - keys/values of every position fed so far (0..seq_length-1), per drafter layer, and the tokens fed;
    - `true_length`: the leading positions whose input feature was the target's true one (the others were fed the
      drafter's own prediction, or zeros where the target had not run yet, and are recomputed once it has);
    - `features` [B, F, d]: the target's true features of verified positions 0..F-1.
    """

    def __init__(self, num_layers: int = 1):
        self.layers = [LayerKV() for _ in range(num_layers)]
        self.tokens: torch.Tensor | None = None  # [B, T]
        self.features: torch.Tensor | None = None  # [B, F, d]
        self.true_length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[2]

    @property
    def feature_length(self) -> int:
        return 0 if self.features is None else self.features.shape[1]

    def append_features(self, features: torch.Tensor) -> None:
        """Append the target's true features [B, T, d] of the next verified positions."""
        self.features = features if self.features is None else torch.cat([self.features, features], dim=1)

    def truncate(self, length: int) -> None:
        """Keep positions < `length` (0 empties the cache)."""
        for layer in self.layers:
            layer.crop(length)
        if self.tokens is not None:
            self.tokens = self.tokens[:, :length]
        if self.features is not None:
            self.features = self.features[:, :length]
        self.true_length = min(self.true_length, length)


@dataclass
class EagleTreeState(TreeState):
    """The EAGLE drafter's tree drafting state: `TreeState` (its layers' caches) and the predicted features, the
    inputs of the next nodes: `root_features` [B, d] of each row's last verified token (the root), `node_features`
    [B, K, d] of this cycle's tree nodes."""

    root_features: torch.Tensor
    node_features: torch.Tensor

    def end_tree(self) -> None:
        super().end_tree()
        self.node_features = self.node_features[:, :0]  # [B, 0, d]


# -------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
class EaglePreTrainedModel(MoAPreTrainedModel):
    """The MoA drafter's base (same weight initialisation) with the EAGLE drafter's config."""

    config_class = EagleDrafterConfig
    config: EagleDrafterConfig
    base_model_prefix = "eagle"
    _no_split_modules = ["MoADecoderLayer"]


class EagleDrafterModel(DrafterMixin, EaglePreTrainedModel, GenerationMixin):
    """The EAGLE drafter. Attach it to its target, then pass it as `assistant_model` to `target.generate`.

    ```python
    drafter = EagleDrafterModel.from_pretrained(path).attach(target)
    out = target.generate(**inputs, assistant_model=drafter)
    print(drafter.speculation_stats.mean_accepted_length)
    ```
    """

    def __init__(self, config: EagleDrafterConfig):
        super().__init__(config)
        c = config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=c.fc_bias)  # concat(f_{i-1}, e(x_i)) -> d
        self.layers = nn.ModuleList(MoADecoderLayer.from_config(c) for _ in range(c.num_hidden_layers))
        self.rotary_emb = MoARotaryEmbedding(c.head_dim, c.rope_theta)
        if c.own_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.target_hidden_size)
            self.lm_head = nn.Linear(c.target_hidden_size, c.vocab_size, bias=False)
        self._attachment: Attachment | None = None
        self._session: DraftingSession | None = None
        self.post_init()
        self.generation_config = self.default_generation_config(self.generation_config)

    # ----------------------------------------------------------------------------------------------------------------
    # Attaching to the target
    # -----------------------------------------------------------------------------------------------------------------
    def attach(self, target: PreTrainedModel, allow_other_target: bool = False) -> "EagleDrafterModel":
        """Borrow the target's embedding and LM head and install hooks that expose its final hidden states.

        Nothing on the target is modified: forward hooks are registered on it and on its decoder, and removed again
        by `detach`.
        """
        if self._attachment is not None:
            if self._attachment.target is target:
                return self
            self.detach()
        self.check_target(target, allow_other_target=allow_other_target)
        tap, features = TargetTap(on_new_session=self._start_session), FeatureTap()
        self._attachment = Attachment.borrow(target, tap, num_tli_layers=0, features=features)
        self._start_session()
        return self

    def check_target(self, target: PreTrainedModel, allow_other_target: bool = False) -> None:
        """Raise a `ValueError` saying what is wrong if this drafter cannot serve `target`."""
        reason = eagle_unsupported_target_reason(target.config)
        if reason is not None:
            raise ValueError(f"This target cannot be served by an EAGLE drafter: {reason}.")
        self._check_signature(target, allow_other_target)
        decoder_of(target)  # raises if the decoder (whose output the drafter reads) cannot be found

    # ----------------------------------------------------------------------------------------------------------------
    # Borrowed or own embedding / head
    # -----------------------------------------------------------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The (borrowed or own) LM head on predicted features [..., d] -> float32 logits [..., V]."""
        self._require("LM head")
        head = self.get_output_embeddings()
        return head(hidden.to(head.weight.dtype)).float()

    # ----------------------------------------------------------------------------------------------------------------
    # Training (parallel, teacher-forced)
    # -----------------------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        return_logits: bool = False,
        noise_std: float = 0.0,
        noise_type: str = "uniform",
        **kwargs,
    ) -> MoADrafterOutput:
        """Teacher-forced forward over whole sequences.

        Args:
            input_ids: [B, T] tokens.
            target_hidden: [B, T, d] the target's post-norm final hidden states (`out.hidden_states[-1]`). Position
                i reads target_hidden[i-1] (zeros at i = 0), so output i is compared with target_hidden[i].
            attention_mask: optional [B, T] padding mask (1 = token); padded positions are neither attended to nor
                used as previous features.
            return_logits: also return the LM head's float32 logits [B, T, V].
            noise_std: EAGLE's data augmentation (pass it in training only): noise added to the input features,
                U(-noise_std, noise_std) for `noise_type="uniform"`, N(0, noise_std^2) for "gaussian".
        """
        B, T = input_ids.shape
        if target_hidden.shape[:2] != (B, T) or target_hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"target_hidden must be [B, T, d] = [{B}, {T}, {self.config.hidden_size}] (the target's final hidden "
                f"states for input_ids), got {list(target_hidden.shape)}"
            )
        features = target_hidden.to(self.dtype)
        if attention_mask is not None:
            features = features * attention_mask[..., None].to(features.dtype)  # [B, T, d], zeros at padding
        if noise_std > 0:
            if noise_type == "uniform":
                features = features + (torch.rand_like(features) * 2 - 1) * noise_std
            elif noise_type == "gaussian":
                features = features + torch.randn_like(features) * noise_std
            else:
                raise ValueError(f"noise_type must be 'uniform' or 'gaussian', got {noise_type!r}")
        previous = F.pad(features[:, :-1], (0, 0, 1, 0))  # [B, T, d]: f_{i-1}, zeros at i = 0
        pos = torch.arange(T, device=input_ids.device)
        mask = (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, T, T] causal
        if attention_mask is not None:
            keys = attention_mask.bool()[:, None, None, :] | torch.eye(T, dtype=torch.bool, device=pos.device)
            mask = mask & keys  # [B, 1, T, T]; a query always sees itself (no all-masked rows)
        h = self._layers(self.fc(torch.cat([previous, self.embed(input_ids)], dim=-1)), pos, mask)
        logits = self.head(h) if return_logits else None
        return MoADrafterOutput(logits=logits, hidden_states=h)

    def _layers(self, x, pos, mask, cache: EagleDrafterCache | None = None) -> torch.Tensor:
        cos, sin = self.rotary_emb(pos, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask=mask, cache=cache.layers[i] if cache is not None else None)
        return x

    # ----------------------------------------------------------------------------------------------------------------
    # Inference
    # -----------------------------------------------------------------------------------------------------------------
    def new_cache(self) -> EagleDrafterCache:
        return EagleDrafterCache(self.config.num_hidden_layers)

    def draft_step(
        self, new_ids: torch.Tensor, previous_features: torch.Tensor, cache: EagleDrafterCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `new_ids` [B, T] (tokens not yet in `cache`) with the features [B, T, d] that precede each of them
        (f_{i-1}: the target's for verified positions, the drafter's own prediction otherwise).

        Returns (logits [B, V] float32 for the token after the last one, predicted features [B, T, d]).
        """
        h = self._decode(new_ids, previous_features, cache)
        return self.head(h[:, -1]), h

    def _decode(
        self, new_ids: torch.Tensor, previous_features: torch.Tensor, cache: EagleDrafterCache
    ) -> torch.Tensor:
        past = cache.get_seq_length()
        T = new_ids.shape[1]
        pos = torch.arange(past, past + T, device=new_ids.device)
        x = self.fc(torch.cat([previous_features.to(self.dtype), self.embed(new_ids)], dim=-1))  # [B, T, d]
        mask = None
        if T > 1:  # causal among the new tokens, all cached ones visible
            mask = torch.arange(past + T, device=x.device)[None, :] <= pos[:, None]  # [T, past+T]
        h = self._layers(x, pos, mask, cache)
        cache.tokens = new_ids if cache.tokens is None else torch.cat([cache.tokens, new_ids], dim=1)
        return h

    def _sync(self, cache: EagleDrafterCache, num_verified: int) -> None:
        """Append to `cache` the target's true features of verified positions < num_verified - 1 not yet read."""
        att = self._attachment
        if att is None or att.features.features is None:
            return
        end = min(att.features.length, num_verified - 1)
        start = cache.feature_length
        if end > start:
            cache.append_features(att.features.features[:, start:end].to(self.dtype))
            if self._session is not None:
                self._session.context_reads.append((start, end))

    def _prepare_draft(
        self, input_ids: torch.Tensor, cache: EagleDrafterCache, max_new_tokens: int, min_new_tokens: int
    ):
        """Keep positions computed from true features and still-valid tokens (never the last one: its output
        drafts), feed the rest with the target's true features, then chain-draft on predicted features."""
        n = input_ids.shape[1]
        keep = min(cache.true_length, cache.common_prefix(input_ids), n - 1)
        cache.truncate(keep)
        self._sync(cache, n)
        avail = cache.feature_length  # true features of positions < avail
        if avail < n - 1:  # the target has not run yet (first cycle): without features, one cheap guess only
            max_new_tokens = min(max_new_tokens, max(1, min_new_tokens))
        previous = torch.zeros((1, n - keep, self.config.hidden_size), dtype=self.dtype, device=input_ids.device)
        lo, hi = max(keep, 1), min(n, avail + 1)  # positions i in [lo, hi) have a true previous feature f_{i-1}
        if hi > lo:
            previous[:, lo - keep : hi - keep] = cache.features[:, lo - 1 : hi - 1]  # [1, n-keep, d]: f_{i-1}
        h = self._decode(input_ids[:, keep:], previous, cache)  # [1, n-keep, d]
        cache.true_length = max(keep, min(n, avail + 1))
        last = h[:, -1:]  # [1, 1, d] predicted feature of position n-1

        def next_logits(token: torch.Tensor | None) -> torch.Tensor:
            nonlocal last
            if token is not None:  # a drafted position: its input is the previous predicted feature
                last = self._decode(token, last, cache)
            return self.head(last[:, -1])  # [1, V] float32

        return next_logits, max_new_tokens

    # ----------------------------------------------------------------------------------------------------------------
    # Tree drafting (the engine in custom_generate/engine.py; see `DrafterMixin` and `TreeState`)
    # -----------------------------------------------------------------------------------------------------------------
    needs_target_hidden = True

    def tree_start(self, batch_size: int) -> EagleTreeState:
        """A fresh tree drafting state for `batch_size` rows (no verified token yet)."""
        self._check_tree()
        d = self.config.hidden_size
        return EagleTreeState(
            **TreeState.empty_fields(batch_size, self.config.num_hidden_layers, self.device),
            root_features=torch.zeros(batch_size, d, dtype=self.dtype, device=self.device),  # [B, d]
            node_features=torch.zeros(batch_size, 0, d, dtype=self.dtype, device=self.device),  # [B, 0, d]
        )

    @torch.no_grad()
    def tree_catch_up(
        self,
        state: EagleTreeState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        prev_slots: torch.Tensor,
        target_cache,
        prev_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Feed newly verified `tokens` [B, n] (right-aligned; `valid` [B, n] False on left padding; `positions`
        [B, n] real positions) with the target's true features `prev_hidden` [B, n, d] of the tokens before them
        (zeros where `prev_slots` [B, n] is -1; `target_cache` is not read). Returns float32 logits [B, V] of the
        token after each row's last one (the tree root's children)."""
        if prev_hidden is None:
            raise ValueError(
                "tree_catch_up of an EAGLE drafter (`needs_target_hidden`) needs `prev_hidden`: the target's final "
                "hidden states (`outputs.hidden_states[-1]`) of the token before each of `tokens`, [B, n, d]."
            )
        state.end_tree()
        previous = torch.where((prev_slots >= 0)[..., None], prev_hidden.to(self.dtype), 0.0)  # [B, n, d]: f_{i-1}
        x = self.fc(torch.cat([previous, self.embed(tokens)], dim=-1))  # [B, n, d]
        h = self._layers(x, positions, state.add_verified(valid), state)  # [B, n, d]
        state.root_features = h[:, -1]  # [B, d]
        return self.head(h[:, -1])  # [B, V]

    @torch.no_grad()
    def tree_step(
        self, state: EagleTreeState, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor
    ) -> torch.Tensor:
        """Feed one depth of tree nodes: `tokens`, `positions`, `parents` [B, k] (`TreeState.add_nodes`), each with
        its parent's predicted feature (the root's for parent -1); a node sees the row's verified tokens, its
        ancestors and itself. Returns float32 logits [B, k, V] of each node's next token."""
        B, k = parents.shape
        previous = state.root_features[:, None].expand(B, k, -1)  # [B, k, d]
        if state.num_nodes:
            index = parents.clamp(min=0)[..., None].expand(B, k, previous.shape[-1])  # [B, k, d]
            previous = torch.where((parents >= 0)[..., None], state.node_features.gather(1, index), previous)
        x = self.fc(torch.cat([previous, self.embed(tokens)], dim=-1))  # [B, k, d]
        h = self._layers(x, positions, state.add_nodes(parents), state)  # [B, k, d]
        state.node_features = torch.cat([state.node_features, h], dim=1)  # [B, K+k, d]
        return self.head(h)  # [B, k, V]


EagleDrafterConfig.register_for_auto_class()
EagleDrafterModel.register_for_auto_class("AutoModel")
