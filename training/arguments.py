"""Training arguments of the MoA drafter (a `transformers.TrainingArguments` with the drafter's own fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

__all__ = ["MoATrainingArguments"]


@dataclass
class MoATrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the MoA drafter's training settings (paper: Zimmer et al., 2025, section 4).

    The defaults of a few inherited fields differ: `remove_unused_columns=False` (the collator's columns are all
    used), `label_names=["labels"]`, `prediction_loss_only=True`, `logging_steps=10`,
    `include_num_input_tokens_seen="non_padding"` (logs `train_tokens_per_second`), `ddp_find_unused_parameters=False`.
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
    include_num_input_tokens_seen: str | bool = field(
        default="non_padding", metadata={"help": "Count the (non-padding) tokens trained on: logs tokens/s."}
    )

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.min_cycle <= self.max_cycle:
            raise ValueError(
                f"Need 1 <= min_cycle <= max_cycle, got min_cycle={self.min_cycle}, max_cycle={self.max_cycle}."
            )
        if self.soft_ce_weight < 0 or self.feature_weight < 0 or self.soft_ce_weight + self.feature_weight == 0:
            raise ValueError("soft_ce_weight and feature_weight must be >= 0 and not both 0.")
        if self.vocab_chunk_size < 1:
            raise ValueError(f"vocab_chunk_size must be positive, got {self.vocab_chunk_size}.")
