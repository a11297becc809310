"""Arguments of drafter training: `MoATrainingArguments` (a `transformers.TrainingArguments` with the drafter's own
fields), and the dataclasses `moa data` / `moa train` parse their options into (`transformers.HfArgumentParser`:
each field is an option, spelled with underscores or hyphens, `--max_steps` or `--max-steps`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import SchedulerType, TrainingArguments

from moa_hf.hardware import native_bf16
from moa_hf.modeling import PRIMARY_TARGET

from .drafters import KINDS, DrafterAdapter

__all__ = [
    "DataArguments",
    "DrafterArguments",
    "MoATrainingArguments",
    "TargetArguments",
    "TrainCommandArguments",
    "TrainDataArguments",
    "TrainTargetArguments",
    "named_values",
]

_DTYPES = ["auto", "bfloat16", "float16", "float32"]
_NAMED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def named_values(items: list[str] | None, what: str, split: bool = True) -> dict[str, list[str]]:
    """Options tagged with a target name, in order: ``NAME=V1[,V2...]`` -> {NAME: [V1, V2]} (values split on commas
    when `split`), a plain ``V`` -> {"main": [V]}. A name appearing twice collects both lists."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        match = _NAMED.match(item)
        name, value = (match.group(1), match.group(2)) if match else (PRIMARY_TARGET, item)
        values = [v for v in value.split(",") if v] if split and match else [value]
        if not values:
            raise ValueError(f"{what} {item!r} names no value; write {what} NAME=VALUE.")
        out.setdefault(name, []).extend(values)
    return out


def _parse_weights(value) -> list[float] | None:
    """`--exit-loss-weights 1,1,2` (or a list) -> [1.0, 1.0, 2.0]; None stays None (uniform)."""
    if value is None or isinstance(value, (list, tuple)):
        return None if value is None else [float(w) for w in value]
    try:
        return [float(w) for w in str(value).replace(" ", "").split(",") if w]
    except ValueError as err:
        raise ValueError(f"exit_loss_weights must be numbers separated by commas (1,1,2), got {value!r}.") from err


class _Repeated(argparse.Action):
    """A str option that may be given several times: ``--target main=a --target b=c`` -> ``"main=a,b=c"``."""

    def __call__(self, parser, namespace, values, option_string=None):
        marker = f"_{self.dest}_given"
        before = getattr(namespace, self.dest) if getattr(namespace, marker, False) else None
        setattr(namespace, self.dest, values if before is None else f"{before},{values}")
        setattr(namespace, marker, True)


