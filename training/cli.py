"""`moa data` (on-policy training data from the target) and `moa train` (drafter training) subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

__all__ = ["load_target", "main", "register", "run_data", "run_train", "run_tune"]

logger = logging.getLogger(__name__)

_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(spec: str, dtype: str = "auto", device: str | None = None):
    """(target, tokenizer) from ``default`` (`moa_hf.load_default_target`), a local folder or a Hub id.

    dtype ``auto``: bfloat16 on GPU, float32 on CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.")
    device = device or _default_device()
    torch_dtype = _DTYPES[dtype] or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if spec == "default":
        from moa_hf import load_default_target

        target, tokenizer = load_default_target(dtype=torch_dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(spec)
    return target.to(device).eval(), tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# moa data
# ---------------------------------------------------------------------------------------------------------------------
def _parse_part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError as err:
        raise SystemExit(f"--part must look like K/N (e.g. 0/4), got {text!r}") from err
    return k, n


def run_data(args: argparse.Namespace) -> int:
    from .data import build_dataset

    torch.manual_seed(args.seed)
    target, tokenizer = load_target(args.target, args.dtype, args.device)
    dataset = build_dataset(
        target,
        tokenizer,
        args.prompts,
        args.output,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        num_prompts=args.num_prompts,
        prompt_column=args.prompt_column,
        prompt_split=args.prompt_split,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        chat_template=not args.no_chat_template,
        system_prompt=args.system_prompt,
        shard_size=args.shard_size,
        part=_parse_part(args.part),
        seed=args.seed,
        progress=not args.quiet,
    )
    tokens = sum(len(x) for x in dataset["input_ids"])
    print(f"saved {len(dataset)} examples ({tokens} tokens) to {args.output}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# moa train
# ---------------------------------------------------------------------------------------------------------------------
def _build_drafter(args: argparse.Namespace, target, train_data):
    from .builders import build_for_kind, frequent_tokens, init_from_target_layer

    if args.init_drafter:
        from transformers import AutoModel, AutoModelForCausalLM

        import moa_hf  # noqa: F401  (registers the drafter classes with the Auto* factories)

        auto = AutoModelForCausalLM if args.kind == "independent" else AutoModel
        return auto.from_pretrained(args.init_drafter).to(device=target.device, dtype=torch.float32)
    torch.manual_seed(args.seed)
    overrides = {}
    if args.kind == "moa":
        overrides = dict(own_embeddings=args.own_embeddings, target_layer_inference=args.target_layer_inference)
        if args.draft_vocab_size:
            overrides["draft_vocab_size"] = args.draft_vocab_size
        if args.lsa_hidden_size:
            overrides["lsa_hidden_size"] = args.lsa_hidden_size
    elif args.kind == "independent":
        overrides = dict(num_layers=args.independent_layers)
    drafter = build_for_kind(args.kind, target, **overrides)
    if args.kind == "moa" and args.draft_vocab_size:
        ids = frequent_tokens(train_data, args.draft_vocab_size, target.config.get_text_config().vocab_size)
        drafter.init_draft_vocab(ids, target.get_output_embeddings().weight)
    if args.init_from_target_layer is not None and args.kind != "independent":
        init_from_target_layer(drafter, target, args.init_from_target_layer)
    return drafter.to(dtype=torch.float32)  # master weights in fp32 (use --bf16 for mixed precision)


def _hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_train(args: argparse.Namespace) -> int:
    import datasets

    from .arguments import MoATrainingArguments
    from .data import load_prompts
    from .peft_utils import apply_lora, merge_lora
    from .trainer import MoATrainer

    # Loaded on the CPU in its final dtype; MoATrainer moves it to the training device of this process.
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.cuda.is_available() and not args.cpu else "float32"
    target, tokenizer = load_target(args.target, dtype, "cpu")
    parts = [datasets.load_from_disk(path) for path in args.data]
    train_data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    eval_data = datasets.load_from_disk(args.eval_data) if args.eval_data else None
    eval_prompts = None
    if args.eval_prompts and args.eval_prompts != "none" and args.eval_num_prompts > 0:
        eval_prompts = load_prompts(args.eval_prompts, split="validation", num_prompts=args.eval_num_prompts)
    drafter = _build_drafter(args, target, train_data)
    if args.states:
        from torch.utils.data import ConcatDataset

        from .states import TargetStatesDataset, cache_target_states

        if len(args.states) not in (1, len(parts)):
            raise SystemExit(
                f"--states takes one folder (for all --data together) or one per --data folder; got "
                f"{len(args.states)} for {len(parts)} datasets."
            )
        pairs = [(train_data, args.states[0])] if len(args.states) == 1 else list(zip(parts, args.states))
        tli = getattr(drafter.config, "target_layer_inference", 0) if args.kind == "moa" else 0
        cached = [
            TargetStatesDataset(data, cache_target_states(target, data, folder, batch_size=args.batch_size,
                                                          max_length=args.max_length, progress=not args.quiet,
                                                          tli_layers=tli), target)
            for data, folder in pairs
        ]
        train_data = cached[0] if len(cached) == 1 else ConcatDataset(cached)
    model = apply_lora(drafter, r=args.lora_r) if args.lora_r else drafter
    training_args = MoATrainingArguments(
        output_dir=args.output,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler,
        max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        eval_strategy="steps" if eval_data is not None else "no",
        eval_steps=args.eval_steps if eval_data is not None else None,
        eval_acceptance_steps=args.eval_steps if eval_data is None and eval_prompts else None,
        eval_num_prompts=args.eval_num_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens,
        min_cycle=args.min_cycle,
        max_cycle=args.max_cycle,
        soft_ce_weight=args.soft_ce_weight,
        feature_weight=args.feature_weight,
        feature_noise=args.feature_noise,
        vocab_chunk_size=args.vocab_chunk_size,
        sa_curriculum=args.sa_curriculum,
        max_length=args.max_length,
        bf16=args.bf16,
        use_cpu=args.cpu,
        seed=args.seed,
        dataloader_num_workers=args.num_workers,
        report_to=args.report_to,
        disable_tqdm=args.quiet,
    )
    trainer = MoATrainer(
        model=model,
        target=target,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        eval_prompts=eval_prompts,
        processing_class=tokenizer,
    )
    resume = args.resume
    if resume == "latest":
        resume = True
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    wall = time.perf_counter() - t0
    final = trainer.evaluate() if eval_prompts or eval_data is not None else {}
    if trainer.is_world_process_zero():
        out = Path(args.output)
        drafter = merge_lora(trainer.model) if args.lora_r else trainer.drafter
        if args.lora_r:
            trainer.model.save_pretrained(out / "adapter")
        drafter.save_pretrained(out)  # the drafter only (safetensors): never the target's weights
        drafter.generation_config.save_pretrained(out)
        tokens = int(trainer.state.num_input_tokens_seen or 0)
        info = {
            "kind": args.kind,
            "data": f"on-policy responses of {getattr(target.config, 'name_or_path', args.target)} "
            f"({len(train_data)} examples, {', '.join(args.data)})",
            "cached_target_states": bool(args.states),
            "tokens": tokens or None,
            "steps": trainer.state.global_step,
            "wall_time_s": round(wall, 1),
            "hardware": _hardware(),
            "final_train_loss": round(float(result.training_loss), 5),
            "acceptance_length_heldout": final.get("eval_acceptance_length"),
            "top1_heldout": final.get("eval_top1"),  # with --eval-data: top-1 agreement with the target
            "top1_first_heldout": final.get("eval_top1_first"),
            "learning_curve": _learning_curve(trainer, info_from=args.init_drafter),
        }
        info.update(_totals(info, info_from=args.init_drafter))
        (out / "training_info.json").write_text(json.dumps(info, indent=1))
        print(json.dumps({"output": str(out), **info}, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# moa tune
# ---------------------------------------------------------------------------------------------------------------------
def _csv(kind: type):
    def parse(text: str) -> list:
        try:
            values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from err
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    return parse


def run_tune(args: argparse.Namespace) -> int:
    from moa_hf.bench import hardware_info

    from . import tune
    from .data import check_not_spec_bench, format_prompts, load_prompts

    for source in args.prompts:  # tuning on the evaluation set would be cheating: refused before any loading
        check_not_spec_bench(source)
    prompts = [
        prompt
        for source in args.prompts
        for prompt in load_prompts(source, column=args.prompt_column, num_prompts=args.num_prompts, seed=args.seed)
    ]
    torch.manual_seed(args.seed)
    target, tokenizer = load_target(args.target, args.dtype, args.device)
    drafter, kind = tune.load_drafter_for_tuning(args.drafter, target, args.kind)
    prompt_ids = format_prompts(tokenizer, prompts)
    result = tune.tune_speculation(
        target,
        drafter,
        prompt_ids,
        num_assistant_tokens=args.num_assistant_tokens,
        thresholds=args.thresholds,
        schedules=args.schedules,
        lookup_tokens=args.lookup_tokens,
        lookup_min_ngrams=args.lookup_min_ngrams,
        lookup_halving=[bool(h) for h in args.lookup_halve_per_ngram],
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        progress=not args.quiet,
        allow_other_target=args.allow_other_target,
    )
    result = {
        "target": getattr(target.config, "name_or_path", None) or args.target,
        "drafter": str(args.drafter),
        "kind": kind,
        "dtype": str(target.dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "hardware": hardware_info(target.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **result,
        "written": bool(args.write),
    }
    folder = Path(args.drafter)
    (folder / tune.TUNING_FILE).write_text(json.dumps(result, indent=1))
    print(tune.format_tuning_markdown(result))
    print(f"\nwrote {folder / tune.TUNING_FILE}")
    if args.write:
        tune.write_best_setting(folder, result["best"], fallback=drafter.generation_config)
        print(f"updated {folder / 'generation_config.json'} with the best setting")
    return 0


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
                points.append({
                    "step": step0 + h["step"],
                    "tokens": tokens0 + h["tokens"],
                    "wall_time_s": round(wall0 + (h["wall_time_s"] or 0.0), 1),
                    "acceptance_length": round(h["eval_acceptance_length"], 4),
                })
    return list({p["step"]: p for p in points}.values())  # one point per step (the last measurement)


def _add_target_args(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--target", required=True, help="`default` (SmolLM2-135M-Instruct, offline), a folder or a Hub id")
    p.add_argument("--dtype", default="auto", choices=sorted(_DTYPES), help="target dtype (auto: bf16 GPU, fp32 CPU)")
    if device:
        p.add_argument("--device", default=None, help="device of the target (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `moa data`, `moa train` and `moa tune`."""
    p = subparsers.add_parser(
        "data",
        help="generate on-policy training data: the target answers prompts",
        description="Let the target answer prompts (greedy by default) and save prompt+response token ids as a "
        "`datasets` folder. Resumable: run the same command again after an interruption. Spec-Bench is refused.",
    )
    _add_target_args(p)
    p.add_argument("--prompts", default="default", help="`default` (offline generator), `default:written` (material "
                   "the target writes first; needs --num-prompts), a .jsonl/.txt file, a saved `datasets` folder or a "
                   "dataset name (default: default)")
    p.add_argument("--output", required=True, help="dataset folder to write")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--prompt-column", default=None, help="field/column holding the prompt")
    p.add_argument("--prompt-split", default="train", help="split of a dataset source (default: train)")
    p.add_argument("--do-sample", action="store_true", help="sample responses instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--no-chat-template", action="store_true", help="feed raw prompt text (no chat template)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--shard-size", type=int, default=512, help="prompts per saved shard (resume granularity)")
    p.add_argument("--part", default=None, metavar="K/N", help="answer only every N-th prompt starting at K (run N "
                   "of these, e.g. one per GPU, then `moa train --data PART0 ... PARTN-1`)")
    p.set_defaults(func=run_data)

    p = subparsers.add_parser(
        "train",
        help="train a MoA drafter on data from `moa data`",
        description="Train a MoA drafter against a frozen target (Hugging Face Trainer; checkpoints in --output, "
        "resume with --resume). Launch with `accelerate launch -m moa_hf.training.cli train ...` for several "
        "GPUs/processes. The final drafter (safetensors + generation_config.json) is saved in --output.",
    )
    _add_target_args(p, device=False)
    p.add_argument("--data", required=True, nargs="+", help="dataset folder(s) written by `moa data`")
    p.add_argument("--eval-data", default=None, help="held-out dataset folder for the evaluation loss")
    p.add_argument("--output", required=True, help="output folder (checkpoints and the final drafter)")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch-size", type=int, default=8, help="per-device batch size")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--lr-scheduler", default="cosine")
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--max-length", type=int, default=None, help="truncate sequences to this many tokens")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --output, or from the given checkpoint folder")
    p.add_argument("--kind", default="moa", choices=["moa", "eagle", "independent"], help="drafter type: MoA "
                   "(default), the EAGLE-style peer, or an independent small LM distilled from the target")
    p.add_argument("--states", default=None, nargs="+", help="folder of the target's cached states (K/V and final "
                   "hidden states, computed once on first use, memory-mapped): epochs then cost only the drafter; "
                   "one folder per --data folder reuses each dataset's states")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="MoA: predict only the N most frequent "
                   "tokens of the target's responses in --data (a smaller, faster head; still lossless)")
    p.add_argument("--lsa-hidden-size", type=int, default=None, help="MoA: width of the Layer Self-Attention "
                   "(default 2 x KV heads x head dim); the LSA runs over every target layer of every token, so it "
                   "dominates training cost")
    p.add_argument("--init-from-target-layer", type=int, default=None, metavar="I", help="start the drafter's "
                   "decoder layers from the target's layer I (e.g. -1, the last)")
    p.add_argument("--independent-layers", type=int, default=2, help="independent LM: number of decoder layers "
                   "(copied from the target's first ones)")
    p.add_argument("--feature-noise", type=float, default=0.0, help="EAGLE-style: Gaussian noise std on input "
                   "features")
    p.add_argument("--init-drafter", default=None, help="start from a saved drafter instead of a random one")
    p.add_argument("--target-layer-inference", type=int, default=0, help="N: the target's last N layers run in "
                   "the drafter (TLI); --states then also caches the inputs of those layers")
    p.add_argument("--own-embeddings", action="store_true", help="the drafter keeps (frozen) copies of the "
                   "embedding and LM head, saved with it")
    p.add_argument("--min-cycle", type=int, default=6)
    p.add_argument("--max-cycle", type=int, default=14)
    p.add_argument("--soft-ce-weight", type=float, default=0.1)
    p.add_argument("--feature-weight", type=float, default=1.0)
    p.add_argument("--vocab-chunk-size", type=int, default=1024)
    p.add_argument("--sa-curriculum", action="store_true", help="SA sees only the current cycle early in training")
    p.add_argument("--eval-prompts", default="default:validation", help="held-out prompts for the acceptance "
                   "length (`none` disables)")
    p.add_argument("--eval-num-prompts", type=int, default=8)
    p.add_argument("--eval-max-new-tokens", type=int, default=64)
    p.add_argument("--eval-steps", type=int, default=500, help="evaluate every N steps")
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--lora-r", type=int, default=0, help="train LoRA adapters of this rank instead of all weights "
                   "(the merged drafter is saved)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision for the drafter")
    p.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is available")
    p.add_argument("--num-workers", type=int, default=0, help="dataloader workers")
    p.add_argument("--report-to", default="none", help="Trainer integrations (e.g. tensorboard, wandb; default none)")
    p.set_defaults(func=run_train)

    p = subparsers.add_parser(
        "tune",
        help="pick a drafter's fastest speculation settings (draft length, confidence threshold)",
        description="Time greedy speculative decoding with the drafter for every setting of a grid on held-out "
        "prompts, against the target alone (interleaved). Prints a table, writes tuning.json into the drafter "
        "folder and, with --write, the best setting into its generation_config.json. Spec-Bench is refused.",
    )
    _add_target_args(p)
    p.add_argument("--drafter", required=True, help="drafter folder (the --output of `moa train`)")
    p.add_argument("--kind", default="auto", choices=["auto", "moa", "eagle", "independent"],
                   help="drafter type (auto: from the folder's config.json)")
    p.add_argument("--prompts", nargs="+", default=["default:validation", "default:documents"],
                   help="held-out prompt sources, --num-prompts from each: `default:validation` (chat, maths, "
                   "tutorials), `default:documents` (summarise / answer from / translate a passage), a .jsonl/.txt "
                   "file, a saved `datasets` folder or a dataset name (never Spec-Bench); default: both offline "
                   "splits")
    p.add_argument("--prompt-column", default=None, help="field/column holding the prompt")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts taken from each --prompts source")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-assistant-tokens", type=_csv(int), default=[2, 3, 4, 5, 6, 8],
                   help="draft lengths to try, comma-separated (default: 2,3,4,5,6,8)")
    p.add_argument("--thresholds", type=_csv(float), default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5],
                   help="confidence thresholds to try, comma-separated (default: 0,0.1,0.2,0.3,0.4,0.5)")
    p.add_argument("--schedules", type=_csv(str), default=["constant"],
                   help="draft-length schedules to try: constant, heuristic, heuristic_transient (default: constant)")
    p.add_argument("--lookup-tokens", type=_csv(int), default=[0], help="MoA drafter: prompt-lookup draft "
                   "lengths to try (0: off; capped by the draft length), comma-separated (default: 0)")
    p.add_argument("--lookup-min-ngrams", type=_csv(int), default=[1], help="MoA drafter: shortest n-gram match "
                   "that drafts by lookup instead of the network, comma-separated (default: 1)")
    p.add_argument("--lookup-halve-per-ngram", type=_csv(int), default=[0], help="MoA drafter: 1 = a lookup match "
                   "one token shorter than the longest n-gram proposes half as many tokens; values to try, "
                   "comma-separated 0/1 (default: 0)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (more: less timing noise)")
    p.add_argument("--allow-other-target", action="store_true",
                   help="attach even if the drafter records another target name (same signature)")
    p.add_argument("--write", action="store_true", help="save the best setting into the drafter folder's "
                   "generation_config.json")
    p.set_defaults(func=run_tune)


def main(argv: list[str] | None = None) -> int:
    """`python -m moa_hf.training.cli {data,train,tune} ...` (what `accelerate launch -m` runs)."""
    parser = argparse.ArgumentParser(prog="moa")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
