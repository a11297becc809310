"""`MoAProposer`: a MoA drafter as a vLLM proposer (`speculative_config={"method": "custom_class", ...}`).

vLLM calls `propose` once per engine step, right after the target verified every row's draft and wrote its
keys/values into the paged cache. One step, for all rows at once:

1. **Rows**: each row's verified tokens (`token_ids_cpu[row, :num_tokens_no_spec[row]]`) are matched with the drafter
   state of the row whose fed tokens they extend (rows move, join and leave between steps; a row preempted,
   recomputed or served from the prefix cache matches the same way); a row with no match starts a fresh state.
2. **Draft length** k for the step, and whether the network drafts where lookup has nothing, from measured step
   costs at this batch size (`VllmDraftPolicy`); k = 0 skips the drafter entirely, and so does a lookup-only step
   for the network (rows catch up lazily when the network drafts again). The tokens the network would first have to
   catch up, and how many tokens those rows have left (`RowLives`), weigh against running it.
3. **Lookup**: the drafter's prompt lookup proposes per row; when every row has a proposal no network runs.
4. **Catch-up**: the newly verified tokens of every row, context read from vLLM's paged cache at each token's
   previous position (`PagedKVReader`), in one `tree_catch_up` for the continuing rows and one per new row (read
   from its last `catch_up_window` tokens), joined into one batched state (`tree_concat_rows`).
5. **Draft**: a chain of k tokens per row, one drafter forward per position for all rows (`tree_chain`: the library's
   one chain-drafting loop on `tree_step`), greedy, stopping a row at EOS or below the drafter's confidence threshold.

Drafts are token ids: vLLM's rejection sampler verifies them as one-hot proposals, so greedy and sampled outputs
are exactly the target's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..drafter_types import drafter_type, drafter_types
from ..loading import load_drafter
from . import TESTED_VLLM_VERSIONS, MoAVllmOptions
from .kv_cache import PagedKVReader, UnsupportedCacheError, layout_for, slots_of
from .policy import VllmDraftPolicy
from .rows import RowLives, pair_rows
from .target import StepTap, TargetView

__all__ = ["MoAProposer", "MoAVllmOptions", "match_rows", "unsupported_drafter_reason"]

logger = logging.getLogger("vllm.moa_hf")  # under vLLM's logger: shown with its output


def unsupported_reason(vllm_config, options: MoAVllmOptions) -> str | None:
    """Why moa-hf cannot run inside this vLLM configuration (a sentence), or None."""
    import vllm

    version = vllm.__version__.split("+")[0]
    if version not in TESTED_VLLM_VERSIONS and not options.allow_untested_vllm:
        return (
            f"moa-hf's vLLM proposer is tested with vLLM {', '.join(TESTED_VLLM_VERSIONS)}, not {vllm.__version__}: "
            "it reads vLLM's paged cache and attention metadata, which change between releases. Install a tested "
            'version (`pip install "moa-hf[vllm]"`) or pass allow_untested_vllm=True to try (the cache layout is '
            "still checked at start)."
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        return (
            f"tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}: the MoA drafter reads every layer's keys/values of all KV heads, "
            "which tensor parallelism splits across ranks (and pipeline parallelism splits the layers). It would "
            "take gathering the new tokens' K/V heads (and layers) onto one rank each step. Serve with both = 1."
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        return (
            f"kv_cache_dtype={cache_dtype!r}: the drafter's LSA was trained on the target's unquantised keys/values "
            "and reads them from vLLM's cache. Serve without --kv-cache-dtype."
        )
    return None


def unsupported_drafter_reason(drafter) -> str | None:
    """Why moa_hf.vllm cannot draft with this drafter (a sentence), or None: its kind in the drafter-type registry
    must declare `vllm_support`."""
    record = drafter_type(drafter)
    if not record.vllm_support:
        served = ", ".join(t.kind for t in drafter_types() if t.vllm_support)
        return (
            f"it is a {record.label} (kind {record.kind!r}), which moa_hf.vllm does not serve (it serves: {served}). "
            "Serve it with transformers (`moa_hf.generate` or `assistant_model=`)."
        )
    return None


@dataclass
class _Row:
    """A row of the drafter's batched state: the verified tokens fed to it (SA and CA) and its latest draft."""

    fed: np.ndarray
    draft: list = field(default_factory=list)
    by_lookup: bool = False  # the draft came from prompt lookup (else from the network)