@dataclass
class MoATrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the MoA drafter's training settings (paper: Zimmer et al., 2025, section 4).

    The defaults of a few inherited fields differ: `remove_unused_columns=False` (the collator's columns are all
    used), `label_names=["labels"]`, `prediction_loss_only=True`, `logging_steps=10`,
    `include_num_input_tokens_seen="non_padding"` (logs `train_tokens_per_second`), `ddp_find_unused_parameters=False`,
    `train_sampling_strategy="group_by_length"` (`TargetBatchSampler`: batches of similar lengths),
    `restore_callback_states_from_checkpoint=True` (a resumed run keeps its `TrainingTally`).
    """

    min_cycle: int = field(
        default=6, metadata={"help": "Shortest simulated drafting cycle (tokens); drawn U{min_cycle..max_cycle}."}
    )
    max_cycle: int = field(default=14, metadata={"help": "Longest simulated drafting cycle (tokens)."})
    soft_ce_weight: float = field(
        default=0.1, metadata={"help": "Weight of the soft cross-entropy to the target's next-token distribution."}
    )
    feature_weight: float = field(
        default=1.0, metadata={"help": "Weight of the SmoothL1 loss to the target's final (post-norm) hidden state."}
    )
    mask_outside_draft_vocab: bool = field(
        default=False,
        metadata={
            "help": "Drafters with a draft vocabulary: no soft cross-entropy at positions whose label (the target's "
            "next token) is outside it, where the draft head cannot propose the right token (the feature loss stays)."
        },
    )
    hard_ce_weight: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the cross-entropy to the target's own next token (the label: its greedy choice in "
            "greedy on-policy data), what greedy verification accepts; over the draft vocabulary where there is one "
            "(positions whose label is outside it count 0)."
        },
    )
    depth_decay: float = field(
        default=1.0,
        metadata={
            "help": "Weight of a position at depth d of its simulated cycle (d = 0 for the cycle's first draft): "
            "depth_decay ** d, as a depth-d draft counts only when the d before it were accepted (EAGLE-3: 0.8)."
        },
    )
    cycle_starts: str = field(
        default="staircase",
        metadata={
            "choices": ["staircase", "on_policy"],
            "help": "Where simulated cycles start in a response: 'staircase' every U{min_cycle..max_cycle} tokens; "
            "'on_policy' also right after each token the drafter's first draft misses (one no-grad drafter pass per "
            "batch), as decoding restarts after a rejection, in harder text. Single-turn data only.",
        },
    )
    eval_replay_rules: str | None = field(
        default="24:0.3,8:0",
        metadata={
            "help": "With --eval-data (greedy answers): on every evaluation, replay greedy chain decoding of those "
            "answers (`moa_hf.training.replay`, one-block MoA drafters) under these chain rules MAX_TOKENS:THRESHOLD "
            "and log eval_replay_tokens_per_call (the first) and eval_replay_k<K>_t<T> (each). None or '': off."
        },
    )
    vocab_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Tokens per chunk when applying the vocabulary-sized LM head in the loss: at most "
            "vocab_chunk_size x vocab_size logits exist at a time (forward and backward)."
        },
    )
    sa_curriculum: bool = field(
        default=False,
        metadata={
            "help": "Self-attention curriculum: with probability max(0, 1 - epoch / (E/2)) a sequence's SA sees only "
            "the tokens of the current cycle."
        },
    )
    feature_noise: float = field(
        default=0.0,
        metadata={"help": "EAGLE-style drafters: std of the Gaussian noise added to the input target features."},
    )
    max_length: int | None = field(
        default=None, metadata={"help": "Truncate training sequences to this many tokens (None: keep all)."}
    )
    eval_num_prompts: int = field(
        default=8, metadata={"help": "Held-out prompts for the acceptance-length evaluation (0 disables it)."}
    )
    eval_max_new_tokens: int = field(
        default=64, metadata={"help": "Tokens generated per held-out prompt in the acceptance-length evaluation."}
    )
    eval_acceptance_steps: int | None = field(
        default=None,
        metadata={"help": "Also measure the acceptance length every N optimizer steps (None: only on evaluate)."},
    )
    eval_each_exit: str = field(
        default="final",
        metadata={
            "choices": ["final", "always", "never"],
            "help": "Drafters with several blocks: also measure the acceptance length of every fixed exit (and of "
            "adaptive depth when the drafter has exit thresholds) at the final evaluation, at every one, or never "
            "(the other measurements draft as the drafter does by default).",
        },
    )
    eval_context_ablation: bool = field(
        default=False,
        metadata={
            "help": "MoA: every evaluation also runs with the drafter's context vectors zeroed (the target's state "
            "withheld): `*_no_context` metrics (top-1, loss, acceptance length) show how much the target's state "
            "is worth to the drafter."
        },
    )
    exit_loss_weights: str | None = field(
        default=None,
        metadata={
            "help": "Drafters with K blocks: weights of the K exits' losses, comma-separated (e.g. 1,1,2; default "
            "uniform); the loss is their weighted mean."
        },
    )
    train_target_parts: str | None = field(
        default=None,
        metadata={
            "metavar": "NAME",
            "help": "Train only the per-target parts of target NAME (its LSA input projection and LoRA deltas); "
            "every other weight of the drafter stays frozen. The data must all be that target's.",
        },
    )
    freeze_blocks: int = field(
        default=0,
        metadata={
            "metavar": "M",
            "help": "Sorted drafters: keep blocks 1..M frozen with everything the primary target's exits 1..M read "
            "(embeddings, LSA, final norm, head), and train blocks M+1..K and the other targets' parts: exits 1..M "
            "then draft for the primary target exactly as the --init-from drafter did (0: train everything).",
        },
    )
    target_lora_rank: int = field(
        default=0,
        metadata={
            "help": "Rank of the LoRA deltas on the shared blocks created for a target the drafter does not have yet "
            "(0: only its own LSA input projection)."
        },
    )
    # Inherited fields with other defaults.
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep every collated column (the MoA trainer uses them all)."}
    )
    label_names: list[str] | None = field(
        default_factory=lambda: ["labels"], metadata={"help": "The batch key of the counted-position labels."}
    )
    prediction_loss_only: bool = field(default=True, metadata={"help": "Evaluation returns the loss only."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer steps."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every trainable drafter parameter is used in each forward."}
    )
    profile_steps: int = field(
        default=0,
        metadata={
            "help": "Time this many optimizer steps (after 2 warm-up steps) part by part, count one step's FLOPs and "
            "write throughput.json (train tokens/s, ms per part, MFU against a measured bf16 matmul) to the output "
            "folder. 0: off."
        },
    )
    train_sampling_strategy: str = field(
        default="group_by_length",
        metadata={
            "choices": ["group_by_length", "random", "sequential", "batch_rebalance"],
            "help": "group_by_length: each batch holds examples of similar lengths (shuffled in groups of 16 "
            "batches, then sorted by length), so little padding is computed; the others are the Trainer's own "
            "(random: plain shuffling).",
        },
    )
    restore_callback_states_from_checkpoint: bool = field(
        default=True,
        metadata={
            "help": "Restore stateful callbacks on resume (`TrainingTally`: tokens per target and wall time so far)."
        },
    )
    include_num_input_tokens_seen: str = field(  # str (a bool still maps to "all" / "no"): HfArgumentParser-safe
        default="non_padding",
        metadata={
            "choices": ["all", "non_padding", "no"],
            "help": "Count the (non-padding) tokens trained on: logs tokens/s.",
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.depth_decay <= 1.0:
            raise ValueError(f"depth_decay must be in (0, 1], got {self.depth_decay}.")
        if self.hard_ce_weight < 0:
            raise ValueError(f"hard_ce_weight must be >= 0, got {self.hard_ce_weight}.")
        if not 1 <= self.min_cycle <= self.max_cycle:
            raise ValueError(
                f"Need 1 <= min_cycle <= max_cycle, got min_cycle={self.min_cycle}, max_cycle={self.max_cycle}."
            )
        if self.soft_ce_weight < 0 or self.feature_weight < 0 or self.soft_ce_weight + self.feature_weight == 0:
            raise ValueError("soft_ce_weight and feature_weight must be >= 0 and not both 0.")
        if self.vocab_chunk_size < 1:
            raise ValueError(f"vocab_chunk_size must be positive, got {self.vocab_chunk_size}.")
        self.exit_loss_weights = _parse_weights(self.exit_loss_weights)
        weights = self.exit_loss_weights
        if weights is not None and (not weights or min(weights) < 0 or sum(weights) <= 0):
            raise ValueError(f"exit_loss_weights must be >= 0 with a positive sum, got {weights}.")
        if self.target_lora_rank < 0:
            raise ValueError(f"target_lora_rank must be >= 0, got {self.target_lora_rank}.")

    def exit_weights(self, num_exits: int) -> list[float]:
        """The normalised loss weights of `num_exits` exits (summing to 1; uniform unless `exit_loss_weights`)."""
        weights = self.exit_loss_weights or [1.0] * num_exits
        if len(weights) != num_exits:
            raise ValueError(
                f"exit_loss_weights has {len(weights)} values but the drafter has {num_exits} exits; give one weight "
                "per block (--exit-loss-weights w1,...,wK)."
            )
        total = sum(weights)
        return [w / total for w in weights]


# ---------------------------------------------------------------------------------------------------------------------
# `moa data` / `moa train` options
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class TargetArguments:
    """The frozen target model."""

    _argument_group_name: ClassVar[str] = "target"

    target: str = field(
        metadata={"help": "`default` (SmolLM2-135M-Instruct, offline), a folder or a Hub id (see moa_hf.loading)."}
    )
    dtype: str = field(
        default="auto", metadata={"choices": _DTYPES, "help": "Target dtype (auto: bf16 on a GPU, fp32 on a CPU)."}
    )


@dataclass
class TrainTargetArguments(TargetArguments):
    """`moa train`: the frozen target model(s), by spec (`moa_hf.loading.load_target`)."""

    target: str = field(
        metadata={
            "action": _Repeated,
            "metavar": "[NAME=]SPEC",
            "help": "`default` (SmolLM2-135M-Instruct, offline), `default:VARIANT` (one of its fine-tunes), a folder "
            "or a Hub id. Several targets: repeat it with names, `--target main=default --target pydoc=default:pydoc`"
            " (a plain spec is target `main`, the drafter's primary one).",
        }
    )

    def specs(self) -> dict[str, str]:
        """{target name: spec}, in the order given."""
        specs = named_values(self.target.split(","), "--target", split=False)
        doubled = [name for name, values in specs.items() if len(values) > 1]
        if doubled:
            raise ValueError(f"--target names {', '.join(doubled)} more than once; give one spec per target name.")
        return {name: values[0] for name, values in specs.items()}


@dataclass
class DataArguments:
    """`moa data`: the target answers prompts; prompt + response token ids are saved as a `datasets` folder."""

    _argument_group_name: ClassVar[str] = "data"

    output: str = field(metadata={"help": "Dataset folder to write."})
    prompts: str = field(
        default="default",
        metadata={
            "help": "`default` (offline generator), `default:written` (material the target writes first; needs "
            "--num-prompts), `default:stdlib` (the standard library's source and module docs as answers for the "
            "target to label: --responses keep), a .jsonl/.txt file, a saved `datasets` folder or a dataset name; a "
            ".jsonl/.json file or folder of conversations (see --responses)."
        },
    )
    max_new_tokens: int = field(default=256, metadata={"help": "Most tokens of each response."})
    batch_size: int = field(default=16, metadata={"help": "Prompts answered together."})
    num_prompts: int | None = field(default=None, metadata={"help": "Use the first N prompts (default: all)."})
    prompt_column: str | None = field(default=None, metadata={"help": "Field/column holding the prompt."})
    prompt_split: str = field(default="train", metadata={"help": "Split of a dataset source."})
    do_sample: bool = field(default=False, metadata={"help": "Sample responses instead of greedy decoding."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (with --do-sample)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (with --do-sample)."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (with --do-sample)."})
    no_chat_template: bool = field(default=False, metadata={"help": "Feed raw prompt text (no chat template)."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message of the chat template."})
    responses: str | None = field(
        default=None,
        metadata={
            "choices": ["regenerate", "keep"],
            "help": "Conversations (ShareGPT `conversations`, OpenAI `messages` or prompt/response records; found "
            "by their fields): `regenerate` (the default for them, but `default:stdlib`) lets the target write every "
            "assistant turn anew, turn by turn; `keep` keeps the file's answers, which the target then labels "
            "through its next-token distribution (no generation: a prefill's cost). The loss covers assistant turns "
            "only.",
        },
    )
    engine: str = field(
        default="transformers",
        metadata={
            "choices": ["transformers", "vllm"],
            "help": "What writes the answers: transformers' generate, or a vLLM engine in a process of its own (the "
            "repository's .venv-vllm, `make vllm-setup`, or this Python's vLLM), at --batch-size sequences at once.",
        },
    )
    shard_size: int = field(
        default=512, metadata={"help": "Prompts (or conversations) per saved shard (resume granularity)."}
    )
    part: str | None = field(
        default=None,
        metadata={
            "metavar": "K/N",
            "help": "Answer only every N-th prompt (or conversation) starting at K (run N of these, e.g. one per "
            "GPU, then `moa train --data PART0 ... PARTN-1`).",
        },
    )
    max_shards: int | None = field(
        default=None,
        metadata={
            "metavar": "K",
            "help": "Answer only the first K shards of --shard-size prompts or conversations (a budget on a long "
            "list); run again with a larger K, or without, to answer the rest.",
        },
    )
    device: str | None = field(default=None, metadata={"help": "Device of the target (default: cuda if available)."})
    seed: int = field(default=0, metadata={"help": "Seed of the prompts' order and of sampling."})
    quiet: bool = field(default=False, metadata={"help": "No progress bars."})

    def part_indices(self) -> tuple[int, int] | None:
        """(K, N) of `part`, or None."""
        if self.part is None:
            return None
        try:
            k, n = (int(x) for x in self.part.split("/"))
        except ValueError as err:
            raise ValueError(f"--part must look like K/N (e.g. 0/4), got {self.part!r}") from err
        return k, n


@dataclass
class TrainDataArguments:
    """`moa train`: the training data, its cached target states and the held-out evaluation data."""

    _argument_group_name: ClassVar[str] = "training data"

    data: list[str] = field(
        metadata={
            "action": "extend",
            "metavar": "[NAME=]DIR",
            "help": "Dataset folder(s) written by `moa data`. Several targets: `--data main=DIR[,DIR2] --data "
            "pydoc=DIR` (each target's own data; a plain folder is target main's).",
        }
    )
    eval_data: str | None = field(
        default=None, metadata={"help": "Held-out dataset folder (the main target's) for the evaluation loss."}
    )
    states: list[str] | None = field(
        default=None,
        metadata={
            "action": "extend",
            "metavar": "[NAME=]DIR",
            "help": "Folder of the target's cached states (K/V and final hidden states, computed once on first use, "
            "memory-mapped): epochs then cost only the drafter; one folder per --data folder reuses each dataset's "
            "states. Several targets: `--states main=DIR --states pydoc=DIR` (per target: one folder, or one per "
            "--data folder of that target).",
        },
    )
    eval_prompts: list[str] | None = field(
        default=None,
        metadata={
            "action": "extend",
            "metavar": "[NAME=]SOURCE",
            "help": "Held-out prompts for the acceptance length (default `default:validation`; `none` disables); a "
            "plain source is used for every target, `NAME=SOURCE` for target NAME only.",
        },
    )

    def prompt_sources(self, targets: list[str]) -> dict[str, str]:
        """{target name: held-out prompt source} for the targets that get an acceptance measurement."""
        items = self.eval_prompts or ["default:validation"]
        if any(item in ("", "none") for item in items):
            return {}
        plain = [item for item in items if not _NAMED.match(item)]
        sources = {name: plain[-1] for name in targets} if plain else {}
        for name, values in named_values([item for item in items if _NAMED.match(item)], "--eval-prompts").items():
            if name not in targets:
                raise ValueError(f"--eval-prompts names target {name!r}, which is not among --target ({targets}).")
            sources[name] = ",".join(values)
        return sources


@dataclass
class DrafterArguments:
    """`moa train`: which drafter is trained, and how it starts."""

    _argument_group_name: ClassVar[str] = "drafter"

    kind: str = field(
        default="moa",
        metadata={
            "choices": KINDS,
            "help": "Drafter type: MoA (default), the EAGLE-style peer, or an independent small LM distilled from "
            "the target.",
        },
    )
    init_drafter: str | None = field(
        default=None,
        metadata={
            "aliases": ["--init-from"],
            "help": "Start from a saved drafter (a `moa train` --output, or `default`: the shipped one) instead of a "
            "fresh one.",
        },
    )
    num_blocks: int | None = field(
        default=None,
        metadata={
            "metavar": "K",
            "help": "MoA: K stacked blocks with an exit after each (a sorted drafter). With --init-drafter, a drafter "
            "with fewer blocks gets new ones that start as the identity (every exit first equals its last one).",
        },
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "metavar": "K",
            "help": "MoA: a block drafter, K tokens per drafter forward (the last verified token and K-1 learned "
            "placeholders; each simulated cycle's block is trained in parallel with the chain positions). With "
            "--init-drafter, a chain drafter gains the placeholders and keeps its weights.",
        },
    )
    block_markov_rank: int | None = field(
        default=None,
        metadata={
            "metavar": "R",
            "help": "MoA block drafters: a rank-R Markov head biasing each placeholder slot's logits by the token "
            "drafted before it (DSpark's; needs --block-size and a draft vocabulary).",
        },
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "MoA: predict only the N most frequent tokens of the target's responses in --data (a smaller, "
            "faster head; still lossless; 0: the full vocabulary)."
        },
    )
    lsa_hidden_size: int | None = field(
        default=None,
        metadata={
            "help": "MoA: width of the Layer Self-Attention (default 2 x KV heads x head dim; 0: that default); the "
            "LSA runs over every target layer of every token, so it dominates training cost."
        },
    )
    intermediate_size: int | None = field(
        default=None,
        metadata={
            "help": "MoA: MLP width of the SA and CA layers (default: the target's; the paper's Llama-3-8B drafter "
            "used 6144 against the target's 14336)."
        },
    )
    lsa_keys: str | None = field(
        default=None,
        metadata={
            "choices": ["rotated", "unrotated", "none"],
            "help": "MoA: how the LSA reads the target's keys: as cached after RoPE (rotated, the default), with RoPE "
            "undone (unrotated), or not at all (none: values only).",
        },
    )
    lsa_layers: str | None = field(
        default=None,
        metadata={
            "metavar": "I,J,...",
            "help": "MoA: the target layers the LSA reads, comma-separated; a negative index counts from the last "
            "layer (default: all).",
        },
    )
    lsa_pooling: str | None = field(
        default=None,
        metadata={
            "choices": ["mean", "last"],
            "help": "MoA: one vector per token from the LSA's outputs per layer: their mean (default) or the last.",
        },
    )
    context_final_hidden: bool = field(
        default=False,
        metadata={
            "help": "MoA: each verified token's context vector also reads the target's post-norm final hidden state "
            "(a linear projection added to the LSA's); default off (the paper: keys/values only)."
        },
    )
    ca_latest_context: bool = field(
        default=False,
        metadata={
            "help": "MoA: the CA's input also adds a projection of the newest context vector each position may read "
            "(the last verified token's), as an EAGLE drafter feeds the previous feature; every block reads it."
        },
    )
    init_from_target_layer: int | None = field(
        default=None,
        metadata={"metavar": "I", "help": "Start the drafter's decoder layers from the target's layer I (e.g. -1)."},
    )
    independent_layers: int = field(
        default=2, metadata={"help": "Independent LM: number of decoder layers (copied from the target's first ones)."}
    )
    target_layer_inference: int = field(
        default=0,
        metadata={
            "help": "N: the target's last N layers run in the drafter (TLI); --states then also caches the inputs of "
            "those layers."
        },
    )
    own_embeddings: bool = field(
        default=False,
        metadata={"help": "The drafter keeps (frozen) copies of the embedding and LM head, saved with it."},
    )
    lora_r: int = field(
        default=0,
        metadata={"help": "Train LoRA adapters of this rank instead of all weights (the merged drafter is saved)."},
    )

    def build_options(self, adapter: DrafterAdapter) -> dict:
        """The keyword arguments of `adapter.build` that these options set (unset ones left out)."""
        values = {keyword: getattr(self, name) for name, keyword in adapter.options.items()}
        return {keyword: value for keyword, value in values.items() if value is not None}

    def __post_init__(self):
        self.draft_vocab_size = self.draft_vocab_size or None  # 0: the full vocabulary
        self.lsa_hidden_size = self.lsa_hidden_size or None  # 0: the default width
        if isinstance(self.lsa_layers, str):
            try:
                self.lsa_layers = [int(i) for i in self.lsa_layers.split(",")]
            except ValueError:
                raise ValueError(f"--lsa-layers takes comma-separated indices, got {self.lsa_layers!r}.") from None
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"--num-blocks must be >= 1, got {self.num_blocks}.")


@dataclass
class TrainCommandArguments(MoATrainingArguments):
    """`MoATrainingArguments` as `moa train` takes them: short aliases of a few names (`--output`, `--lr`,
    `--batch-size`, `--grad-accum`, `--lr-scheduler`, `--cpu`, `--num-workers`, `--quiet`, `--resume`) and other
    defaults; `--max-steps` is required."""

    _argument_group_name: ClassVar[str] = "training (MoATrainingArguments)"

    output_dir: str = field(
        metadata={"aliases": ["--output"], "help": "Output folder: checkpoints and the final drafter."}
    )
    learning_rate: float = field(default=3e-4, metadata={"aliases": ["--lr"], "help": "Peak learning rate."})
    per_device_train_batch_size: int = field(
        default=8,
        metadata={"aliases": ["--batch-size"], "help": "Per-device batch size (also for caching the target states)."},
    )
    per_device_eval_batch_size: int | None = field(
        default=None, metadata={"help": "Per-device evaluation batch size (default: --batch-size)."}
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"aliases": ["--grad-accum"], "help": "Batches accumulated per optimizer step."}
    )
    lr_scheduler_type: SchedulerType | str = field(
        default="cosine", metadata={"aliases": ["--lr-scheduler"], "help": "Learning-rate schedule."}
    )
    max_grad_norm: float = field(default=0.5, metadata={"help": "Gradient clipping norm (0: none)."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept in --output."})
    eval_steps: float | None = field(
        default=500,
        metadata={
            "help": "Evaluate every N steps: the evaluation loss with --eval-data, else the acceptance length on "
            "--eval-prompts."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the drafter's initialisation and of training."})
    use_cpu: bool = field(
        default=False, metadata={"aliases": ["--cpu"], "help": "Train on CPU even if a GPU is available."}
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "bf16 mixed precision (fp32 master weights, bf16 autocast). Default: on where the hardware "
            "computes bf16 natively (a CUDA GPU that supports it; a CPU with avx512_bf16 or AMX, where it trains "
            "~1.6x faster than fp32, measured), else off."
        },
    )
    dataloader_num_workers: int = field(default=0, metadata={"aliases": ["--num-workers"], "help": "Data workers."})
    disable_tqdm: bool = field(default=False, metadata={"aliases": ["--quiet"], "help": "No progress bars."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "aliases": ["--resume"],
            "nargs": "?",
            "const": "latest",
            "help": "Resume from the latest checkpoint in --output (no value), or from the given checkpoint folder.",
        },
    )

    def __post_init__(self):
        if self.max_steps <= 0:
            raise ValueError(f"--max-steps N (N > 0) is required, got {self.max_steps}.")
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        if self.bf16 is None:
            self.bf16 = native_bf16(cpu=self.use_cpu or not torch.cuda.is_available()) and not self.fp16
        if self.bf16 and not torch.cuda.is_available():
            self.use_cpu = True  # transformers takes bf16 on a CPU only with use_cpu
        super().__post_init__()
