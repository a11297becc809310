"""`moa data` (on-policy training data from the target) and `moa train` (drafter training) subcommands.

Their options are the fields of dataclasses, parsed by `transformers.HfArgumentParser` (each option spelled with
underscores or hyphens): `moa data` takes `TargetArguments` and `DataArguments`; `moa train` takes
`TargetArguments`, `TrainDataArguments`, `DrafterArguments` and every `MoATrainingArguments` field
(`TrainCommandArguments`: with a few short aliases and other defaults). See training/arguments.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch
from transformers import HfArgumentParser

from moa_hf.loading import load_drafter, load_target, parse_dtype

from .arguments import DataArguments, DrafterArguments, TargetArguments, TrainCommandArguments, TrainDataArguments
from .drafters import adapter_for, adapter_named

__all__ = [
    "DATA_ARGUMENTS",
    "TRAIN_ARGUMENTS",
    "data_arguments",
    "main",
    "register",
    "run_data",
    "run_train",
    "train_arguments",
]

logger = logging.getLogger(__name__)

DATA_ARGUMENTS = (TargetArguments, DataArguments)
TRAIN_ARGUMENTS = (TargetArguments, TrainDataArguments, DrafterArguments, TrainCommandArguments)


def data_arguments(args: argparse.Namespace) -> tuple[TargetArguments, DataArguments]:
    """The dataclasses of `moa data` from its parsed options."""
    return HfArgumentParser(DATA_ARGUMENTS).parse_dict(vars(args), allow_extra_keys=True)


def train_arguments(
    args: argparse.Namespace,
) -> tuple[TargetArguments, TrainDataArguments, DrafterArguments, TrainCommandArguments]:
    """The dataclasses of `moa train` from its parsed options. `--eval-steps` is the period of the evaluation loss
    with `--eval-data`, else of the acceptance length on the held-out prompts (`eval_acceptance_steps`)."""
    values = dict(vars(args))
    prompts = values["eval_prompts"] not in ("", "none") and values["eval_num_prompts"] > 0
    if values["eval_data"] is not None:
        values["eval_strategy"] = "steps"
    else:
        if values["eval_acceptance_steps"] is None and prompts:
            values["eval_acceptance_steps"] = values["eval_steps"]
        values["eval_steps"] = None
    return HfArgumentParser(TRAIN_ARGUMENTS).parse_dict(values, allow_extra_keys=True)


# ---------------------------------------------------------------------------------------------------------------------
# moa data
# ---------------------------------------------------------------------------------------------------------------------
def run_data(args: argparse.Namespace) -> int:
    from .data import build_dataset

    target_args, data_args = data_arguments(args)
    try:
        part = data_args.part_indices()
    except ValueError as err:
        raise SystemExit(str(err)) from err
    torch.manual_seed(data_args.seed)
    target, tokenizer = load_target(target_args.target, dtype=target_args.dtype, device=data_args.device)
    dataset = build_dataset(
        target,
        tokenizer,
        data_args.prompts,
        data_args.output,
        max_new_tokens=data_args.max_new_tokens,
        batch_size=data_args.batch_size,
        num_prompts=data_args.num_prompts,
        prompt_column=data_args.prompt_column,
        prompt_split=data_args.prompt_split,
        do_sample=data_args.do_sample,
        temperature=data_args.temperature,
        top_p=data_args.top_p,
        top_k=data_args.top_k,
        chat_template=not data_args.no_chat_template,
        system_prompt=data_args.system_prompt,
        shard_size=data_args.shard_size,
        part=part,
        seed=data_args.seed,
        progress=not data_args.quiet,
    )
    tokens = sum(len(x) for x in dataset["input_ids"])
    print(f"saved {len(dataset)} examples ({tokens} tokens) to {data_args.output}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# moa train
# ---------------------------------------------------------------------------------------------------------------------
def _target_dtype(target_args: TargetArguments, training: TrainCommandArguments) -> torch.dtype:
    """auto: bfloat16 when training on a GPU, else float32."""
    on_gpu = torch.cuda.is_available() and not training.use_cpu
    return parse_dtype(target_args.dtype) or (torch.bfloat16 if on_gpu else torch.float32)


def _build_drafter(drafter_args: DrafterArguments, target, train_data, seed: int) -> torch.nn.Module:
    """The drafter to train, in fp32 master weights (use --bf16 for mixed precision): the --init-drafter, or a fresh
    one of --kind."""
    if drafter_args.init_drafter:
        return load_drafter(drafter_args.init_drafter, target=target, dtype=torch.float32)
    torch.manual_seed(seed)
    adapter = adapter_named(drafter_args.kind)
    drafter = adapter.build(target, data=train_data, **drafter_args.build_options(adapter))
    return drafter.to(dtype=torch.float32)


def _with_cached_states(train_data, parts: list, target, drafter, data_args, training):
    """`train_data` paired with the target's cached states (`--states`), computed where missing."""
    from torch.utils.data import ConcatDataset

    from .states import TargetStatesDataset, cache_target_states

    if len(data_args.states) not in (1, len(parts)):
        raise SystemExit(
            f"--states takes one folder (for all --data together) or one per --data folder; got "
            f"{len(data_args.states)} for {len(parts)} datasets."
        )
    pairs = [(train_data, data_args.states[0])] if len(data_args.states) == 1 else list(zip(parts, data_args.states))
    tli = adapter_for(drafter).target_layer_inference(drafter)
    cached = [
        TargetStatesDataset(
            data,
            cache_target_states(
                target,
                data,
                folder,
                batch_size=training.per_device_train_batch_size,
                max_length=training.max_length,
                progress=not training.disable_tqdm,
                tli_layers=tli,
            ),
            target,
        )
        for data, folder in pairs
    ]
    return cached[0] if len(cached) == 1 else ConcatDataset(cached)