class MoAProposer:
    """vLLM's `custom_class` proposer for MoA drafters. Built by vLLM with its `VllmConfig`; reads its options from
    `additional_config["moa_hf"]` (see `MoAVllmOptions`, `moa_hf.vllm.engine_args`)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.options = MoAVllmOptions.from_vllm(vllm_config)
        reason = unsupported_reason(vllm_config, self.options)
        if reason is not None:
            raise ValueError(f"MoA cannot run in this vLLM engine: {reason}")
        self.max_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.policy = VllmDraftPolicy(self.max_tokens, fixed=self.options.draft_length)
        self.lives = RowLives(self.policy.lengths)  # each row's generated tokens; finished rows' lengths
        self.drafter = None
        self.reader: PagedKVReader | None = None
        self.tap = StepTap()
        self._hooks = contextlib.ExitStack()
        self.state = None  # MoATreeState of `rows`
        self.rows: list[_Row] = []
        self._steady = True  # the last propose drafted in steady state (no row caught up from scratch)
        self._last_step: tuple | None = None  # (rows, k, network, propose start, propose end)
        self.stats = {
            "steps": 0,
            "drafted_steps": 0,
            "lookup_rows": 0,
            "network_rows": 0,
            "rebuilt_rows": 0,
            "propose_s": 0.0,
        }

    # -- vLLM's calls -------------------------------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        """Load the drafter, attach it to a transformers-shaped view of vLLM's target (signature and weights
        fingerprint checked as `attach` does) and hook the target's forward to record each step's block tables."""
        model_config = self.vllm_config.model_config
        drafter = load_drafter(self.options.drafter, dtype=model_config.dtype, device="cpu")
        reason = unsupported_drafter_reason(drafter)
        if reason is not None:
            raise ValueError(f"The drafter {self.options.drafter!r} cannot draft in vLLM: {reason}")
        tli = getattr(drafter.config, "target_layer_inference", 0)
        view = TargetView(target_model, model_config.hf_config, model_config.model, tli_layers=tli)
        drafter.attach(view, allow_other_target=self.options.allow_other_target)
        if getattr(drafter.config, "num_blocks", 1) > 1:  # a sorted drafter: each token leaves at its exit
            thresholds = drafter.exit_thresholds_for(drafter.active_target)
            if thresholds is not None and thresholds[0] <= 0.0:
                drafter.keep_first_block()  # every token leaves at exit 1: block 1 alone drafts the same tokens
        self.drafter = drafter.to(device=view.device).eval()
        self.tap.record_hidden = bool(drafter.needs_target_hidden)  # context_final_hidden: states by cache slot
        self._hooks.enter_context(self.tap.installed(target_model))
        gc = drafter.generation_config
        self.threshold = float(getattr(gc, "assistant_confidence_threshold", 0.0) or 0.0)
        eos = drafter.config.eos_token_id if gc.eos_token_id is None else gc.eos_token_id
        self.eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
        self.lookup = drafter.lookup_settings if self.options.lookup else None
        self.policy.lookup = self.lookup is not None

    def dummy_run(self, *args, **kwargs) -> None:  # vLLM's warm-up: nothing to warm
        return None

    def close(self) -> None:
        """Remove the hook from vLLM's target."""
        self._hooks.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self._hooks.close()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list:
        """Draft token ids for every row of vLLM's input batch: `list[list[int]]` (empty: no draft)."""
        t0 = time.perf_counter()
        drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, t0)
        t1 = time.perf_counter()
        self.stats["propose_s"] += t1 - t0
        if self._last_step is not None:
            self._last_step = (*self._last_step[:4], t1)
        if self.stats["steps"] % 500 == 0:
            logger.info("MoA proposer: %s; %s", self.stats, self.policy.as_dict())
        return drafts

    @torch.inference_mode()
    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now: float) -> list:
        B = len(sampled_token_ids)
        meta = self.tap.metadata
        active = [j for j in range(B) if sampled_token_ids[j] and num_tokens_no_spec[j] < self.max_model_len]
        histories = {j: np.asarray(token_ids_cpu[j, : int(num_tokens_no_spec[j])]) for j in active}
        self._record_step(now, len(active), meta)
        window = self.options.catch_up_window
        matches = match_rows([row.fed for row in self.rows], [histories[j] for j in active], window)
        for j, index in zip(active, matches):  # the draft of the last step: how much of it the target accepted
            row = None if index is None else self.rows[index]
            if row is not None and row.draft:
                self.policy.record_acceptance(len(row.draft), len(sampled_token_ids[j]) - 1, row.by_lookup)
        generated = self.lives.update([histories[j] for j in active])
        catch_up, remaining = self._catch_up_debt(active, histories, matches, generated)
        k, network = self.policy.plan(len(active), catch_up, remaining) if active else (0, True)
        logger.debug("MoA proposer: %d rows, draft length %d, network %s", len(active), k, network)
        self.stats["steps"] += 1
        self._last_step = (len(active), k, network, now, now)
        self._steady = True
        drafts = [[] for _ in range(B)]
        for row in self.rows:
            row.draft = []
        if k == 0:
            return drafts
        self.stats["drafted_steps"] += 1
        limits = {j: min(k, self.max_model_len - len(histories[j]) - 1) for j in active}
        lookup = {j: self._lookup(histories[j], limits[j]) for j in active}
        network = [j for j in active if network and lookup[j] is None and limits[j] > 0]
        self.policy.record_rows(sum(v is not None for v in lookup.values()), len(active))
        if network:
            chains = self._draft(active, histories, matches, meta, k)  # self.rows now follow `active`
            matches = list(range(len(active)))
            for j, chain in zip(active, chains):
                if lookup[j] is None:
                    drafts[j] = chain[: max(limits[j], 0)]
        for j in active:
            if lookup[j] is not None:
                drafts[j] = lookup[j]
        for j, index in zip(active, matches):  # each row's draft on its state row, for the next step's accounting
            if index is not None:
                self.rows[index].draft, self.rows[index].by_lookup = list(drafts[j]), lookup[j] is not None
        self.stats["lookup_rows"] += sum(v is not None for v in lookup.values())
        self.stats["network_rows"] += len(network)
        return drafts

    # -- the drafter state of the rows ------------------------------------------------------------------------------
    def _catch_up_debt(
        self, active: list, histories: dict, matches: list, generated: list
    ) -> tuple[int, float | None]:
        """The verified tokens the network would read before drafting beyond a steady step's (rows it starts on, or
        fell behind on while not drafting), and the mean tokens those rows have left (None: no such row)."""
        window = self.options.catch_up_window
        tokens, left = 0, []
        for j, index, done in zip(active, matches, generated):
            n = len(histories[j])
            lag = min(n, window or n) if index is None else n - len(self.rows[index].fed)
            if index is None or lag > self.max_tokens + 1:
                tokens += lag
                left.append(self.policy.lengths.remaining(done))
        return tokens, (sum(left) / len(left) if left else None)

    def _record_step(self, now: float, num_rows: int, meta) -> None:
        """Time the step that just ran when it was a plain decoding/verification step of the last step's rows (every
        row's query at most 1 + the draft length: no prefill chunk in it): the engine's time (from the end of the
        last `propose` to now) by the tokens it verified, and the last `propose`'s own time."""
        if self._last_step is None or meta is None:
            return
        rows, k, network, started, ended = self._last_step
        if rows == 0 or rows != num_rows:
            return
        starts = meta.query_start_loc
        if int((starts[1:] - starts[:-1]).max()) <= k + 1:
            draft_s = ended - started if self._steady else None  # rows caught up from scratch: a one-off cost
            self.policy.record_step(rows, k, int(starts[-1]), now - ended, draft_s, network)

    def _read_kv(self) -> PagedKVReader:
        """The reader of the target's paged cache, built at the first draft (caches are bound after load_model);
        its layout is checked by writing known keys/values with vLLM's own op and reading them back."""
        if self.reader is None:
            layers = _target_attention_layers(self.vllm_config)
            first = layers[0]
            backend = first.attn_backend.get_name()
            layout = layout_for(backend, getattr(first, "isa", None), str(getattr(first, "kv_cache_dtype", "auto")))
            for layer in layers:
                if getattr(getattr(layer, "impl", None), "sliding_window", None) not in (None, -1, (-1, -1)):
                    raise UnsupportedCacheError(
                        f"{layer.layer_name} is a sliding-window layer: vLLM frees its blocks outside the window, "
                        "which moa-hf's vLLM reader does not track yet. Serve this target with transformers "
                        "(`moa_hf.generate`), whose caches the drafter reads window-aware."
                    )
            _check_layout(layout, first, backend)
            self.reader = PagedKVReader([layer.kv_cache for layer in layers], layout, dtype=self.drafter.dtype)
        return self.reader

    def _draft(self, active: list, histories: dict, matches: list, meta, k: int) -> list[list[int]]:
        """Catch every active row up (`matches`: its state row, or None to start it afresh) and draft a chain of up
        to k tokens per row, batched."""
        drafter, reader = self.drafter, self._read_kv()
        if meta is None:
            raise RuntimeError("No attention metadata was recorded for this step (the target's forward hook).")
        table = meta.block_table[: len(meta.seq_lens)]  # [B, max_blocks]: this step's rows, in vLLM's order
        kept = [(pos, index) for pos, index in enumerate(matches) if index is not None]
        fresh = [pos for pos, index in enumerate(matches) if index is None]
        window = self.options.catch_up_window
        parts, root_logits, order = [], [], []
        lag = 0  # the most tokens a continuing row catches up: more than a step verifies after a pause in drafting
        if kept:
            self.state.select_rows(torch.tensor([i for _, i in kept]))
            rows = [active[p] for p, _ in kept]
            starts = [len(self.rows[i].fed) for _, i in kept]
            lag = max(len(histories[j]) - start for j, start in zip(rows, starts))
            root_logits.append(self._catch_up(self.state, rows, starts, histories, table, reader))
            parts.append(self.state)
            order += [p for p, _ in kept]
        for p in fresh:  # one at a time: prompts differ in length, and padding them together costs
            self.stats["rebuilt_rows"] += 1
            state, j = drafter.tree_start(1), active[p]
            start = 0 if window is None else max(0, len(histories[j]) - window)
            t0 = time.perf_counter()
            root_logits.append(self._catch_up(state, [j], [start], histories, table, reader))
            self.policy.catch_up.record(len(histories[j]) - start, time.perf_counter() - t0)
            parts.append(state)
            order.append(p)
        self._steady = not fresh and lag <= self.max_tokens + 1  # this step's time is a per-step drafting cost
        self.state = parts[0] if len(parts) == 1 else drafter.tree_concat_rows(parts)
        perm = torch.tensor(np.argsort(order))  # back to vLLM's row order
        self.state.select_rows(perm)
        logits = torch.cat(root_logits)[perm]  # [B, V]
        self.rows = [_Row(fed=histories[j]) for j in active]
        if self.state.num_verified > 2 * int(self.state.valid.sum(1).max()) + 64:
            drafter.tree_compact(self.state)  # padding and short catch-ups of some rows left many unused slots
        positions = torch.tensor([len(histories[j]) for j in active])  # [B] position of the first drafted token
        # a greedy chain of up to k tokens per row, one `tree_step` per position for all rows
        chains = self.drafter.tree_chain(self.state, logits, positions, k, eos=self.eos, threshold=self.threshold)
        return chains.lists()

    def _catch_up(self, state, rows: list, starts: list, histories: dict, table, reader) -> torch.Tensor:
        """Feed each row's verified tokens from position `starts[b]` on (right-aligned, left-padded); root logits
        [b, V]."""
        new = [histories[j][start:] for j, start in zip(rows, starts)]
        n = max(len(t) for t in new)
        tokens = torch.zeros(len(rows), n, dtype=torch.long)
        positions = torch.zeros(len(rows), n, dtype=torch.long)
        valid = torch.zeros(len(rows), n, dtype=torch.bool)
        for b, (t, start) in enumerate(zip(new, starts)):
            tokens[b, n - len(t) :] = torch.from_numpy(t.astype(np.int64))
            positions[b, n - len(t) :] = torch.arange(start, start + len(t))
            valid[b, n - len(t) :] = True
        prev = torch.where(valid, positions - 1, -1)  # [b, n] the context of token p is the target's state at p-1
        prev_slots = slots_of(table[rows], prev, reader.block_size)
        device = self.drafter.device
        hidden = self.tap.hidden_at(prev_slots, self.drafter.dtype).to(device) if self.tap.record_hidden else None
        return self.drafter.tree_catch_up(
            state, tokens.to(device), positions.to(device), valid.to(device), prev_slots.to(device), reader, hidden
        )

    def _lookup(self, history: np.ndarray, limit: int) -> list[int] | None:
        if self.lookup is None or limit <= 0:
            return None
        proposal = self.lookup.propose(torch.from_numpy(history.astype(np.int64)), limit, 0, self.eos)
        return None if proposal is None or proposal.numel() == 0 else proposal.tolist()


