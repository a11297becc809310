"""Mixture-of-Attentions (MoA) drafter for speculative decoding (Zimmer et al., ICLR 2025, arXiv 2410.03804).

Per drafting cycle (the target has verified tokens 0..n-1 and cached keys/values for 0..n-2):
  1. LSA: for each newly verified token, attention across the target's L layers over that layer's cached key/value,
     mean over layers, projection -> one context vector per token; CA keys/values of it are appended to the CA cache.
     (A sliding-window layer keeps only its newest positions: those it dropped, e.g. the start of a prompt longer
     than its window, read at the first cycle, are left out of the CA memory; see `read_context`.)
  2. per drafted token: embedding -> SA (causal, own KV cache) -> CA (queries attend to verified context only)
     -> [TLI: the target's last N layers with the target's own cache] -> the target's LM head.

Sorted drafters (S2D, arXiv 2407.01955), `num_blocks` K > 1: K stacked SA + CA blocks (block 1 the paper's
`self_attention` + `cross_attention`, then `blocks`), every CA reading the same context vectors, with an exit after
each block into the shared head; training takes the loss at every exit (`forward(exits="all")`).

One forward, `MoADrafterModel.step`, serves every route under its own masks: training (`forward`: whole sequences,
staircase masks, an empty state), chains (`draft_step`: assisted generation, the serving client) and trees
(`tree_catch_up`, `tree_step`: the engine, vLLM). A chain is a tree of top-k 1.

Where the rest lives (sibling files, every one shipped with this one as remote code). The drafter holds its parts as
objects with public methods (no modules of their own: the layers stay this model's attributes, so the state-dict keys
`blocks.<i>.…` and `target_parts.<name>.…` are those of every saved drafter), and keeps a thin method per public one:
- sorted_exits.py: drafting with sorted blocks, the adaptive exits and their thresholds (`MoASortedExits`,
  `drafter.sorted_exits`);
- target_parts.py: several targets per drafter (`MoATargetParts`, LoRA deltas; `MoATargets`, `drafter.targets`:
  selecting, adding, recognising a target by its fingerprint) and what attaching borrows (`Attachment`);
- moa_layers.py: the building blocks (RMSNorm, RoPE, attention, the SA / LSA and CA layers, `MoABlock`);
- target_cache.py: the target's state, the LSA's one input (`TargetStates`) and its readers (`CacheReader`,
  `SlotReader`, `gather_target_kv`, `gather_target_kv_at`, `held_*`);
- moa_state.py: the drafting state every route keeps (`MoADraftState`: SA keys/values, memory, tree nodes, rows)
  and the masks of the one forward (`memory_mask`, `newest_context`, a block drafter's `block_layout`);
- moa_routes.py: how each route enters the forward (`extend`, `draft_step`, `block_forward`, `tree_catch_up`, ...);
- drafting.py: the runtime shared with the EAGLE drafter (target hooks, `generate`, statistics); lookup.py: prompt
  lookup.

This file ships inside every Hub repo as remote code: it imports only torch, transformers and its sibling files.
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import ModelOutput

from .configuration_moa import PRIMARY_TARGET, MoADrafterConfig
from .drafting import DrafterMixin, DraftingSession, FeatureTap, TargetTap
from .moa_layers import (
    MoAAttention,
    MoABlock,
    MoACrossAttentionLayer,
    MoADecoderLayer,
    MoAMLP,
    MoARMSNorm,
    MoARotaryEmbedding,
)
from .moa_routes import MoADraftingRoutes
from .moa_state import PLACEHOLDER, MoADraftState, block_layout, memory_mask, newest_context
from .sorted_exits import MoASortedExits, PendingSlots
from .target_cache import (
    CONTEXT_CHUNK,
    CacheReader,
    TargetStates,
    context_in_chunks,
    gather_target_kv_at,
    lsa_view,
    oldest_held_position,
)
from .target_parts import Attachment, MoALinear, MoALoRA, MoATargetParts, MoATargets

MoADrafterCache = MoADraftState  # the chain's name for it (assisted generation's `assistant` cache, the client)
MoATreeState = MoADraftState  # the tree's

__all__ = [
    "CONTEXT_CHUNK",
    "MoABlock",
    "MoADrafterModel",
    "MoAPreTrainedModel",
    "MoADrafterCache",
    "MoADraftState",
    "MoADrafterOutput",
    # defined in sibling files, importable from here as before the split
    "MoAAttention",
    "MoACrossAttentionLayer",
    "MoADecoderLayer",
    "MoAMLP",
    "MoARMSNorm",
    "MoARotaryEmbedding",
    "MoALinear",
    "MoALoRA",
    "MoATargetParts",
    "MoATreeState",
    "gather_target_kv_at",
]


# -------------------------------------------------------------------------------------------------------------------
# Target states, cache, output
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class MoADrafterOutput(ModelOutput):
    """`logits`: [B, T, V] (None if not asked); `hidden_states`: the drafter's feature [B, T, d] (the predicted
    post-norm final hidden state of the target, or with TLI N > 0 the predicted activation after layer L-N);
    `final_hidden_states`: with N > 0, the target's final-norm output after its last N layers; `exit_logits` /
    `exit_hidden_states`: one per block of a sorted drafter (the last ones are `logits` / `hidden_states`)."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    final_hidden_states: torch.Tensor | None = None
    past_key_values: MoADraftState | None = None
    exits: torch.Tensor | None = None  # [B, m] the exit (1-based) each returned position left at (None: one block)
    exit_logits: tuple[torch.Tensor, ...] | None = None  # sorted drafters: [B, T, V] per exit, exit 1 first
    exit_hidden_states: tuple[torch.Tensor, ...] | None = None  # [B, T, d] per block


