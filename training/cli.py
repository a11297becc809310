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
from pathlib import Path

import torch
from transformers import HfArgumentParser

from moa_hf import MoADrafterModel, target_fingerprint
from moa_hf.hardware import hardware_summary, keep_freed_memory
from moa_hf.loading import folder_kind, load_drafter, load_target, parse_dtype, target_folder
from moa_hf.modeling import PRIMARY_TARGET

from .arguments import (
    DataArguments,
    DrafterArguments,
    TargetArguments,
    TrainCommandArguments,
    TrainDataArguments,
    TrainTargetArguments,
    named_values,
)
from .drafters import adapter_for, adapter_named
from .replay_cli import ReplayArguments, run_replay
from .target_finetune import FinetuneTargetArguments, run_finetune_target_command

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
TRAIN_ARGUMENTS = (TrainTargetArguments, TrainDataArguments, DrafterArguments, TrainCommandArguments)


def data_arguments(args: argparse.Namespace) -> tuple[TargetArguments, DataArguments]:
    """The dataclasses of `moa data` from its parsed options."""
    return HfArgumentParser(DATA_ARGUMENTS).parse_dict(vars(args), allow_extra_keys=True)


def train_arguments(
    args: argparse.Namespace,
) -> tuple[TrainTargetArguments, TrainDataArguments, DrafterArguments, TrainCommandArguments]:
    """The dataclasses of `moa train` from its parsed options. `--eval-steps` is the period of the evaluation loss
    with `--eval-data`, else of the acceptance length on the held-out prompts (`eval_acceptance_steps`)."""
    values = dict(vars(args))
    sources = values["eval_prompts"] or ["default:validation"]
    prompts = not any(s in ("", "none") for s in sources) and values["eval_num_prompts"] > 0
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
    from moa_hf.conversations import default_responses, is_conversation_source

    from .data import build_chat_dataset, build_dataset, skip_reasons

    keep_freed_memory()  # CPU steps reuse their freed activations instead of faulting fresh pages in

    target_args, data_args = data_arguments(args)
    try:
        part = data_args.part_indices()
    except ValueError as err:
        raise SystemExit(str(err)) from err
    torch.manual_seed(data_args.seed)
    target, tokenizer = load_target(target_args.target, dtype=target_args.dtype, device=data_args.device)
    if data_args.responses is not None or is_conversation_source(data_args.prompts):
        dataset = build_chat_dataset(
            target,
            tokenizer,
            data_args.prompts,
            data_args.output,
            responses=data_args.responses or default_responses(data_args.prompts),
            max_new_tokens=data_args.max_new_tokens,
            batch_size=data_args.batch_size,
            num_conversations=data_args.num_prompts,
            split=data_args.prompt_split,
            do_sample=data_args.do_sample,
            temperature=data_args.temperature,
            top_p=data_args.top_p,
            top_k=data_args.top_k,
            shard_size=data_args.shard_size,
            part=part,
            max_shards=data_args.max_shards,
            seed=data_args.seed,
            progress=not data_args.quiet,
            engine=data_args.engine,
            engine_model=target_folder(target_args.target),
        )
        tokens = sum(sum(m) for m in dataset["response_mask"])
        print(f"saved {len(dataset)} conversations ({tokens} assistant tokens) to {data_args.output}")
        skipped = json.loads((Path(data_args.output) / "moa_data.json").read_text())["skipped"]
        if skipped:  # the run went on without them
            print(f"skipped {len(skipped)} conversations (listed in moa_data.json): {skip_reasons(skipped)}")
        return 0
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
        max_shards=data_args.max_shards,
        seed=data_args.seed,
        progress=not data_args.quiet,
        engine=data_args.engine,
        engine_model=target_folder(target_args.target),
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


def _init_folder(spec: str | None) -> Path | None:
    """The folder of `--init-drafter` (`default`: the shipped drafter)."""
    if spec is None:
        return None
    if spec == "default":
        from moa_hf import default_drafter_path

        return Path(default_drafter_path())
    return Path(spec).expanduser()