def match_rows(fed: list, histories: list, window: int | None = None) -> list[int | None]:
    """For each row's verified tokens `histories[b]` (vLLM's row order), the index of the drafter state row that it
    continues: whose `fed` tokens it extends by at least one and (with a `window`) at most `window` tokens, the state
    row at the same position tried first, each state row matched once. None: the row starts afresh (a new request; a
    row preempted and recomputed, or one with nothing new; one further behind than `window`, cheaper read anew from
    its last `window` tokens)."""

    def continues(state_fed, history) -> bool:
        n = len(state_fed)
        if not n < len(history) or (window is not None and len(history) - n > window):
            return False
        return np.array_equal(history[:n], state_fed)

    return pair_rows(fed, histories, continues)


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _target_attention_layers(vllm_config) -> list:
    """vLLM's attention layers of the target (not of a draft model), by layer index, with their bound caches."""
    context = vllm_config.compilation_config.static_forward_context
    layers = []
    for name, layer in context.items():
        match = _LAYER_INDEX.search(name)
        cache = getattr(layer, "kv_cache", None)
        if match is None or not isinstance(cache, torch.Tensor) or cache.numel() == 0:
            continue
        layers.append((int(match.group(1)), layer))
    if not layers:
        raise UnsupportedCacheError("vLLM has bound no KV cache to the target's attention layers.")
    return [layer for _, layer in sorted(layers, key=lambda item: item[0])]