def run_train(args: argparse.Namespace) -> int:
    import datasets

    from .data import load_prompts
    from .peft_utils import apply_lora, merge_lora
    from .trainer import MoATrainer

    try:
        target_args, data_args, drafter_args, training = train_arguments(args)
    except ValueError as err:  # an invalid combination of options: a message, not a traceback
        raise SystemExit(f"moa train: error: {err}") from err
    # Loaded on the CPU in its final dtype; MoATrainer moves it to the training device of this process.
    target, tokenizer = load_target(target_args.target, dtype=_target_dtype(target_args, training), device="cpu")
    parts = [datasets.load_from_disk(path) for path in data_args.data]
    train_data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    eval_data = datasets.load_from_disk(data_args.eval_data) if data_args.eval_data else None
    eval_prompts = None
    if data_args.eval_prompts not in ("", "none") and training.eval_num_prompts > 0:
        eval_prompts = load_prompts(data_args.eval_prompts, split="validation", num_prompts=training.eval_num_prompts)
    drafter = _build_drafter(drafter_args, target, train_data, training.seed)
    if data_args.states:
        train_data = _with_cached_states(train_data, parts, target, drafter, data_args, training)
    model = apply_lora(drafter, r=drafter_args.lora_r) if drafter_args.lora_r else drafter
    trainer = MoATrainer(
        model=model,
        target=target,
        args=training,
        train_dataset=train_data,
        eval_dataset=eval_data,
        eval_prompts=eval_prompts,
        processing_class=tokenizer,
    )
    resume = training.resume_from_checkpoint
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    wall = time.perf_counter() - t0
    final = trainer.evaluate() if eval_prompts or eval_data is not None else {}
    if trainer.is_world_process_zero():
        out = Path(training.output_dir)
        drafter = merge_lora(trainer.model) if drafter_args.lora_r else trainer.drafter
        if drafter_args.lora_r:
            trainer.model.save_pretrained(out / "adapter")
        drafter.save_pretrained(out)  # the drafter only (safetensors): never the target's weights
        drafter.generation_config.save_pretrained(out)
        tokens = int(trainer.state.num_input_tokens_seen or 0)
        info = {
            "kind": adapter_for(drafter).name,
            "data": f"on-policy responses of {getattr(target.config, 'name_or_path', target_args.target)} "
            f"({len(train_data)} examples, {', '.join(data_args.data)})",
            "cached_target_states": bool(data_args.states),
            "tokens": tokens or None,
            "steps": trainer.state.global_step,
            "wall_time_s": round(wall, 1),
            "hardware": _hardware(),
            "final_train_loss": round(float(result.training_loss), 5),
            "acceptance_length_heldout": final.get("eval_acceptance_length"),
            "top1_heldout": final.get("eval_top1"),  # with --eval-data: top-1 agreement with the target
            "top1_first_heldout": final.get("eval_top1_first"),
            "learning_curve": _learning_curve(trainer, info_from=drafter_args.init_drafter),
        }
        info.update(_totals(info, info_from=drafter_args.init_drafter))
        (out / "training_info.json").write_text(json.dumps(info, indent=1))
        print(json.dumps({"output": str(out), **info}, indent=1))
    return 0


