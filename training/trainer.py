"""`MoATrainer`: on-policy distillation of the MoA drafter from a frozen target (Zimmer et al., 2025, section 4).

Per batch the frozen target runs once over (prompt + its own response); the drafter then sees the target's cached
keys/values through simulated drafting cycles (a "staircase"): position i may only read the target's state of tokens
j < start(i), where a cycle starts at every prompt token and every `every` tokens of the response, `every` drawn from
U{min_cycle..max_cycle} per sequence (`cycle_starts="on_policy"`: also right after the drafter's own first-draft
misses). Loss per counted position (predicting a response token): `soft_ce_weight * CE(p_target, p_drafter) +
hard_ce_weight * CE(target's token, p_drafter) + feature_weight * SmoothL1(drafter feature, target's final hidden)`,
times `depth_decay ** depth` (the position's depth in its cycle), summed and divided by the number of counted
positions in the whole (accumulated, all-device) batch.

A target with sliding-window layers: the drafter reads a prompt at the end of it, when such a layer holds only its
last window-1 positions; the older ones have no context and stay out of the CA memory, in training
(`held_target_kv`) as at inference (`MoADrafterModel.read_context`).

A sorted drafter (K > 1 blocks, an exit after each) is scored at every exit: the loss is the weighted mean of the
exits' losses above (`exit_loss_weights`). A drafter serving several targets trains on each target's own data, every
batch from one target (`TargetBatchSampler`), with that target's parts, states and teacher head.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import ConcatDataset, Dataset, Sampler
from transformers import DynamicCache, PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from moa_hf.modeling import (
    CACHE_NAME,
    PRIMARY_TARGET,
    gather_target_kv,
    held_at_reads,
    held_capacities,
    split_target_kv,
)

from .arguments import MoATrainingArguments
from .cycles import mix64, read_ends_of_cycles, simulated_cycles
from .drafters import adapter_for, unwrap_model
from .evaluation import AcceptanceEvalCallback
from .losses import position_losses
from .states import TargetStates
from .throughput import StepProfile

__all__ = [
    "IGNORE_INDEX",
    "MoADataCollator",
    "MoATrainer",
    "TargetBatchSampler",
    "run_target",
]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class MoADataCollator:
    """Right-pads examples ``{"input_ids", "prompt_length"[, "response_mask", "sample_index", "target_kv",
    "final_hidden", "tli_hidden"]}`` into a training batch (cached target states are padded with zeros to [B, T, ...]).

    Returns ``input_ids`` and ``attention_mask`` [B, T], ``labels`` [B, T] (position i is counted, with label
    input_ids[i+1], when token i+1 is a response token: every token from `prompt_length` on, or, for a conversation
    with a ``response_mask``, every token of an assistant turn; else -100), ``response_mask`` [B, T] (bool) for
    conversations, ``prompt_lengths`` [B] and ``sample_index`` [B]
    (the example's index in the dataset: the seed of its random cycle lengths), and ``target_index`` [B] when the
    examples carry one (which of the trainer's targets produced them).
    """

    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [list(f["input_ids"])[: self.max_length] if self.max_length else list(f["input_ids"]) for f in features]
        width = max(len(s) for s in seqs)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(seqs)
        input_ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((B, width), dtype=torch.long)
        labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
        prompt_lengths = torch.zeros(B, dtype=torch.long)
        conversations = "response_mask" in features[0]
        response = torch.zeros((B, width), dtype=torch.bool) if conversations else None  # [B, T]
        for b, (seq, f) in enumerate(zip(seqs, features)):
            n = len(seq)
            p = min(int(f["prompt_length"]), n)
            input_ids[b, :n] = torch.tensor(seq, dtype=torch.long)
            attention_mask[b, :n] = 1
            if conversations:  # position i is counted when token i+1 is an assistant's
                response[b, :n] = torch.tensor(list(f["response_mask"])[:n], dtype=torch.bool)
                labels[b, : n - 1] = input_ids[b, 1:n].masked_fill(~response[b, 1:n], IGNORE_INDEX)
            else:
                first = max(p - 1, 0)  # position p-1 predicts the first response token
                if n - 1 > first:
                    labels[b, first : n - 1] = input_ids[b, first + 1 : n]
            prompt_lengths[b] = p
        sample_index = torch.tensor([int(f.get("sample_index", -1)) for f in features], dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "prompt_lengths": prompt_lengths,
            "sample_index": sample_index,
        }
        if conversations:
            batch["response_mask"] = response
        if "target_index" in features[0]:
            batch["target_index"] = torch.tensor([int(f["target_index"]) for f in features], dtype=torch.long)
        for key in ("target_kv", "final_hidden", "tli_hidden"):  # cached target states (`states.TargetStatesDataset`)
            if key in features[0]:
                first = features[0][key]
                padded = first.new_zeros(B, width, *first.shape[1:])  # [B, T, ...]
                for b, (seq, f) in enumerate(zip(seqs, features)):
                    padded[b, : len(seq)] = f[key][: len(seq)]
                batch[key] = padded
        return batch


def _example_lengths(dataset, max_length: int | None = None) -> list[int] | None:
    """Token counts of a training dataset's examples (through `_Indexed`, `_Tagged`, `ConcatDataset` and cached-states
    wrappers down to `datasets.Dataset`s), read from their `input_ids` column without loading cached states; None
    when a part is not such a dataset."""
    if isinstance(dataset, ConcatDataset):
        parts = [_example_lengths(d, max_length) for d in dataset.datasets]
        return None if any(p is None for p in parts) else [n for p in parts for n in p]
    inner = getattr(dataset, "dataset", None)
    if inner is not None and not hasattr(dataset, "column_names"):
        return _example_lengths(inner, max_length)
    if "input_ids" not in (getattr(dataset, "column_names", None) or []):
        return None
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")["input_ids"]  # the lengths without reading the token ids into Python
    lengths = pc.list_value_length(column).to_pylist()
    return [min(n, max_length) for n in lengths] if max_length else lengths


class _Indexed(Dataset):
    """A map-style dataset whose items also carry their index (`sample_index`)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {**self.dataset[idx], "sample_index": int(idx)}


class _Tagged(Dataset):
    """A map-style dataset whose items also carry the index of the target that produced them (`target_index`)."""

    def __init__(self, dataset, target_index: int):
        self.dataset = dataset
        self.target_index = target_index

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        return {**self.dataset[idx], "target_index": self.target_index}


class TargetBatchSampler(Sampler[int]):
    """Indices into the concatenation of several targets' datasets (sizes `sizes`, in that order) such that every
    consecutive block of `batch_size` indices comes from one target: each epoch, every dataset is shuffled and cut
    into blocks (its last block filled up with its own first examples of the epoch), and all blocks are shuffled
    together, so targets are mixed in proportion to their dataset sizes. A pure function of (seed, epoch).

    With `lengths` (the examples' token counts, in the same concatenated order), each dataset's shuffled order is cut
    into groups of `GROUP_BATCHES` blocks and each group sorted by length before it is cut into blocks: a block holds
    examples of similar lengths, so a right-padded batch computes little padding (the blocks are still shuffled).

    A DataLoader with this sampler and the same `batch_size` yields one-target batches (Accelerate hands whole
    batches to processes: the same holds per process under DDP).
    """

    GROUP_BATCHES = 16

    def __init__(self, sizes: Sequence[int], batch_size: int, seed: int = 0, lengths: Sequence[int] | None = None):
        if batch_size < 1 or not sizes or min(sizes) < 1:
            raise ValueError(f"Need a positive batch size and non-empty datasets, got {batch_size} and {list(sizes)}.")
        self.sizes = [int(n) for n in sizes]
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        if lengths is not None and len(lengths) != sum(self.sizes):
            raise ValueError(f"{len(lengths)} lengths for {sum(self.sizes)} examples.")
        self.lengths = None if lengths is None else [int(n) for n in lengths]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _blocks(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(int(mix64(self.seed, self.epoch, 0x7A67) >> 1))
        blocks, offset = [], 0
        for n in self.sizes:
            order = (offset + torch.randperm(n, generator=g)).tolist()
            if self.lengths is not None:  # sort groups of GROUP_BATCHES blocks by length, longest first
                group = self.GROUP_BATCHES * self.batch_size
                order = [i for s in range(0, n, group) for i in sorted(order[s : s + group], key=self._length)]
            width = -(-n // self.batch_size) * self.batch_size
            order = (order * -(-width // n))[:width]  # filled up with the first ones again
            blocks += [order[i : i + self.batch_size] for i in range(0, width, self.batch_size)]
            offset += n
        return [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]

    def _length(self, i: int) -> int:
        return -self.lengths[i]

    def __iter__(self):
        for block in self._blocks():
            yield from block

    def __len__(self) -> int:
        return sum(-(-n // self.batch_size) for n in self.sizes) * self.batch_size


# ---------------------------------------------------------------------------------------------------------------------
# Simulated drafting cycles
# ---------------------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------------------
# The target's side
# ---------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def run_target(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    target_layer_inference: int = 0,
) -> TargetStates:
    """One no-grad forward of the target with its cache and hidden states; the [B, T, V] logits are not computed
    (only the last position's, where the model supports `logits_to_keep`).

    The cache is a full one (every layer keeps every position, sliding-window layers included: the same outputs);
    which keys/values inference could still read is marked by `MoATrainer.held_target_kv`."""
    kwargs = {"logits_to_keep": 1} if _accepts(target, "logits_to_keep") else {}
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=True,
        **{CACHE_NAME: DynamicCache()},
        **kwargs,
    )
    cache, hidden = getattr(out, CACHE_NAME), out.hidden_states  # hidden: L+1 x [B, T, d]
    T = input_ids.shape[1]
    n = target_layer_inference
    num_layers = len(hidden) - 1
    tli_kv = None
    if n > 0:
        tli_kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(num_layers - n, num_layers)]
    return TargetStates(
        target_kv=gather_target_kv(cache, 0, T),
        feature=hidden[num_layers - n] if n > 0 else hidden[-1],
        final_hidden=hidden[-1],
        tli_kv=tli_kv,
    )


def _accepts(model: torch.nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------------
class TrainingTally(TrainerCallback, ExportableState):
    """What a run has trained that transformers' `TrainerState` does not keep: the non-padding tokens per target
    (summed over processes) and the wall time, saved in every checkpoint (`stateful_callbacks`) and restored when the
    run resumes from one (`restore_callback_states_from_checkpoint`, on by default in `MoATrainingArguments`). The
    wall time counts the segments that led to the checkpoint, then this one."""

    def __init__(self):
        self.tokens: dict[str, float] = {}
        self.wall_time_s = 0.0  # the earlier segments' (restored from a checkpoint)
        self._started = time.perf_counter()  # a restored tally is made as the resumed loop starts

    def on_train_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Wall time of the run: the earlier segments and this one so far (seconds)."""
        return self.wall_time_s + time.perf_counter() - self._started

    def state(self) -> dict:
        return {"args": {}, "attributes": {"tokens": dict(self.tokens), "wall_time_s": self.elapsed()}}


class MoATrainer(Trainer):
    """Trains `model` (a drafter, optionally PEFT-wrapped) against a frozen `target`, or several targets.

    The targets are kept as trainer attributes: each is put in eval mode with `requires_grad=False`, never optimized,
    never saved (checkpoints and `save_model` hold the drafter only). The drafter's class picks its adapter
    (`drafters.ADAPTERS`): how it runs on a batch and which head it is scored through. A MoA / EAGLE-style drafter is
    attached to the target of each batch for the borrowed embedding / LM head (and TLI layers); one with
    `own_embeddings=True` keeps its copies frozen.

    Args:
        model: the drafter: MoA, EAGLE-style or an independent causal LM.
        target: the frozen target LLM, or {target name: model} for a MoA drafter serving several targets (`"main"`
            is the drafter's primary target; a missing other one gets its parts with
            `add_target(name, model, lora_rank=args.target_lora_rank)` before training).
        args: `MoATrainingArguments`.
        train_dataset: a map-style dataset of ``{"input_ids", "prompt_length"}`` (see `build_dataset`), the main
            target's (the only target's); or {target name: dataset}, each target's own data. Every batch comes from
            one target (`TargetBatchSampler`).
        eval_dataset: held-out data of the main (first) target, for the evaluation loss.
        eval_prompts: held-out prompts (strings, with `processing_class` as tokenizer, or token-id lists) for the
            acceptance-length evaluation (`AcceptanceEvalCallback`), `args.eval_num_prompts` of them: the same for
            every target, or {target name: prompts}.
    """

    loss_is_scaled_for_ga = True  # compute_loss divides by the token count of the whole accumulated batch

    def __init__(
        self,
        model: torch.nn.Module,
        target: PreTrainedModel | Mapping[str, PreTrainedModel],
        args: MoATrainingArguments,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        eval_prompts: Sequence[str] | Sequence[Sequence[int]] | Mapping[str, Sequence] | None = None,
        processing_class=None,
        callbacks=None,
        **kwargs,
    ):
        if not isinstance(args, MoATrainingArguments):
            raise TypeError(
                f"MoATrainer needs MoATrainingArguments (got {type(args).__name__}); build them with "
                "`moa_hf.training.MoATrainingArguments(output_dir=..., ...)`."
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"{args.n_gpu} GPUs are visible to one process (torch.nn.DataParallel), which MoATrainer does not "
                "support. Launch one process per GPU: `accelerate launch --multi_gpu ...` or `torchrun ...`."
            )
        self.adapter = adapter_for(model)  # how this class of drafter is built, run and read
        self.targets = dict(target) if isinstance(target, Mapping) else {PRIMARY_TARGET: target}
        if not self.targets:
            raise ValueError("MoATrainer needs a target model.")
        self.target_names = list(self.targets)
        by_target = self._datasets_by_target(train_dataset)
        # the target of untagged batches (evaluation data): the one trained on, else the primary one
        self.default_target = (
            next(iter(by_target))
            if by_target and len(by_target) == 1
            else (PRIMARY_TARGET if PRIMARY_TARGET in self.targets else self.target_names[0])
        )
        self.target = self.targets[self.default_target]
        self.capacities_by_target = {  # positions each layer of each target keeps
            name: held_capacities(DynamicCache(config=t.config)) for name, t in self.targets.items()
        }
        self.target_capacities = self.capacities_by_target[self.default_target]  # the default target's
        for t in self.targets.values():
            t.eval()
            t.requires_grad_(False)
            if getattr(t, "hf_device_map", None) is None and t.device != args.device:
                t.to(args.device)
        drafter = unwrap_model(model)
        self.adapter.prepare(drafter, self.target)
        self._prepare_targets(model, drafter, args, by_target)
        self.exit_weights = args.exit_weights(self.adapter.num_exits(drafter))
        if data_collator is None:
            pad = self.target.config.get_text_config().pad_token_id
            data_collator = MoADataCollator(pad_token_id=pad if pad is not None else 0, max_length=args.max_length)
        self._target_sizes = [len(d) for d in by_target.values()] if by_target else []
        if by_target and len(by_target) > 1:
            tagged = [_Tagged(d, self.target_names.index(name)) for name, d in by_target.items()]
            train_dataset = _Indexed(ConcatDataset(tagged))
        elif by_target:
            train_dataset = _Indexed(next(iter(by_target.values())))
        eval_dataset = _Indexed(eval_dataset) if eval_dataset is not None else None
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            **kwargs,
        )
        self.model_accepts_loss_kwargs = True  # makes the Trainer count `labels` tokens into num_items_in_batch
        self.profile = StepProfile(args.profile_steps, args.device)  # sections cost nothing unless profiling
        if args.profile_steps > 0:
            self.add_callback(self.profile)
        K = len(self.exit_weights)
        self._parts = torch.zeros(3 + K, dtype=torch.float64)  # soft CE, feature loss, tokens since last log, exits
        self._agreement = torch.zeros(4, dtype=torch.float64)  # evaluation: top-1 hits, positions, first-of-cycle ones
        self.add_callback(TrainingTally())  # tokens per target and wall time, kept across a resume
        if eval_prompts is not None and args.eval_num_prompts > 0:
            if isinstance(eval_prompts, Mapping):
                eval_prompts = {name: list(p)[: args.eval_num_prompts] for name, p in eval_prompts.items()}
            else:
                eval_prompts = list(eval_prompts)[: args.eval_num_prompts]
            self.add_callback(
                AcceptanceEvalCallback(
                    self.targets,
                    eval_prompts,
                    tokenizer=processing_class,
                    max_new_tokens=args.eval_max_new_tokens,
                    every_n_steps=args.eval_acceptance_steps,
                    trainer=self,
                    each_exit=args.eval_each_exit,
                    context_ablation=args.eval_context_ablation,
                )
            )

        self._replay_rules = None  # chain rules of the replay on held-out greedy answers (`evaluation_loop`)
        if args.eval_replay_rules:
            from .replay import parse_rules

            self._replay_rules = parse_rules(args.eval_replay_rules)

    def _datasets_by_target(self, train_dataset) -> dict[str, Dataset] | None:
        """{target name: dataset} from `train_dataset` (a plain one is the main target's, or the only target's)."""
        if train_dataset is None:
            return None
        if not isinstance(train_dataset, Mapping):
            if PRIMARY_TARGET not in self.targets and len(self.targets) > 1:
                raise ValueError(
                    f"Pass the training data of several targets as {{target name: dataset}} (targets: "
                    f"{self.target_names})."
                )
            name = PRIMARY_TARGET if PRIMARY_TARGET in self.targets else self.target_names[0]
            return {name: train_dataset}
        unknown = sorted(set(train_dataset) - set(self.targets))
        if unknown:
            raise ValueError(f"Training data for {unknown}, which are not among the targets {self.target_names}.")
        empty = [name for name, d in train_dataset.items() if len(d) == 0]
        if empty:
            raise ValueError(f"The training data of target(s) {empty} is empty.")
        return {name: d for name, d in train_dataset.items()}

    def _prepare_targets(self, model, drafter, args: MoATrainingArguments, by_target) -> None:
        """Parts for every target the drafter lacks; with `train_target_parts` (or `freeze_blocks`), everything else
        (the first blocks and what they read) frozen."""
        missing = [n for n in self.targets if n != PRIMARY_TARGET and n not in getattr(drafter, "target_names", [n])]
        if missing and model is not drafter and hasattr(model, "get_base_model"):
            raise ValueError(
                f"Add the targets {missing} to the drafter (`drafter.add_target`) before wrapping it with PEFT; or "
                "train without --lora-r."
            )
        added = self.adapter.add_targets(drafter, self.targets, lora_rank=args.target_lora_rank)
        if added:
            logger.info("Added parts for target(s) %s (LoRA rank %d).", added, args.target_lora_rank)
        if args.freeze_blocks:
            if args.train_target_parts is not None:
                raise ValueError("freeze_blocks and train_target_parts both choose what trains: give one of them.")
            others = [n for n in self.targets if n != PRIMARY_TARGET]
            params = self.adapter.train_deeper_blocks(drafter, args.freeze_blocks, others)
            logger.info(
                "Blocks 1..%d frozen; training the deeper blocks and the parts of %s: %d parameters.",
                args.freeze_blocks,
                others,
                sum(p.numel() for p in params),
            )
        name = args.train_target_parts
        if name is None:
            return
        if name not in self.targets:
            raise ValueError(f"train_target_parts={name!r} is not among the targets {self.target_names}.")
        others = sorted(set(by_target or {}) - {name})
        if others:
            raise ValueError(
                f"Training only the parts of target {name!r} takes that target's data only, not that of {others}."
            )
        if model is not drafter and hasattr(model, "get_base_model"):
            raise ValueError("train_target_parts trains the drafter's own per-target parts: do not wrap it in PEFT.")
        params = self.adapter.train_only_target_parts(drafter, name)
        logger.info("Training only target %r's parts: %d parameters.", name, sum(p.numel() for p in params))

    @property
    def drafter(self) -> torch.nn.Module:
        """The drafter being trained (under any PEFT / DDP wrapper): MoA, EAGLE-style or an independent LM."""
        return unwrap_model(self.model)

    def _get_train_sampler(self, train_dataset=None):
        """`TargetBatchSampler` (one-target batches, of similar lengths with `train_sampling_strategy=
        "group_by_length"`) for several targets or grouped lengths; else the Trainer's own sampler."""
        grouped = self.args.train_sampling_strategy == "group_by_length"
        if (len(self._target_sizes) > 1 or grouped) and (train_dataset is None or train_dataset is self.train_dataset):
            lengths = _example_lengths(self.train_dataset, self.args.max_length) if grouped else None
            # blocks of one optimizer step's examples on all processes: accumulated micro-batches and DDP processes
            # (Accelerate deals consecutive batches out to them) see what one large batch would
            step_batch = self._train_batch_size * self.args.gradient_accumulation_steps * max(1, self.args.world_size)
            return TargetBatchSampler(self._target_sizes, step_batch, seed=self.args.seed, lengths=lengths)
        return super()._get_train_sampler(train_dataset)

    @property
    def tally(self) -> TrainingTally:
        """The run's `TrainingTally` (a resume replaces the callback with the checkpoint's)."""
        return next(cb for cb in self.callback_handler.callbacks if isinstance(cb, TrainingTally))

    def target_token_counts(self) -> dict[str, int]:
        """Non-padding training tokens seen per target (summed over processes; a resumed run counts its checkpoint's
        too)."""
        return {name: int(self.tally.tokens.get(name, 0)) for name in self.target_names}

    # -----------------------------------------------------------------------------------------------------------------
    # Batch preparation
    # -----------------------------------------------------------------------------------------------------------------
    def batch_target(self, inputs: dict[str, torch.Tensor]) -> str:
        """The name of the target whose data the batch is (every batch comes from one target)."""
        index = inputs.get("target_index")
        if index is None:
            return self.default_target
        if bool((index != index[0]).any()):
            raise ValueError(
                "A batch mixes the data of several targets; train with MoATrainer's own sampler (TargetBatchSampler)."
            )
        return self.target_names[int(index[0])]

    def target_states(self, inputs: dict[str, torch.Tensor], target_name: str | None = None) -> TargetStates:
        """The frozen target's states for the batch (of target `target_name`; None: the batch's): cached ones
        (`states.TargetStatesDataset`) when the batch has them, else one no-grad forward of the target."""
        target = self.targets[target_name or self.batch_target(inputs)]
        tli = self.adapter.target_layer_inference(self.drafter)
        if "final_hidden" not in inputs:
            return run_target(target, inputs["input_ids"], inputs.get("attention_mask"), target_layer_inference=tli)
        hidden = inputs["final_hidden"]
        kv = inputs.get("target_kv")
        if self.adapter.needs_target_kv and kv is None:
            raise ValueError(
                f"{type(self.drafter).__name__} reads the target's keys/values but the cached target states have no "
                "`target_kv`; cache the states with them (`cache_target_states`)."
            )
        if tli == 0:
            return TargetStates(target_kv=kv, feature=hidden, final_hidden=hidden)
        before_last = inputs.get("tli_hidden")  # [B, T, M, d]: hidden_states[L-n] for n = 1..M
        if before_last is None or before_last.shape[2] < tli:
            have = 0 if before_last is None else before_last.shape[2]
            raise ValueError(
                f"This drafter runs the target's last {tli} layers (target_layer_inference={tli}) but the cached "
                f"target states hold the inputs of the last {have}; cache them with `tli_layers={tli}` "
                f"(`moa train --states` does it for a new folder)."
            )
        num_layers, dtype = kv.shape[2], next(target.parameters()).dtype
        heads = self.drafter.config.target_num_key_value_heads
        tli_kv = [  # the last N layers' (keys, values) [B, Hkv, T, hd], as the target's cache holds them
            tuple(t.to(dtype) for t in split_target_kv(kv, layer, heads))
            for layer in range(num_layers - tli, num_layers)
        ]
        return TargetStates(target_kv=kv, feature=before_last[:, :, tli - 1], final_hidden=hidden, tli_kv=tli_kv)

    def held_target_kv(
        self, prompt_lengths: torch.Tensor, cycle_starts: torch.Tensor, target_name: str | None = None
    ) -> torch.Tensor | None:
        """bool [B, T]: whether every layer of the target (`target_name`; None: `default_target`) still holds token j's
        key/value when the drafter reads it at inference (`held_at_reads`): a sliding-window layer has dropped prompt
        positions older than its window by the first read (at the end of the prompt). None when every layer holds
        every position of the batch."""
        name = target_name or self.default_target
        capacities = self.target_capacities if name == self.default_target else self.capacities_by_target[name]
        T = cycle_starts.shape[1]
        if all(c is None or c >= T for c in capacities):
            return None
        return held_at_reads(read_ends_of_cycles(prompt_lengths, cycle_starts), capacities)

    def simulated_cycles(
        self, inputs: dict[str, torch.Tensor], first_hits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`cycles.simulated_cycles` of the batch at this step (evaluation: the same cycles every time)."""
        step = self.state.global_step if self.model.training else -1
        return simulated_cycles(self.args, inputs, step, self.state.max_steps, self.model.training, first_hits)

    def token_losses(
        self,
        student: torch.Tensor,
        feature: torch.Tensor | None,
        states: TargetStates,
        counted: torch.Tensor,
        target_name: str | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`losses.position_losses` with the teacher head of target `target_name` (None: `default_target`)."""
        teacher = self.targets[target_name or self.default_target].get_output_embeddings().weight  # [V, d]
        head = self.adapter.student_head(self.drafter)
        return position_losses(self.args, self.drafter, head, teacher, student, feature, states, counted, labels)

    # -----------------------------------------------------------------------------------------------------------------
    # Loss
    # -----------------------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Sum of per-position losses over the counted positions / `num_items_in_batch` (the counted positions of
        the whole accumulated batch on all devices), so gradient accumulation and DDP match one large batch.

        A drafter with K exits: the per-position loss is the weighted mean over exits (`exit_weights`) of each
        exit's loss; exits of weight 0 are scored without gradients (logged only)."""
        name = self.batch_target(inputs)
        self.adapter.use_target(self.drafter, self.targets[name])  # its embedding / head
        section = self.profile.section
        with section("target states"):
            states = self.target_states(inputs, name)
        with section("simulated cycles"):
            first_hits = None
            if self.args.cycle_starts == "on_policy" and self.adapter.simulates_cycles and model.training:
                first_hits = self._first_draft_hits(model, inputs, states, name)
            cycle_starts, sa_mask = (
                self.simulated_cycles(inputs, first_hits) if self.adapter.simulates_cycles else (None, None)
            )
            if cycle_starts is not None and states.target_kv is not None:
                states.target_kv_held = self.held_target_kv(inputs["prompt_lengths"], cycle_starts, name)
        with section("drafter forward"):
            exits = self.adapter.training_forward(
                model,
                inputs,
                states,
                cycle_starts=cycle_starts,
                sa_mask=sa_mask,
                feature_noise=self.args.feature_noise if model.training else 0.0,
                target_name=name,
            )
        if len(exits) != len(self.exit_weights):
            raise ValueError(f"The drafter gave {len(exits)} exits, expected {len(self.exit_weights)}.")
        counted = inputs["labels"] != IGNORE_INDEX  # [B, T]
        if "attention_mask" in inputs:
            counted &= inputs["attention_mask"].bool()
        per_exit = []  # (total, soft CE, feature) [N] per exit
        for weight, (student, feature) in zip(self.exit_weights, exits):
            # the heads in the loss run under the mixed-precision policy too (Accelerate applies it to the model's
            # forward only: a float32 draft head was ~3.5x slower than in bf16 on a CPU)
            with (
                section("loss"),
                self.accelerator.autocast(),
                contextlib.nullcontext() if weight > 0 else torch.no_grad(),
            ):
                per_exit.append(self.token_losses(student, feature, states, counted, name, inputs["labels"]))
        weighted = [(w, part) for w, part in zip(self.exit_weights, per_exit) if w > 0]
        total, ce, feat = (sum(w * part[i] for w, part in weighted) for i in range(3))  # each [N]
        if self.args.depth_decay < 1.0 and cycle_starts is not None:
            pos = torch.arange(counted.shape[1], device=counted.device)
            depth = (pos[None, :] - cycle_starts)[counted]  # [N]: 0 for a cycle's first draft
            total = total * self.args.depth_decay ** depth.to(total.dtype)
        if not model.training:
            self._count_agreement(exits[-1][0], inputs["labels"], counted, cycle_starts)
        if num_items_in_batch is None:
            loss = total.sum() / counted.sum().clamp(min=1)
        else:
            loss = total.sum() / torch.as_tensor(num_items_in_batch, device=total.device).clamp(min=1)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                loss = loss * self.args.world_size  # DDP averages gradients over processes; undo it
        if model.training:
            exit_sums = [float(part[0].detach().sum()) for part in per_exit]
            self._parts += torch.tensor(
                [float(ce.detach().sum()), float(feat.detach().sum()), float(counted.sum()), *exit_sums],
                dtype=torch.float64,
            )
            mask = inputs.get("attention_mask")
            tokens = torch.zeros(len(self.target_names), dtype=torch.float64)  # [targets] this batch's, this process
            tokens[self.target_names.index(name)] = float(
                mask.sum() if mask is not None else inputs["input_ids"].numel()
            )
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                tokens = tokens.to(self.args.device)
                torch.distributed.all_reduce(tokens)  # every process computes a loss for each micro-batch
            tally = self.tally.tokens
            for target_name, n in zip(self.target_names, tokens.tolist()):
                tally[target_name] = tally.get(target_name, 0.0) + n
        if return_outputs:
            token_loss = torch.zeros(counted.shape, device=total.device)
            token_loss[counted] = total.detach()
            return loss, {"token_loss": token_loss, "cycle_starts": cycle_starts}
        return loss

    @torch.no_grad()
    def _first_draft_hits(self, model, inputs, states: TargetStates, name: str) -> torch.Tensor:
        """bool [B, T]: whether the drafter's first draft of a cycle starting at each position (every earlier token
        verified) is the next token: one no-grad pass, every position the start of its own cycle."""
        exits = self.adapter.training_forward(model, inputs, states, cycle_starts=None, target_name=name)
        student = exits[-1][0]  # [B, T, d]
        flat = student.reshape(-1, student.shape[-1])
        top = torch.cat([self._student_top1(flat[i : i + 1024]) for i in range(0, flat.shape[0], 1024)])
        labels = inputs["labels"]
        return top.view(labels.shape) == labels

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step (forward, backward), timed and FLOP-counted when profiling (`profile_steps`)."""
        self.profile.count_tokens(inputs)
        with self.profile.counting_flops(), self.profile.section("forward+backward"):
            return super().training_step(model, inputs, num_items_in_batch)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        with self.profile.section("data"):
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    @torch.no_grad()
    def _student_top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's most likely next token (full-vocabulary ids) [n] for the hidden states [n, d] its head
        reads."""
        head, draft_ids = self.adapter.student_head(self.drafter)
        top = head(hidden).argmax(-1)
        return top if draft_ids is None else draft_ids.to(top.device)[top]

    @torch.no_grad()
    def _count_agreement(self, student, labels, counted, cycle_starts) -> None:
        """Evaluation: does the drafter's top-1 token equal the target's next token (the label)? Counted over all
        counted positions and over the first position of each simulated cycle (the first drafted token, which
        carries most of the acceptance length); cheap and far less noisy than an acceptance-length run."""
        hidden = student[counted]  # [N, d]
        top = torch.cat([self._student_top1(hidden[i : i + 1024]) for i in range(0, hidden.shape[0], 1024)])
        hits = (top == labels[counted]).double()
        if cycle_starts is None:  # no simulated cycles: every position reads the target's true past
            first = torch.ones_like(hits, dtype=torch.bool)
        else:
            pos = torch.arange(counted.shape[1], device=counted.device)
            first = (cycle_starts == pos[None, :])[counted]
        self._agreement += torch.tensor(
            [float(hits.sum()), float(hits.numel()), float(hits[first].sum()), float(first.sum())], dtype=torch.float64
        )

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ):
        """Adds ``{prefix}_top1`` (the drafter's top-1 token = the target's, all counted positions),
        ``{prefix}_top1_first`` (first positions of simulated cycles) and, with `eval_replay_rules` on single-turn
        answers, the replay's tokens per target call (``{prefix}_replay_tokens_per_call``; `replay.replay_metrics`)
        to the evaluation loss."""
        output = self._agreement_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        rows = getattr(dataloader.dataset, "dataset", None)  # `_Indexed`: the rows themselves
        columns = getattr(rows, "column_names", None) or []
        if self._replay_rules and "prompt_length" in columns and "response_mask" not in columns:
            from .replay import replay_metrics

            eos = self.target.generation_config.eos_token_id
            eos = [eos] if isinstance(eos, int) else list(eos or [])
            replayed = replay_metrics(
                self.drafter, self.target, rows, self._replay_rules, eos, self.accelerator.autocast
            )
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in replayed.items()})
        if self.args.eval_context_ablation:
            with self.adapter.context_ablated(self.drafter):
                ablated = self._agreement_loop(dataloader, description, prediction_loss_only, ignore_keys, "ablated")
            suffixes = {"loss": "loss", "top1": "top1", "top1_first": "top1_first"}
            for key, name in suffixes.items():
                if f"ablated_{key}" in ablated.metrics:
                    output.metrics[f"{metric_key_prefix}_{name}_no_context"] = ablated.metrics[f"ablated_{key}"]
        return output

    def _agreement_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
        """The Trainer's evaluation loop plus the top-1 agreement counts (`_count_agreement`)."""
        self._agreement.zero_()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        counts = self._agreement.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            counts = counts.to(self.args.device)
            torch.distributed.all_reduce(counts)
            counts = counts.cpu()
        if counts[1] > 0:
            output.metrics[f"{metric_key_prefix}_top1"] = float(counts[0] / counts[1])
            output.metrics[f"{metric_key_prefix}_top1_first"] = float(counts[2] / counts[3].clamp(min=1))
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the loss components (`soft_ce`, `feature_loss`, per counted token, this process; weighted over exits)
        and, for a drafter with several exits, each exit's loss (`loss_exit1`, ...) to training logs."""
        if "loss" in logs and self._parts[2] > 0:
            logs["soft_ce"] = float(self._parts[0] / self._parts[2])
            logs["feature_loss"] = float(self._parts[1] / self._parts[2])
            if len(self._parts) > 4:
                for i, value in enumerate(self._parts[3:].tolist(), start=1):
                    logs[f"loss_exit{i}"] = float(value / self._parts[2])
            self._parts.zero_()
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluation loss on `eval_dataset` (if any) and the acceptance length on held-out prompts (if any)."""
        if eval_dataset is not None or self.eval_dataset is not None:
            if eval_dataset is not None and not isinstance(eval_dataset, (_Indexed, dict)):
                eval_dataset = _Indexed(eval_dataset)
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        metrics: dict[str, float] = {}
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
