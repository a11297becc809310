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

The trainer's parts live by job: `collate.py` (the batch and its labels), `sampling.py` (each target's data, one-target
batches), `targets.py` (the frozen targets: their states, what inference still holds), `cycles.py` (the staircase),
`losses.py` (per-position losses and their sum), `tallies.py` (tokens per target, logged loss parts, top-1 agreement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, Trainer

from moa_hf.modeling import PRIMARY_TARGET

from .arguments import MoATrainingArguments
from .collate import IGNORE_INDEX, MoADataCollator
from .cycles import block_anchors, block_slots, markov_rows, simulated_cycles
from .drafters import adapter_for, unwrap_model
from .evaluation import AcceptanceEvalCallback
from .losses import batch_loss, depth_weighted, exits_weighted, position_losses
from .sampling import (
    IndexedDataset,
    TargetBatchSampler,
    datasets_by_target,
    default_target,
    example_lengths,
    training_dataset,
)
from .states import TargetStates
from .tallies import LossParts, TopOneAgreement, TrainingTally
from .targets import batch_target_states, freeze_targets, held_target_kv, prepare_targets
from .throughput import StepProfile

__all__ = ["MoATrainer"]

logger = logging.getLogger(__name__)


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
        by_target = datasets_by_target(train_dataset, self.target_names)
        self.default_target = default_target(by_target, self.target_names)  # the target of untagged batches
        self.target = self.targets[self.default_target]
        self.capacities_by_target = freeze_targets(self.targets, args.device)  # positions each layer of each keeps
        self.target_capacities = self.capacities_by_target[self.default_target]  # the default target's
        drafter = unwrap_model(model)
        self.adapter.prepare(drafter, self.target)
        prepare_targets(self.adapter, model, drafter, self.targets, args, by_target)
        self.exit_weights = args.exit_weights(self.adapter.num_exits(drafter))
        if data_collator is None:
            pad = self.target.config.get_text_config().pad_token_id
            data_collator = MoADataCollator(pad_token_id=pad if pad is not None else 0, max_length=args.max_length)
        self._target_sizes = [len(d) for d in by_target.values()] if by_target else []
        if by_target:
            train_dataset = training_dataset(by_target, self.target_names)
        eval_dataset = IndexedDataset(eval_dataset) if eval_dataset is not None else None
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
        self.loss_parts = LossParts(len(self.exit_weights))  # the loss components of the training logs
        self.agreement = TopOneAgreement()  # evaluation: the drafter's top-1 token against the target's
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

    @property
    def drafter(self) -> torch.nn.Module:
        """The drafter being trained (under any PEFT / DDP wrapper): MoA, EAGLE-style or an independent LM."""
        return unwrap_model(self.model)

    def _get_train_sampler(self, train_dataset=None):
        """`TargetBatchSampler` (one-target batches, of similar lengths with `train_sampling_strategy=
        "group_by_length"`) for several targets or grouped lengths; else the Trainer's own sampler."""
        grouped = self.args.train_sampling_strategy == "group_by_length"
        if (len(self._target_sizes) > 1 or grouped) and (train_dataset is None or train_dataset is self.train_dataset):
            lengths = example_lengths(self.train_dataset, self.args.max_length) if grouped else None
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
        """The frozen target's states for the batch (of target `target_name`; None: the batch's): cached ones when the
        batch has them, else one no-grad forward of the target (`targets.batch_target_states`)."""
        target = self.targets[target_name or self.batch_target(inputs)]
        return batch_target_states(inputs, target, self.drafter, self.adapter)

    def held_target_kv(
        self, prompt_lengths: torch.Tensor, cycle_starts: torch.Tensor, target_name: str | None = None
    ) -> torch.Tensor | None:
        """bool [B, T]: whether every layer of the target (`target_name`; None: `default_target`) still holds token j's
        key/value when the drafter reads it at inference (`held_at_reads`): a sliding-window layer has dropped prompt
        positions older than its window by the first read (at the end of the prompt). None when every layer holds
        every position of the batch."""
        name = target_name or self.default_target
        capacities = self.target_capacities if name == self.default_target else self.capacities_by_target[name]
        return held_target_kv(capacities, prompt_lengths, cycle_starts)

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
        head: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`losses.position_losses` with the teacher head of target `target_name` (None: `default_target`) and the
        drafter's head (`head`: another (head, draft ids))."""
        teacher = self.targets[target_name or self.default_target].get_output_embeddings().weight  # [V, d]
        head = head or self.adapter.student_head(self.drafter)
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
            if cycle_starts is not None and states.kv is not None:
                states.held = self.held_target_kv(inputs["prompt_lengths"], cycle_starts, name)
        counted = inputs["labels"] != IGNORE_INDEX  # [B, T]
        if "attention_mask" in inputs:
            counted &= inputs["attention_mask"].bool()
        blocks = {}  # a block drafter's: each simulated cycle's block, after the sequence (`block_layout`)
        if getattr(self.drafter.config, "block_size", 1) > 1 and cycle_starts is not None:
            blocks["block_anchors"] = block_anchors(cycle_starts, counted)
        with section("drafter forward"):
            exits = self.adapter.training_forward(
                model,
                inputs,
                states,
                cycle_starts=cycle_starts,
                sa_mask=sa_mask,
                feature_noise=self.args.feature_noise if model.training else 0.0,
                target_name=name,
                **blocks,
            )
        if len(exits) != len(self.exit_weights):
            raise ValueError(f"The drafter gave {len(exits)} exits, expected {len(self.exit_weights)}.")
        block_total = None
        if blocks:
            exits, block_total = self.block_losses(exits, states, counted, inputs, blocks, name)
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
        total, ce, feat = exits_weighted(self.exit_weights, per_exit)  # each [N]
        total = depth_weighted(total, counted, cycle_starts, self.args.depth_decay)
        if block_total is not None:
            total = torch.cat([total, block_total])  # the blocks' slots add to the sum (normalised as the chain's)
        if not model.training:
            top = self.adapter.top1(self.drafter, exits[-1][0][counted])  # [N]
            self.agreement.add(top, inputs["labels"], counted, cycle_starts)
        loss = batch_loss(total, counted, num_items_in_batch, self.args)
        if model.training:
            self.loss_parts.add(ce, feat, counted, per_exit)
            self.tally.count_batch(inputs, name, self.target_names, self.args.device)
        if return_outputs:
            token_loss = torch.zeros(counted.shape, device=total.device)
            token_loss[counted] = total.detach()
            return loss, {"token_loss": token_loss, "cycle_starts": cycle_starts}
        return loss

    def block_losses(self, exits, states: TargetStates, counted, inputs, blocks: dict, name: str):
        """A block drafter's outputs split at the sequence's end: (the sequence's exits, the loss [N'] of every
        placeholder slot that predicts a counted token, against the target's states at its position, times
        `depth_decay ** j` at slot j). With a Markov head (`block_markov_rank`) slot j's logits add its bias from the
        token before it, the real one (teacher-forced)."""
        T, labels = counted.shape[1], inputs["labels"]
        slots, offset = block_slots(blocks["block_anchors"], self.drafter.config.block_size, T)  # [B, S], [S]
        at = slots.clamp(min=0)  # [B, S]
        kept = (slots >= 0) & counted.gather(1, at)  # [B, S]
        pick = lambda x: x.gather(1, at[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731  [B, S, d]
        slot_states = dataclasses.replace(states, feature=pick(states.feature), final_hidden=pick(states.final_hidden))
        student, feature = exits[-1][0][:, T:], exits[-1][1][:, T:]  # [B, S, d]
        head = None
        if getattr(self.drafter.config, "block_markov_rank", 0):  # the token before slot j rides along with its row
            student, head = markov_rows(self.drafter, student, inputs["input_ids"].gather(1, at))
        with self.profile.section("loss"), self.accelerator.autocast():
            total = self.token_losses(student, feature, slot_states, kept, name, labels.gather(1, at), head)[0]
        if self.args.depth_decay < 1.0:
            total = total * self.args.depth_decay ** offset.expand_as(kept)[kept].to(total.dtype)
        return [(s[:, :T], f[:, :T]) for s, f in exits], total

    @torch.no_grad()
    def _first_draft_hits(self, model, inputs, states: TargetStates, name: str) -> torch.Tensor:
        """bool [B, T]: whether the drafter's first draft of a cycle starting at each position (every earlier token
        verified) is the next token: one no-grad pass, every position the start of its own cycle."""
        exits = self.adapter.training_forward(model, inputs, states, cycle_starts=None, target_name=name)
        student = exits[-1][0]  # [B, T, d]
        top = self.adapter.top1(self.drafter, student.reshape(-1, student.shape[-1]))  # [B*T]
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

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ):
        """Adds ``{prefix}_top1`` (the drafter's top-1 token = the target's, all counted positions),
        ``{prefix}_top1_first`` (first positions of simulated cycles) and, with `eval_replay_rules` on single-turn
        answers, the replay's tokens per target call (``{prefix}_replay_tokens_per_call``; `replay.replay_metrics`)
        to the evaluation loss."""
        output = self._agreement_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        rows = getattr(dataloader.dataset, "dataset", None)  # `IndexedDataset`: the rows themselves
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
        """The Trainer's evaluation loop plus the top-1 agreement (`tallies.TopOneAgreement`)."""
        self.agreement.reset()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(self.agreement.metrics(metric_key_prefix, self.args.device))
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the loss components (`soft_ce`, `feature_loss`, per counted token, this process; weighted over exits)
        and, for a drafter with several exits, each exit's loss (`loss_exit1`, ...) to training logs."""
        if "loss" in logs:
            logs.update(self.loss_parts.pop_logs())
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluation loss on `eval_dataset` (if any) and the acceptance length on held-out prompts (if any)."""
        if eval_dataset is not None or self.eval_dataset is not None:
            if eval_dataset is not None and not isinstance(eval_dataset, (IndexedDataset, dict)):
                eval_dataset = IndexedDataset(eval_dataset)
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        metrics: dict[str, float] = {}
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