def draft_vocab_ids(token_ids, config: MoADrafterConfig) -> torch.Tensor:
    """`token_ids` as a draft vocabulary of `config`'s drafter: LongTensor [V'] of V' = `draft_vocab_size` distinct
    full-vocabulary ids; a ValueError says what is wrong."""
    if config.draft_vocab_size is None:
        raise ValueError("This drafter has no draft vocabulary; build it with `draft_vocab_size=...`.")
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if token_ids.numel() != config.draft_vocab_size or token_ids.unique().numel() != token_ids.numel():
        raise ValueError(
            f"Expected {config.draft_vocab_size} distinct token ids for the draft vocabulary, got "
            f"{token_ids.numel()} ({token_ids.unique().numel()} distinct)."
        )
    if int(token_ids.min()) < 0 or int(token_ids.max()) >= config.vocab_size:
        raise ValueError(f"Draft vocabulary ids must lie in [0, {config.vocab_size}).")
    return token_ids


# -------------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------------
class MoAPreTrainedModel(PreTrainedModel):
    config_class = MoADrafterConfig
    config: MoADrafterConfig
    base_model_prefix = "moa"
    supports_gradient_checkpointing = True  # the SA, CA and LSA layers (`GradientCheckpointingLayer`)
    _no_split_modules = ["MoADecoderLayer", "MoACrossAttentionLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        """Initial values of the parameters a checkpoint did not set (transformers' `init` functions leave loaded
        ones alone): deeper blocks' output projections start at zero, an extra target's parts as the primary's."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "zero_init", False):
                init.zeros_(module.weight)
            elif getattr(module, "identity_init", False):
                init.eye_(module.weight)
            else:
                init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, 0.0, std)
        elif isinstance(module, MoARMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MoACrossAttentionLayer):
            init.normal_(module.null_key, 0.0, std)
            init.zeros_(module.null_value)
        elif isinstance(module, MoARotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, MoADrafterModel) and module.config.block_size > 1:
            init.normal_(module.block_embedding, 0.0, std)
        if isinstance(module, MoALoRA):
            init.normal_(module.A, 0.0, module.A.shape[1] ** -0.5)
            init.zeros_(module.B)