def _check_layout(layout, layer, backend: str) -> None:
    """Write known keys/values into a scratch cache shaped like `layer`'s with vLLM's own cache-writing op and read
    them back through `layout`; raise `UnsupportedCacheError` when they differ (a layout moa-hf would misread)."""
    from vllm import _custom_ops as ops

    cache = layer.kv_cache
    _, H, bs, hd2 = cache.shape
    hd = hd2 // 2
    scratch = torch.zeros(2, H, bs, hd2, dtype=cache.dtype, device=cache.device)  # [2 blocks, H, bs, 2*hd]
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = min(2 * bs, 37)
    key = torch.randn(n, H, hd, generator=gen).to(cache)
    value = torch.randn(n, H, hd, generator=gen).to(cache)
    slots = torch.randperm(2 * bs, generator=gen)[:n].to(cache.device)
    if backend == "CPU_ATTN":
        kv = scratch.view(2, H, 2 * bs, hd)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layer.isa)
    else:  # FlashAttention / Triton: the same op their `do_kv_cache_update` calls
        key_cache, value_cache = scratch.transpose(1, 2).split(hd, dim=-1)
        one = torch.ones((), dtype=torch.float32, device=cache.device)
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", one, one)
    read = layout.read(scratch, slots // bs, slots % bs)  # [n, H*2*hd]
    expected = torch.cat([key, value], dim=-1).reshape(n, H * hd2)
    if not torch.equal(read, expected):
        raise UnsupportedCacheError(
            f"vLLM's {backend} cache (ISA {getattr(layer, 'isa', None)}) did not read back as the {layout.name} "
            "layout: keys/values written by vLLM's own op came back different, so moa-hf refuses to draft from it."
        )
