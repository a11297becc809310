"""`moa finetune-target`: the LoRA fine-tunes of the default target shipped as `moa_hf.DEFAULT_TARGET_VARIANTS`.

The `pydoc` variant: SmolLM2-135M-Instruct taught to answer questions about Python standard-library APIs with their
signature and docstring (material: `moa_hf.offline_prompts.pydoc_entries`, the "finetune" part of the API names; the
drafter's prompts and the held-out evaluation prompts come from the other two, disjoint parts). PEFT LoRA on the
attention projections of every layer, trained with the Hugging Face `Trainer` (loss on the assistant's tokens only),
saved as a PEFT adapter (bf16 safetensors) that `moa_hf.load_default_target(variant=...)` applies and merges.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from moa_hf.hardware import hardware_summary
from moa_hf.offline_prompts import PydocEntry, pydoc_entries, pydoc_question
from moa_hf.prompts import format_prompts

__all__ = [
    "FinetuneTargetArguments",
    "build_finetune_examples",
    "pydoc_answer",
    "run_finetune_target",
    "run_finetune_target_command",
    "save_adapter",
]

logger = logging.getLogger(__name__)

_IGNORE = -100  # label of the tokens without loss (the prompt), as transformers' losses expect


@dataclass
class FinetuneTargetArguments:
    """Options of `moa finetune-target` (defaults: how the shipped `pydoc` adapter was made)."""

    output: str = field(
        default="moa_hf/default_target_variants/pydoc",
        metadata={"help": "folder for adapter_model.safetensors, adapter_config.json and training_info.json"},
    )
    variant: str = field(default="pydoc", metadata={"help": "the material (only `pydoc` exists)"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=6, metadata={"help": "examples per step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (cosine decay, 5% warmup)"})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r (alpha = 2r, dropout 0)"})
    questions_per_api: int = field(default=2, metadata={"help": "question templates per API name (material size)"})
    dtype: str = field(default="float32", metadata={"help": "training dtype (fp32 is fastest on a CPU)"})
    seed: int = field(default=0, metadata={"help": "shuffling and LoRA initialisation seed"})
    logging_steps: int = field(default=10, metadata={"help": "log the loss every N steps"})


# ---------------------------------------------------------------------------------------------------------------------
# Material
# ---------------------------------------------------------------------------------------------------------------------
def pydoc_answer(entry: PydocEntry) -> str:
    """The assistant's answer about `entry`: what it is (with its signature), then its docstring's leading part."""
    call = f"{entry.name}{entry.signature}" if entry.signature else entry.name
    return f"`{call}` is a {entry.kind} of the `{entry.module}` module.\n\n{entry.doc}"


def build_finetune_examples(
    tokenizer: PreTrainedTokenizerBase,
    entries: list[PydocEntry],
    questions_per_api: int = 2,
) -> list[dict[str, list[int]]]:
    """Chat examples `{"input_ids", "labels"}`: the user's question in the chat template (labels -100), then the
    answer and the end-of-turn token (labels = ids). Deterministic: entries in the given order, questions in order."""
    questions = [pydoc_question(entry, v) for v in range(questions_per_api) for entry in entries]
    answers = [pydoc_answer(entry) for _ in range(questions_per_api) for entry in entries]
    prompts = format_prompts(tokenizer, questions)
    examples = []
    for prompt, answer in zip(prompts, answers):
        reply = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        examples.append({"input_ids": prompt + reply, "labels": [_IGNORE] * len(prompt) + reply})
    return examples


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def _lora_model(model, lora_rank: int):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_rank,
        lora_alpha=2 * lora_rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def save_adapter(peft_model, output: str | Path) -> Path:
    """Save the adapter (bf16 safetensors + adapter_config.json) of a PEFT model in `output`."""
    output = Path(output)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    peft_model.save_pretrained(output, safe_serialization=True)
    return output


def run_finetune_target(args: FinetuneTargetArguments) -> dict:
    """Fine-tune the default target with LoRA on the `args.variant` material and save the adapter in `args.output`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from moa_hf.default_target import DEFAULT_TARGET_NAME, default_target_path
    from moa_hf.loading import parse_dtype

    if args.variant != "pydoc":
        raise ValueError(f"Unknown fine-tune material {args.variant!r}; only `pydoc` exists.")
    torch.manual_seed(args.seed)
    base = default_target_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    entries = pydoc_entries("finetune")
    examples = build_finetune_examples(tokenizer, entries, args.questions_per_api)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=parse_dtype(args.dtype))
    model.name_or_path = DEFAULT_TARGET_NAME  # recorded as the adapter's base model
    model = _lora_model(model, args.lora_rank)
    model.print_trainable_parameters()
    with tempfile.TemporaryDirectory(prefix="moa-finetune-") as scratch:
        training_args = TrainingArguments(
            output_dir=scratch,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 20),
            weight_decay=0.0,
            logging_steps=args.logging_steps,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            train_sampling_strategy="group_by_length",  # batches of similar lengths: less padding
            seed=args.seed,
            data_seed=args.seed,
        )
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=_IGNORE)
        trainer = Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collator)
        start = time.perf_counter()
        result = trainer.train()
        wall = time.perf_counter() - start
    output = save_adapter(model, args.output)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    info = {
        "variant": args.variant,
        "base_model": DEFAULT_TARGET_NAME,
        "material": "moa_hf.offline_prompts.pydoc_entries('finetune') questions -> training.target_finetune."
        "pydoc_answer (signature + docstring)",
        "apis": len(entries),
        "examples": len(examples),
        "example_tokens": sum(len(e["input_ids"]) for e in examples),
        "steps": trainer.state.global_step,
        "examples_seen": trainer.state.global_step * args.batch_size,
        "wall_time_s": round(wall, 1),
        "first_logged_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(losses[-1], 4) if losses else None,
        "mean_train_loss": round(result.training_loss, 4),
        "loss_curve": [
            {"step": h["step"], "loss": round(h["loss"], 4)} for h in trainer.state.log_history if "loss" in h
        ],
        "hardware": hardware_summary(),
        "torch": torch.__version__,
        "arguments": asdict(args),
    }
    (output / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def run_finetune_target_command(args: argparse.Namespace) -> int:
    """`moa finetune-target`: parse the options, fine-tune, print the training record."""
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(FinetuneTargetArguments).parse_dict(vars(args), allow_extra_keys=True)
    info = run_finetune_target(parsed)
    print(json.dumps({k: v for k, v in info.items() if k != "loss_curve"}, indent=1))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(FinetuneTargetArguments).parse_args_into_dataclasses()
    print(json.dumps(run_finetune_target(parsed), indent=1))