def _build_drafter(drafter_args: DrafterArguments, target, train_data, seed: int) -> torch.nn.Module:
    """The drafter to train, in fp32 master weights (use --bf16 for mixed precision): the --init-drafter (with
    --num-blocks K: as a MoA drafter of K blocks, the blocks it lacks starting as the identity), or a fresh one of
    --kind."""
    reshape = ("num_blocks", "block_size", "block_markov_rank")
    reshaped = {k: v for k in reshape if (v := getattr(drafter_args, k)) is not None}
    if drafter_args.init_drafter and reshaped:
        folder = _init_folder(drafter_args.init_drafter)
        kind = folder_kind(folder) if (folder / "config.json").is_file() else None
        if kind != "moa":
            flags = " / ".join("--" + k.replace("_", "-") for k in reshaped)
            raise SystemExit(f"{flags} with --init-drafter needs a saved MoA drafter; {folder} is not one.")
        drafter = MoADrafterModel.from_pretrained(str(folder), **reshaped, local_files_only=True)
        return drafter.to(device=target.device, dtype=torch.float32)
    if drafter_args.init_drafter:
        return load_drafter(drafter_args.init_drafter, target=target, dtype=torch.float32)
    torch.manual_seed(seed)
    adapter = adapter_named(drafter_args.kind)
    if drafter_args.num_blocks is not None and "num_blocks" not in adapter.options.values():
        raise SystemExit(f"moa train: error: --num-blocks builds a MoA drafter, not --kind {drafter_args.kind}.")
    drafter = adapter.build(target, data=train_data, **drafter_args.build_options(adapter))
    return drafter.to(dtype=torch.float32)


def _retarget(drafter, target) -> None:
    """A started drafter whose every weight is now trained for another primary target (a dedicated drafter for a
    fine-tune, started from the base model's): it records that target's fingerprint, which `attach` then accepts."""
    fingerprint = target_fingerprint(target)
    recorded = getattr(drafter.config, "target_fingerprint", None)
    if fingerprint is None or recorded in (None, fingerprint):
        return
    logger.warning("The drafter was trained for other target weights; it now records this target's fingerprint.")
    drafter.config.target_fingerprint = fingerprint
    drafter.config.target_name_or_path = getattr(target.config, "name_or_path", None) or None


def _with_cached_states(name: str, train_data, parts: list, folders: list[str], target, drafter, training):
    """Target `name`'s `train_data` (the concatenation of `parts`) paired with its cached states (`--states`),
    computed where missing."""
    from torch.utils.data import ConcatDataset

    from .states import TargetStatesDataset, cache_target_states

    if len(folders) not in (1, len(parts)):
        raise SystemExit(
            f"--states takes one folder (for all --data together) or one per --data folder; got {len(folders)} for "
            f"{len(parts)} datasets of target {name!r}."
        )
    pairs = [(train_data, folders[0])] if len(folders) == 1 else list(zip(parts, folders))
    tli = adapter_for(drafter).target_layer_inference(drafter)
    cached = []
    for data, folder in pairs:
        # under DDP the main process computes and writes the states while the others wait; they then find the
        # folder complete and read it (`cache_target_states` reuses a finished folder)
        with training.main_process_first(local=False, desc=f"target states in {folder}"):
            states = cache_target_states(
                target,
                data,
                folder,
                batch_size=training.per_device_train_batch_size,
                max_length=training.max_length,
                progress=not training.disable_tqdm,
                tli_layers=tli,
            )
        cached.append(TargetStatesDataset(data, states, target))
    return cached[0] if len(cached) == 1 else ConcatDataset(cached)


def _named_inputs(target_args: TrainTargetArguments, data_args: TrainDataArguments):
    """({target: spec}, {target: data folders}, {target: states folders}) from the tagged options, checked."""
    specs = target_args.specs()
    data = named_values(data_args.data, "--data")
    states = named_values(data_args.states, "--states")
    for option, named in (("--data", data), ("--states", states)):
        unknown = sorted(set(named) - set(specs))
        if unknown:
            raise ValueError(
                f"{option} names target(s) {unknown} that no --target names; add --target NAME=SPEC for each "
                f"(targets: {list(specs)})."
            )
    idle = [name for name in specs if name not in data]
    if idle:
        raise ValueError(f"Target(s) {idle} have no --data; give each target its data (--data NAME=DIR).")
    return specs, data, states


def _load_eval_prompts(sources: dict[str, str], num_prompts: int) -> dict[str, list[str]]:
    """{target: held-out prompts} from {target: prompt source} (each source loaded once)."""
    from .data import load_prompts

    loaded: dict[str, list[str]] = {}
    for source in dict.fromkeys(sources.values()):
        loaded[source] = load_prompts(source, split="validation", num_prompts=num_prompts)
    return {name: loaded[source] for name, source in sources.items()}