class MoADrafterModel(MoADraftingRoutes, DrafterMixin, MoAPreTrainedModel, GenerationMixin):
    """The MoA drafter. Attach it to its target, then pass it as `assistant_model` to `target.generate`.

    ```python
    drafter = MoADrafterModel.from_pretrained(path).attach(target)
    out = target.generate(**inputs, assistant_model=drafter)
    print(drafter.speculation_stats.mean_accepted_length)
    ```
    """

    supports_prompt_lookup = True  # verified context is read from the target's cache, so skipped cycles cost nothing
    records_exits = True  # `draft_step` records the exit of every token it drafts (`record_exits`)

    def __init__(self, config: MoADrafterConfig):
        super().__init__(config)
        c = config
        self.self_attention = MoADecoderLayer.from_config(c)
        self.cross_attention = MoACrossAttentionLayer(c)
        lsa_head_dim = c.lsa_hidden_size // c.lsa_num_attention_heads
        self.lsa_in_proj = (
            nn.Linear(c.lsa_input_width, c.lsa_hidden_size, bias=False)
            if c.lsa_hidden_size != c.lsa_input_width
            else None
        )
        self.layer_self_attention = MoADecoderLayer(
            c.lsa_hidden_size,
            c.lsa_num_attention_heads,
            c.lsa_num_key_value_heads,
            lsa_head_dim,
            c.lsa_intermediate_size,
            c.rms_norm_eps,
            c.hidden_act,
            short=True,  # one sequence of target layers per token, no mask
        )
        self.Ekv2E = nn.Linear(c.lsa_hidden_size, c.hidden_size, bias=True)  # authors' name for the LSA projection
        if c.context_final_hidden:  # the target's final hidden state of the token, added to its context vector
            self.Eh2E = nn.Linear(c.target_hidden_size, c.hidden_size, bias=False)
        self.rotary_emb = MoARotaryEmbedding(c.head_dim, c.rope_theta)
        self.lsa_rotary_emb = MoARotaryEmbedding(lsa_head_dim, 10000.0)
        if c.lsa_keys == "unrotated":  # the target's own rotation, undone on the keys the LSA reads
            self.target_rotary_emb = MoARotaryEmbedding(c.target_head_dim, c.target_rope_theta)
        self._context_ablated = False  # `context_ablated()`
        if c.own_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.target_hidden_size)
            self.lm_head = nn.Linear(c.target_hidden_size, c.vocab_size, bias=False)
        if c.draft_vocab_size is not None:  # a reduced head over the `draft_ids` tokens
            self.draft_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
            self.register_buffer("draft_ids", torch.arange(c.draft_vocab_size), persistent=True)  # [V'] full ids
        if c.block_size > 1:  # a block drafter's placeholder slots (token id `PLACEHOLDER`) read this embedding
            self.block_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        if c.block_markov_rank:  # a slot's logits biased by the token drafted before it (zero at first)
            self.markov_in = nn.Embedding(c.vocab_size, c.block_markov_rank)
            self.markov_out = nn.Linear(c.block_markov_rank, c.draft_vocab_size, bias=False)
            self.markov_out.zero_init = True
        if c.num_blocks > 1:  # S2D: blocks 2..K, an exit after each
            self.blocks = nn.ModuleList(MoABlock(c) for _ in range(c.num_blocks - 1))
        self.target_parts = nn.ModuleDict()  # the extra targets' own parts (empty: no state-dict keys)
        self.targets = MoATargets(c, self.target_parts, self.shared_linears)
        for name, spec in (c.extra_targets or {}).items():
            self.target_parts[name] = self.targets.new_parts(int(spec.get("lora_rank", 0)))
        self.sorted_exits = MoASortedExits(c, self.block_layers, self._exit_logits, self.targets)
        self._attachment: Attachment | None = None
        self._session: DraftingSession | None = None
        self.post_init()
        self.generation_config = self.default_generation_config(self.generation_config)

    # ----------------------------------------------------------------------------------------------------------------
    # Borrowed or own embedding / head
    # -----------------------------------------------------------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] float32 next-token logits over the full vocabulary (-inf outside a draft
        vocabulary)."""
        if self.config.draft_vocab_size is not None:
            return self._full_vocab(self.draft_logits(hidden))
        self._require("LM head")
        head = self.get_output_embeddings()
        return head(hidden.to(head.weight.dtype)).float()

    def _full_vocab(self, draft: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., V'] scattered into the full vocabulary [..., V] (-inf elsewhere)."""
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), -float("inf"))  # [..., V]
        return full.index_copy_(-1, self.draft_ids, draft)

    def _exit_logits(self, hidden: torch.Tensor, confidence: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An exit's float32 logits [..., V] and (if asked) its top probability [...] over the draft vocabulary."""
        draft = self.draft_logits(hidden)  # [..., V'] (V' = V without a draft vocabulary)
        top = draft.softmax(-1).amax(-1) if confidence else None
        return (self._full_vocab(draft) if self.config.draft_vocab_size is not None else draft), top

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V'] float32 logits over the draft vocabulary (`draft_ids`); the full head without
        one."""
        if self.config.draft_vocab_size is None:
            return self.head(hidden)
        return self.draft_head(hidden.to(self.draft_head.weight.dtype)).float()

    @torch.no_grad()
    def init_draft_vocab(self, token_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Set the draft vocabulary to `token_ids` [V'] (full-vocabulary ids, e.g. the most frequent tokens of the
        target's outputs) and start the draft head from those rows of the target's LM head weight [V, d]."""
        token_ids = draft_vocab_ids(token_ids, self.config)
        self.draft_ids.copy_(token_ids.to(self.draft_ids.device))
        self.draft_head.weight.copy_(lm_head_weight[token_ids.to(lm_head_weight.device)].to(self.draft_head.weight))

    # ----------------------------------------------------------------------------------------------------------------
    # The three attentions
    # -----------------------------------------------------------------------------------------------------------------
    def compute_context(
        self, states: TargetStates, where: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """LSA: the target's states of T tokens -> [B, T, d] one context vector per token. Of `states` (a route's
        reader fills them) it reads the keys/values per layer `kv` [B, T, L, 2*Hkv*hd] and, with
        `context_final_hidden` only (their `Eh2E` projection is added), the final hidden states `final_hidden`.

        where: optional bool [B, T], the tokens whose context is needed (training: not padding); of those only the
        ones `states.held` (when given). The LSA runs on those only and the others get zero vectors. positions:
        [B, T] or [T] the tokens' positions in their sequence (needed by `lsa_keys="unrotated"` only, which undoes the
        target's RoPE there)."""
        target_kv, target_hidden = states.kv, states.final_hidden if self.config.context_final_hidden else None
        B, T = target_kv.shape[:2]
        if positions is not None:
            positions = positions.expand(B, T)
        if self._context_ablated:  # `context_ablated()`: what the drafter does without the target's state
            return target_kv.new_zeros(B, T, self.config.hidden_size, dtype=self.dtype)
        if self.config.context_final_hidden and target_hidden is None:
            raise ValueError("context_final_hidden=True: the target's states need `final_hidden` [B, T, D].")
        if states.held is not None:
            where = states.held if where is None else where & states.held
        if where is not None and not bool(where.all()):
            pos = None if positions is None else positions[where][None]  # [1, N]
            hidden = None if target_hidden is None else target_hidden[where][None]  # [1, N, D]
            picked = self.compute_context(TargetStates(target_kv[where][None], hidden), positions=pos)[0]  # [N, d]
            return picked.new_zeros(B, T, picked.shape[-1]).masked_scatter(where[..., None], picked)  # [B, T, d]
        if not torch.is_autocast_enabled(target_kv.device.type):  # autocast: the projection reads them as they are
            target_kv = target_kv.to(self.dtype)
        target_kv = self.lsa_inputs(target_kv, positions)  # [B, T, L', W'] what the LSA reads of each layer
        L, W = target_kv.shape[2:]
        x = target_kv.reshape(B * T, L, W)  # each token is a sequence over the target's layers
        proj = self.lsa_in_proj  # the active target's own
        if self.active_target != PRIMARY_TARGET:
            proj = self.target_parts[self.active_target].lsa_in_proj
        if proj is not None:
            x = proj(x)  # [B*T, L, lsa_hidden]
        cos, sin = self.lsa_rotary_emb(torch.arange(L, device=x.device), x.dtype)  # position = layer index
        x = self.layer_self_attention(x, cos, sin, mask=None)  # no mask across layers
        pooled = x.mean(dim=1) if self.config.lsa_pooling == "mean" else x[:, -1]  # [B*T, lsa_hidden]
        context = self.Ekv2E(pooled).view(B, T, -1)  # [B, T, d]
        if self.config.context_final_hidden:
            context = context + self.Eh2E(target_hidden.to(context.dtype))  # [B, T, d]
        return context

    def lsa_inputs(self, target_kv: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """What the LSA reads of the target's keys/values [B, T, L, Hkv*2*hd]: [B, T, L', W'] (`lsa_view`)."""
        return lsa_view(self.config, target_kv, positions, getattr(self, "target_rotary_emb", None))

    @contextlib.contextmanager
    def context_ablated(self):
        """Inside the block every context vector is zero: the drafter runs without the target's state (its CA reads
        zeros), to measure how much of its acceptance the target's state brings."""
        self._context_ablated = True
        try:
            yield self
        finally:
            self._context_ablated = False

    def read_context(self, reader: CacheReader, start: int, end: int) -> torch.Tensor:
        """Context vectors [B, end-start, d] of target positions [start, end), their `TargetStates` read by `reader`
        (a chain's: the target's cache and, with `context_final_hidden`, its final hidden states) in chunks
        (`context_in_chunks`).

        Positions older than `oldest_held_position` (a sliding-window layer of the target has dropped them: the start
        of a prompt longer than the window, read at the first cycle) have no context: their vectors are zero, and
        `_sync` keeps them out of the CA memory (`extend_context`'s `valid`). Reading them from the layers that still
        held them instead (masking the others out of the LSA) drafted worse: mean acceptance 2.65-2.68 against
        2.74-2.80 for a tiny target with window 8 < prompt 24 (1500 training steps, 3 runs, 96 held-out prompts).
        """
        target_cache = reader.cache
        lo = min(max(start, oldest_held_position(target_cache)), end)  # positions [lo, end) are held by every layer
        read = lambda s, e: reader(lo + s, lo + e)  # noqa: E731  positions lo+s..lo+e-1
        out = context_in_chunks(self.compute_context, read, end - lo, self.config, lo)
        keys = target_cache.layers[0].keys
        dropped = keys.new_zeros(keys.shape[0], lo - start, self.config.hidden_size, dtype=self.dtype)  # no context
        return torch.cat([dropped, *out], dim=1)  # [B, end-start, d]

    def _tli(self, h, positions, state: MoADraftState, limit, drafted) -> torch.Tensor:
        """Target Layer Inference on the features h [B, t, d] of the last t of T positions `positions` [(B,) T]: the
        target's last N layers (borrowed) over the TLI memory of `state` that each query's `limit` [B or 1, T]
        allows (None: every valid slot) and the drafted positions before it that `drafted` [B or 1, 1, t, D+t]
        shows it (None: all D and itself), then its final norm. Their keys/values join the state's drafted ones."""
        if self._attachment is None:
            raise RuntimeError("target_layer_inference > 0 runs the target's last layers: attach the drafter first.")
        B, t = h.shape[:2]
        M, layers = state.tli_valid.shape[1], state.tli_layers
        D = layers[0].keys.shape[2] - M if layers else 0  # drafted positions held
        memory = memory_mask(state.tli_valid, None if limit is None else limit[..., -t:])  # [B, 1 or t, M]
        if drafted is None:  # a chain: every position drafted so far, then these causally
            drafted = torch.ones(t, D + t, dtype=torch.bool, device=h.device).tril(D)[None, None]  # [1, 1, t, D+t]
        mask = None  # None: every key (no mask tensor on a chain's steps)
        if not (bool(memory.all()) and bool(drafted.all())):
            visible = torch.cat([memory[:, None].expand(B, 1, t, M), drafted.expand(B, 1, t, D + t)], dim=-1)
            dtype = self._attachment.tli_dtype
            mask = torch.zeros(visible.shape, dtype=dtype, device=h.device).masked_fill(
                ~visible, torch.finfo(dtype).min
            )
        positions = positions if positions.ndim == 2 else positions[None]  # [1 or B, T]
        return self._attachment.run_tli(h, positions[:, -t:], state.tli, mask)

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_kv: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        target_kv_held: torch.Tensor | None = None,
        cycle_starts: torch.LongTensor | None = None,
        sa_mask: torch.Tensor | None = None,
        target_tli_kv: list | None = None,
        return_logits: bool = True,
        exits: str = "all",
        target_name: str | None = None,
        attention_mask: torch.Tensor | None = None,
        block_anchors: torch.Tensor | None = None,
        **kwargs,
    ) -> MoADrafterOutput:
        """Training-time (parallel) forward over whole sequences with simulated drafting cycles.

        Args:
            input_ids: [B, T] tokens.
            target_kv: [B, T, L, 2*Hkv*hd] the target's keys/values per layer (see `gather_target_kv`), or
            context: [B, T, d] precomputed context vectors.
            target_hidden: [B, T, D] the target's post-norm final hidden states (with `target_kv`, for a drafter
                with `context_final_hidden`).
            target_kv_held: optional bool [B, T]: whether every target layer still held token j's key/value when it
                was read at inference (a sliding-window layer drops old positions; see `held_at_reads`); tokens it
                was not are kept out of the CA memory, as at inference. None: all held.
            cycle_starts: [B, T] start(i); position i reads the context of tokens j < start(i) only. Default: i
                (every position is the first of its cycle: all earlier tokens verified).
            sa_mask: optional bool [B, T, T] SA mask (default causal).
            target_tli_kv: with N > 0, a list of N (key, value) pairs [B, Hkv, T, hd] from the target's last N
                layers; position i sees them for j < start(i) and the drafted ones for start(i) <= j <= i.
            exits: "all": `exit_logits` too, the logits of every exit (block) of a sorted drafter; "last": the last
                exit's logits only (what an inference-style call needs; `exit_logits` None).
            target_name: the target whose parts to use (None: the active one, see `select_target`).
            attention_mask: optional [B, T], 0 at padding: the LSA skips those tokens (no context vector is read
                there), so right-padded batches cost the LSA nothing for their padding.
            block_anchors: a block drafter's blocks to train, [B, A] the position of each block's first slot (-1:
                none; each a cycle start): k-1 placeholder slots follow each, appended after the sequence
                (`block_layout`); the outputs then cover T + A*(k-1) slots, the sequence's first.
        """
        # every drafting cycle of whole sequences at once: `step` over an empty state whose memory is every token's
        # context, under the staircase masks (position i reads the context of j < start(i))
        with self.using_target(target_name):
            B, T = input_ids.shape
            device = input_ids.device
            pos = torch.arange(T, device=device)
            if cycle_starts is None:
                cycle_starts = pos.expand(B, T)
            if context is None:
                if target_kv is None:
                    raise ValueError("forward needs `target_kv` (the target's per-layer keys/values) or `context`.")
                read = None if attention_mask is None else attention_mask.bool()  # [B, T]: tokens the CA may read
                states = TargetStates(target_kv, final_hidden=target_hidden, held=target_kv_held)
                context = self.compute_context(states, where=read, positions=pos)
            state = MoADraftState.empty(self.config, B, self.dtype, device)
            state.layers = [None]  # no SA keys kept: the whole sequence is one forward
            held = torch.ones(B, T, dtype=torch.bool, device=device) if target_kv_held is None else target_kv_held
            tli_kv, tli = None, None
            if self.config.target_layer_inference > 0:  # the target's own keys/values: the TLI memory of every token
                if target_tli_kv is None:
                    raise ValueError("target_layer_inference > 0: pass `target_tli_kv` (the last N layers' K/V).")
                tli_kv = dict(zip(self.tli_layer_ids, target_tli_kv))
                # drafted: start(i) <= j <= i (the memory's j < start(i) is the CA's limit)
                tli = ((pos[None, None, :] >= cycle_starts[:, :, None]) & (pos[None, :] <= pos[:, None]))[:, None]
            self.extend(state, context, pos, held, tli_kv, torch.ones_like(held))
            causal = pos[None, :] <= pos[:, None] if sa_mask is not None else None  # [T, T] only where read
            mask = None if sa_mask is None else (sa_mask & causal)[:, None]  # None: SDPA's causal kernel, no [T, T]
            tokens, positions, limit = input_ids, pos, cycle_starts
            if block_anchors is not None:  # k-1 placeholder slots after each anchor, after the sequence
                if mask is None:
                    mask = (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, T, T]
                tokens, positions, mask, limit = block_layout(
                    input_ids, cycle_starts, mask, block_anchors, self.config
                )
            return self.step(
                state, tokens, positions, mask, limit, last=None, exits=exits, causal=mask is None, tli=tli,
                return_logits=return_logits,
            )  # fmt: skip

    # ----------------------------------------------------------------------------------------------------------------
    # The one forward: training, chains and trees all run it, under their own masks
    # -----------------------------------------------------------------------------------------------------------------
    def step(
        self,
        state: MoADraftState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        sa_mask: torch.Tensor | None,
        ca_limit: torch.Tensor | None,
        last: int | None = 1,
        exits: str = "adaptive",
        causal: bool = False,
        tli: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> MoADrafterOutput:
        """The drafter's one forward: `tokens` [B, T] (`PLACEHOLDER`: a block's slot) at `positions` ([T] or [B, T])
        through embedding -> SA -> CA (-> the sorted blocks and exits) (-> TLI) -> head, on `state`. SA: over the
        state's slots (these tokens' keys/values appended to `state.layers[0]` unless None) under `sa_mask`
        [B or 1, 1, T, S] (None: SDPA's `causal` kernel, or every slot). CA: over the memory slots m < `ca_limit`
        [B or 1, T] that hold a context (None: all; `memory_mask`) and, with `ca_latest_context`, the newest of them
        (`newest_context`). `last`: the last `last` positions only (None: all). `exits`: "adaptive" (a sorted
        drafter's token leaves at its first confident exit, `MoASortedExits.adaptive_exits`) or "all"/"last" (every
        block on every position; "all" returns every exit's logits). `tli`: Target Layer Inference's mask of the
        drafted positions the returned ones see (`_tli`; the TLI memory is the CA's, under the same limits)."""
        c = self.config
        if c.block_size > 1:  # placeholder slots read the learned block embedding
            h = self.embed(tokens.clamp(min=0))  # [B, T, d]
            h = torch.where((tokens == PLACEHOLDER)[..., None], self.block_embedding.to(h.dtype), h)
        else:
            h = self.embed(tokens)  # [B, T, d]
        cos, sin = self.rotary_emb(positions, h.dtype)  # [(B,) T, hd]
        layers = self.block_layers()
        valid = state.ca_valid
        every_valid = ca_limit is None and bool(valid.all())
        ca_mask = None if every_valid else memory_mask(valid, ca_limit)[:, None]  # [B, 1, T or 1, M]
        latest = None  # [B, T or 1, d]
        if c.ca_latest_context:
            latest = state.latest[:, None] if ca_limit is None else newest_context(state.contexts, valid, ca_limit)
        sa, ca = layers[0]
        h = sa(h, cos, sin, mask=sa_mask, cache=state.layers[0], causal=causal)
        exit_of = exit_logits = outputs = None
        if exits != "adaptive":  # every block on every position (training)
            outputs = []
            for k, (sa, ca) in enumerate(layers):
                if k:
                    h = sa(h, cos, sin, mask=sa_mask, causal=causal)
                memory = (
                    (state.ca_keys, state.ca_values)
                    if k == 0
                    else (state.deep[k - 1].ca_keys, state.deep[k - 1].ca_values)
                )
                h = ca(h, cos, sin, *memory, mask=ca_mask, latest=latest)
                outputs.append(h)
            h = h if last is None else h[:, -last:]
        elif len(layers) > 1:  # S2D: each position leaves at its first confident exit
            T = tokens.shape[1]
            m = T if last is None else last
            S = state.num_verified + state.num_nodes if state.layers[0] is not None else T
            if sa_mask is None:  # the slots' causal mask, explicit for the blocks that run these positions later
                slots = torch.arange(S, device=h.device)
                sa_mask = (slots[None, :] <= slots[S - T :, None])[None, None]  # [1, 1, T, S]
            if ca_mask is None:
                ca_mask = valid[:, None, None, :].expand(-1, -1, T, -1)  # [B, 1, T, M]
            ca_mask = ca_mask.expand(-1, -1, T, -1)
            if latest is not None:
                latest = latest.expand(-1, T, -1)
            h = ca(h, cos, sin, state.ca_keys, state.ca_values, mask=ca_mask, latest=latest)
            tops = [] if self.sorted_exits.tops is not None and last == 1 else None
            pending = PendingSlots(h, sa_mask, cos, sin, ca_mask, latest)
            logits, exit_of = self.sorted_exits.adaptive_exits(pending, state.deep, m=m, record=tops)
            if tops is not None:
                cycle = len(self._session.calls) if self._session is not None else None
                self.sorted_exits.record(tops, exit_of, int(positions.flatten()[-1]) + 1, cycle)
            return MoADrafterOutput(logits=logits, exits=exit_of)
        else:  # one block: only the returned positions need the CA
            if last is not None:
                h, cos, sin = h[:, -last:], cos[..., -last:, :], sin[..., -last:, :]
                ca_mask = None if ca_mask is None else ca_mask[..., -last:, :]
                latest = latest if latest is None or latest.shape[1] == 1 else latest[:, -last:]
            h = ca(h, cos, sin, state.ca_keys, state.ca_values, mask=ca_mask, latest=latest)
        final = self._tli(h, positions, state, ca_limit, tli) if c.target_layer_inference > 0 else None
        logits = self.head(final if final is not None else h) if return_logits else None
        if return_logits and exits == "all" and outputs is not None:
            exit_logits = (*(self.head(x) for x in outputs[:-1]), logits)
        return MoADrafterOutput(
            logits=logits,
            hidden_states=h,
            final_hidden_states=final,
            exit_logits=exit_logits,
            exit_hidden_states=None if outputs is None else tuple(outputs),
            exits=exit_of,
        )

    # ----------------------------------------------------------------------------------------------------------------
    # Its parts: the targets (`self.targets`), the sorted exits (`self.sorted_exits`).
    # The public methods below hand over to them (see their docstrings)
    # -----------------------------------------------------------------------------------------------------------------
    def shared_linears(self) -> dict[str, MoALinear]:
        """The linear layers of the SA/CA blocks, which an extra target's low-rank deltas adapt."""
        blocks = ("self_attention", "cross_attention", "blocks")
        return {n: m for n, m in self.named_modules() if isinstance(m, MoALinear) and n.split(".")[0] in blocks}

    def block_layers(self) -> list[tuple[MoADecoderLayer, MoACrossAttentionLayer]]:
        """(SA, CA) of blocks 1..K: block 1 is `self_attention` + `cross_attention`, then `blocks`."""
        deeper = [(b.self_attention, b.cross_attention) for b in getattr(self, "blocks", None) or ()]
        return [(self.self_attention, self.cross_attention), *deeper]

    @property
    def target_names(self) -> list[str]:
        """The targets this drafter serves: `PRIMARY_TARGET` ("main") first, then `config.extra_targets`."""
        return self.targets.names

    @property
    def active_target(self) -> str:
        return self.targets.active

    def select_target(self, name: str) -> None:
        """Draft (and train, see `forward`'s `target_name`) with target `name`'s parts (`MoATargets.select`)."""
        self.targets.select(name)

    @contextlib.contextmanager
    def using_target(self, name: str | None):
        """`with drafter.using_target(name):` target `name`'s parts inside (`MoATargets.using`)."""
        with self.targets.using(name):
            yield self

    def target_part_parameters(self, name: str) -> list[nn.Parameter]:
        """The parameters only target `name` uses, to train its parts alone (`MoATargets.part_parameters`)."""
        return self.targets.part_parameters(name, primary=self.lsa_in_proj)

    def add_target(self, name: str, target: PreTrainedModel | None = None, **kwargs) -> None:
        """Serve another target of the primary one's signature with parts of its own (`MoATargets.add`; keywords:
        `target_name_or_path`, `target_fingerprint`, `lora_rank`)."""
        diffs = () if target is None else self._signature_differences(target)
        device, dtype = self.device, self.dtype
        self.targets.add(
            name, target, signature_differences=diffs, primary=self.lsa_in_proj, device=device, dtype=dtype, **kwargs
        )

    def target_for(self, target: PreTrainedModel) -> str | None:
        """The name of the served target whose recorded fingerprint `target`'s weights have (`MoATargets.identify`)."""
        return self.targets.identify(target)

    def check_target(self, target: PreTrainedModel, allow_other_target: bool = False) -> str | None:
        """Raise a `ValueError` saying what is wrong if this drafter cannot serve `target`; else return the name of
        the recorded target it is (None: another model, accepted with `allow_other_target`; `MoATargets.check`)."""
        return self.targets.check(target, allow_other_target, self._check_signature, self._other_target_reason)

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
        tap = TargetTap(on_new_session=self._start_session)
        features = FeatureTap() if self.config.context_final_hidden else None
        self._attachment = Attachment.borrow(target, tap, self.config.target_layer_inference, features)
        self._start_session()
        return self

    def keep_first_block(self) -> "MoADrafterModel":
        """Drop blocks 2..K of a sorted drafter: it then drafts every token at exit 1, as the full drafter does with
        thresholds that leave every token there. For engines that draft at one exit only (vLLM's proposer)."""
        if self.config.num_blocks > 1:
            del self.blocks
            self.sorted_exits.keep_first_block()
        return self

    def exit_thresholds_for(self, name: str | None = None) -> list[float] | None:
        """The exit thresholds drafting for target `name` (None: the active one) uses (`MoASortedExits`)."""
        return self.sorted_exits.thresholds_for(name)

    def set_exit_thresholds(self, thresholds: list[float] | None, target: str = PRIMARY_TARGET) -> None:
        """Store tuned thresholds for `target` (`MoASortedExits.set_thresholds`)."""
        self.sorted_exits.set_thresholds(thresholds, target)

    def override_exit_thresholds(self, thresholds: list[float] | None) -> contextlib.AbstractContextManager:
        """Draft every target with `thresholds` (e.g. `fixed_exit_thresholds(k, K)`: always exit k) until the next
        call, or inside `with drafter.override_exit_thresholds(t):` (`MoASortedExits.override`)."""
        return self.sorted_exits.override(thresholds, owner=self)

    def recording_exit_tops(self) -> contextlib.AbstractContextManager:
        """`with drafter.recording_exit_tops() as records:` every exit's top of every chain drafting step
        (`MoASortedExits.recording_tops`)."""
        return self.sorted_exits.recording_tops()


MoADrafterConfig.register_for_auto_class()
MoADrafterModel.register_for_auto_class("AutoModel")