def _hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _totals(info: dict, info_from: str | None) -> dict:
    """`previous_runs` (the `--init-drafter`'s own record and its earlier runs) and totals over all runs."""
    prev_file = Path(info_from) / "training_info.json" if info_from else None
    if prev_file is None or not prev_file.exists():
        return {}
    prev = json.loads(prev_file.read_text())
    own = {k: v for k, v in prev.items() if k not in ("learning_curve", "previous_runs") and not k.startswith("total")}
    runs = [*prev.get("previous_runs", []), own]
    everything = [*runs, info]
    return {
        "previous_runs": runs,
        "total_tokens": sum(int(r.get("tokens") or 0) for r in everything),
        "total_steps": sum(int(r.get("steps") or 0) for r in everything),
        "total_wall_time_s": round(sum(float(r.get("wall_time_s") or 0.0) for r in everything), 1),
    }


def _learning_curve(trainer, info_from: str | None) -> list[dict]:
    """Held-out acceptance length vs training tokens and wall time, continuing the curve of `--init-drafter`."""
    from .evaluation import AcceptanceEvalCallback

    start = []
    if info_from and (Path(info_from) / "training_info.json").exists():
        start = json.loads((Path(info_from) / "training_info.json").read_text()).get("learning_curve") or []
    tokens0 = start[-1]["tokens"] if start else 0
    wall0 = start[-1]["wall_time_s"] if start else 0.0
    step0 = start[-1]["step"] if start else 0
    points = list(start)
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, AcceptanceEvalCallback):
            for h in cb.history:
                points.append(
                    {
                        "step": step0 + h["step"],
                        "tokens": tokens0 + h["tokens"],
                        "wall_time_s": round(wall0 + (h["wall_time_s"] or 0.0), 1),
                        "acceptance_length": round(h["eval_acceptance_length"], 4),
                    }
                )
    return list({p["step"]: p for p in points}.values())  # one point per step (the last measurement)


def _add_command(subparsers, name: str, types: tuple[type, ...], func, **kwargs) -> argparse.ArgumentParser:
    """A subcommand whose options are the fields of the dataclasses `types` (`HfArgumentParser`)."""
    fields = HfArgumentParser(types, add_help=False)
    parser = subparsers.add_parser(
        name, parents=[fields], formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs
    )
    parser.set_defaults(func=func)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `moa data` and `moa train`."""
    _add_command(
        subparsers,
        "data",
        DATA_ARGUMENTS,
        run_data,
        help="generate on-policy training data: the target answers prompts",
        description="Let the target answer prompts (greedy by default) and save prompt+response token ids as a "
        "`datasets` folder. Resumable: run the same command again after an interruption. Spec-Bench is refused.",
    )
    _add_command(
        subparsers,
        "train",
        TRAIN_ARGUMENTS,
        run_train,
        help="train a drafter on data from `moa data`",
        description="Train a drafter (MoA, EAGLE-style or an independent LM) against a frozen target (Hugging Face "
        "Trainer; checkpoints in --output, resume with --resume). Launch with `accelerate launch -m "
        "moa_hf.training.cli train ...` for several GPUs/processes. The final drafter (safetensors + "
        "generation_config.json) is saved in --output. Every MoATrainingArguments / TrainingArguments field is an "
        "option.",
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m moa_hf.training.cli {data,train} ...` (what `accelerate launch -m` runs)."""
    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