def run_train(args: argparse.Namespace) -> int:
    import datasets

    from .data import with_response_masks
    from .peft_utils import apply_lora, merge_lora
    from .trainer import MoATrainer

    keep_freed_memory()  # CPU steps reuse their freed activations instead of faulting fresh pages in

    try:
        target_args, data_args, drafter_args, training = train_arguments(args)
        specs, data_dirs, states_dirs = _named_inputs(target_args, data_args)
        prompt_sources = data_args.prompt_sources(list(specs)) if training.eval_num_prompts > 0 else {}
    except ValueError as err:  # an invalid combination of options: a message, not a traceback
        raise SystemExit(f"moa train: error: {err}") from err
    if drafter_args.lora_r and (len(specs) > 1 or training.train_target_parts):
        raise SystemExit("moa train: error: --lora-r trains one target's whole drafter; drop it to train targets.")
    # Loaded on the CPU in their final dtype; MoATrainer moves them to the training device of this process.
    targets, tokenizer = {}, None
    for name, spec in specs.items():
        targets[name], tok = load_target(spec, dtype=_target_dtype(target_args, training), device="cpu")
        tokenizer = tokenizer or tok
    primary = PRIMARY_TARGET if PRIMARY_TARGET in targets else next(iter(targets))
    if drafter_args.init_drafter is None and primary != PRIMARY_TARGET:
        raise SystemExit(
            f"moa train: error: a new drafter is built for its primary target `{PRIMARY_TARGET}`; name one target "
            f"{PRIMARY_TARGET} (--target {PRIMARY_TARGET}=SPEC) or start from a trained drafter (--init-drafter)."
        )
    parts = {name: with_response_masks([datasets.load_from_disk(p) for p in dirs]) for name, dirs in data_dirs.items()}
    train_data = {name: p[0] if len(p) == 1 else datasets.concatenate_datasets(p) for name, p in parts.items()}
    eval_data = datasets.load_from_disk(data_args.eval_data) if data_args.eval_data else None
    eval_prompts = _load_eval_prompts(prompt_sources, training.eval_num_prompts) or None
    drafter = _build_drafter(drafter_args, targets[primary], train_data.get(primary), training.seed)
    if drafter_args.init_drafter and PRIMARY_TARGET in targets and not training.train_target_parts:
        _retarget(drafter, targets[PRIMARY_TARGET])
    examples = {name: len(data) for name, data in train_data.items()}
    for name, folders in states_dirs.items():
        train_data[name] = _with_cached_states(
            name, train_data[name], parts[name], folders, targets[name], drafter, training
        )
    model = apply_lora(drafter, r=drafter_args.lora_r) if drafter_args.lora_r else drafter
    trainer = MoATrainer(
        model=model,
        target=targets,
        args=training,
        train_dataset=train_data,
        eval_dataset=eval_data,
        eval_prompts=eval_prompts,
        processing_class=tokenizer,
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    resume = training.resume_from_checkpoint
    result = trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    wall = trainer.tally.elapsed()  # a resumed run: with the segments up to its checkpoint
    measuring = _acceptance_time(trainer)  # part of `wall`: the periodic acceptance measurements
    final = trainer.evaluate() if eval_prompts or eval_data is not None else {}
    tokens_per_target = trainer.target_token_counts()
    if trainer.is_world_process_zero():
        out = Path(training.output_dir)
        drafter = merge_lora(trainer.model) if drafter_args.lora_r else trainer.drafter
        if drafter_args.lora_r:
            trainer.model.save_pretrained(out / "adapter")
        drafter.save_pretrained(out)  # the drafter only (safetensors): never the target's weights
        drafter.generation_config.save_pretrained(out)
        tokens = int(trainer.state.num_input_tokens_seen or 0)
        info_from = _init_folder(drafter_args.init_drafter)
        cached = {name: name in states_dirs for name in data_dirs}
        info = {
            "kind": adapter_for(drafter).name,
            "data": "; ".join(
                f"on-policy responses of {getattr(targets[name].config, 'name_or_path', specs[name])} "
                f"({examples[name]} examples, {', '.join(dirs)})"
                + (f" for target {name} ({specs[name]})" if len(specs) > 1 or name != PRIMARY_TARGET else "")
                for name, dirs in data_dirs.items()
            ),
            # per target where some ran online (no --states) and others read cached states
            "cached_target_states": cached if len(set(cached.values())) > 1 else bool(states_dirs),
            "tokens": tokens or None,
            "steps": trainer.state.global_step,
            "wall_time_s": round(wall, 1),
            "acceptance_eval_time_s": round(measuring, 1),  # included in wall_time_s
            "hardware": hardware_summary(),
            "final_train_loss": round(float(result.training_loss), 5),
            "acceptance_length_heldout": final.get("eval_acceptance_length"),
            "top1_heldout": final.get("eval_top1"),  # with --eval-data: top-1 agreement with the target
            "top1_first_heldout": final.get("eval_top1_first"),
            # with --eval-context-ablation: the same with the drafter's context vectors zeroed
            "acceptance_length_heldout_no_context": final.get("eval_acceptance_length_no_context"),
            "top1_heldout_no_context": final.get("eval_top1_no_context"),
            **_sorted_info(trainer, specs, final, trainable, drafter_args, tokens_per_target),
            "learning_curve": _learning_curve(trainer, info_from=info_from),
        }
        info.update(_totals(info, info_from=info_from))
        (out / "training_info.json").write_text(json.dumps(info, indent=1))
        print(json.dumps({"output": str(out), **info}, indent=1))
    return 0


def _sorted_info(
    trainer, specs: dict[str, str], final: dict, trainable: int, drafter_args, tokens_per_target: dict[str, int]
) -> dict:
    """What training_info.json records of the drafter's depth and targets: blocks, exit loss weights, the targets
    (name -> spec) and their tokens (`MoATrainer.target_token_counts`), what was trained, and the held-out
    acceptance per target and exit."""
    args = trainer.args
    names = list(specs)
    named = len(names) > 1 or names != [PRIMARY_TARGET]
    acceptance = {}
    for name in names:
        prefix = f"eval_{name}_" if named else "eval_"
        found = {
            key.removeprefix(f"{prefix}acceptance_length_") if key != f"{prefix}acceptance_length" else "default": v
            for key, v in final.items()
            if key.startswith(f"{prefix}acceptance_length")
        }
        if found:
            acceptance[name] = found
    return {
        "num_blocks": len(trainer.exit_weights),
        "exit_loss_weights": args.exit_loss_weights,
        "targets": specs,
        "tokens_per_target": tokens_per_target,
        "trained": (
            f"the parts of target {args.train_target_parts}"
            if args.train_target_parts
            else f"blocks {args.freeze_blocks + 1}.. and the other targets' parts"
            if args.freeze_blocks
            else "all weights"
        ),
        "trainable_parameters": trainable,
        "init_drafter": drafter_args.init_drafter,
        "acceptance_heldout_by_target": acceptance or None,
    }


def _acceptance_time(trainer) -> float:
    """Seconds the acceptance-length callback has spent measuring so far."""
    from .evaluation import AcceptanceEvalCallback

    callbacks = trainer.callback_handler.callbacks
    return sum(cb.measure_time_s for cb in callbacks if isinstance(cb, AcceptanceEvalCallback))


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
    """Held-out acceptance length vs training tokens and wall time, continuing the curve of `--init-drafter`: the
    primary target's where it was measured (a run that adds targets keeps one comparable curve), else the pooled."""
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
                        "acceptance_length": round(
                            h.get(f"eval_{PRIMARY_TARGET}_acceptance_length", h["eval_acceptance_length"]), 4
                        ),
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
    """Add `moa data`, `moa train`, `moa replay` and `moa finetune-target`."""
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
    _add_command(
        subparsers,
        "replay",
        (ReplayArguments,),
        run_replay,
        help="tokens per target call of greedy chain decoding, replayed on held-out answers (no decoding)",
        description="Replay greedy speculative decoding with the drafter's chains (network alone, the "
        "`assistant_model` path) on the target's greedy answers in a `moa data` folder, from teacher-forced drafter "
        "passes: tokens per target call for several chain rules (max tokens, confidence threshold) with bootstrap "
        "intervals over prompts; --check N also runs real decoding on N prompts and compares.",
    )
    _add_command(
        subparsers,
        "finetune-target",
        (FinetuneTargetArguments,),
        run_finetune_target_command,
        help="rebuild a shipped fine-tune of the default target (`default:pydoc`): PEFT LoRA on its material",
        description="LoRA-tune SmolLM2-135M-Instruct (the `default` target) on the material of a variant of "
        "`moa_hf.DEFAULT_TARGET_VARIANTS` with the Hugging Face Trainer and save the PEFT adapter (bf16 "
        "safetensors) and training_info.json in --output; `default:NAME` targets load it merged. The defaults are "
        "how the shipped adapter was made.",
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m moa_hf.training.cli {data,train} ...` (what `accelerate launch -m` runs)."""
    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
