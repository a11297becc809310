"""`moa bench`: the command line (see `moa_hf.bench`)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from ..chat import ChatTemplateError
from ..hardware import hardware_info
from ..loading import default_device, load_target, parse_dtype
from ..modeling import target_fingerprint
from .data import BenchError, default_questions_path, load_questions, prompt_questions
from .methods import ALL_METHODS, build_methods, checked_drafter, resolve_method_names
from .report import format_markdown, plot_benchmark
from .runner import check_lossless, run_batches, run_benchmark


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (BenchError, ChatTemplateError) as err:
        print(f"moa bench: error: {err}", file=sys.stderr)
        return 2


def _parse_batch_sizes(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise BenchError(f"--batch-sizes {text!r} is not a comma list of integers (e.g. 1,4,8).") from err
    if not sizes or min(sizes) < 1:
        raise BenchError(f"--batch-sizes {text!r}: give positive batch sizes, e.g. 1,4,8.")
    return list(dict.fromkeys(sizes))


def _run(args: argparse.Namespace) -> int:

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = {"moa": args.moa, "eagle": args.eagle, "independent": args.independent}
    names = resolve_method_names(args.methods, paths)
    batch_sizes = _parse_batch_sizes(args.batch_sizes)
    questions_path = None
    if args.prompts:  # natural held-out prompts instead of Spec-Bench
        if args.questions:
            raise BenchError("Give --questions (Spec-Bench) or --prompts (natural held-out prompts), not both.")
        questions = prompt_questions(args.prompts, args.num_prompts, args.seed)
    else:
        questions_path = Path(args.questions) if args.questions else default_questions_path()
        if not args.questions and not questions_path.is_file():
            raise BenchError(
                f"No Spec-Bench questions at the default {questions_path}; pass --questions PATH (a question.jsonl) "
                "or --prompts SOURCE (natural held-out prompts)."
            )
        questions = load_questions(questions_path, args.questions_per_category, args.seed)
    if args.output:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise BenchError("--output writes bench.png with matplotlib: pip install matplotlib") from err
    device = args.device or default_device()
    dtype = parse_dtype(args.dtype)
    torch.manual_seed(args.seed)
    try:  # `default` or a local folder, never downloaded
        target, tokenizer = load_target(args.target, dtype=dtype, device=device, local_files_only=True)
    except (OSError, ValueError) as err:
        raise BenchError(f"--target {args.target}: {err} (`default` is SmolLM2-135M-Instruct).") from err
    method_kw = dict(
        moa=args.moa,
        eagle=args.eagle,
        independent=args.independent,
        pld_tokens=args.pld_tokens,
        allow_other_target=args.allow_other_target,
    )
    methods = build_methods(names, target, **method_kw)
    print(
        f"moa bench: {len(questions)} questions x {args.repeats} repeats x methods {','.join(names)}", file=sys.stderr
    )
    result = run_benchmark(
        target,
        tokenizer,
        questions,
        methods,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        repeats=args.repeats,
        progress=not args.no_progress,
    )

    bench = {
        "hardware": hardware_info(target.device),
        "target": str(getattr(target.config, "name_or_path", "") or args.target),
        "target_spec": args.target,
        "target_fingerprint": target_fingerprint(target),  # which of a drafter's targets this run measured
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers": __import__("transformers").__version__,
        "questions": None if questions_path is None else str(questions_path),
        "questions_per_category": None if questions_path is None else args.questions_per_category,
        "prompts": args.prompts,
        "num_prompts": args.num_prompts if args.prompts else None,
        "question_ids": [q["question_id"] for q in questions],
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "methods": result["methods"],
        "records": result["records"],
    }
    if batch_sizes:
        drafter, _ = checked_drafter("--batch-sizes", "moa", args.moa, target, args.allow_other_target, engine=True)
        bench["batch"] = run_batches(
            target,
            tokenizer,
            questions,
            drafter,
            batch_sizes,
            max_new_tokens=args.max_new_tokens,
            warmup=args.warmup,
            repeats=args.repeats,
            allow_other_target=args.allow_other_target,
            progress=not args.no_progress,
        )
    failed = []
    if args.check:
        target32, tok32 = (
            (target, tokenizer)
            if dtype == torch.float32
            else load_target(args.target, dtype=torch.float32, device=device, local_files_only=True)
        )
        methods32 = build_methods(names, target32, **method_kw)
        bench["check"] = check_lossless(
            target32, tok32, questions, methods32, max_new_tokens=args.max_new_tokens, progress=not args.no_progress
        )
        failed = [name for name, entry in bench["check"].items() if not entry["passed"]]
    markdown = format_markdown(bench)
    print(markdown)
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(bench, indent=2, default=str) + "\n")
        (out / "bench.md").write_text(markdown)
        plot_benchmark(bench, out / "bench.png")
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}", file=sys.stderr)
    if failed:
        for name in failed:
            first = bench["check"][name]["mismatches"][0]
            print(
                f"moa bench --check: {name} is NOT lossless: question {first['question_id']} differs from the target "
                f"alone first at new token {first['position']}",
                file=sys.stderr,
            )
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="Benchmark decoding methods (vanilla, moa, the tree engine, eagle, independent, pld) on Spec-Bench.",
        description=sys.modules[__package__].__doc__,  # the package doc (moa_hf/bench/__init__.py)
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench)")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="SOURCE",
        help="natural held-out prompts instead of Spec-Bench, one category per source: default:validation, "
        "default:documents, pydoc:heldout (the `default:pydoc` target's held-out API names), a .jsonl/.txt file ...",
    )
    p.add_argument("--num-prompts", type=int, default=8, help="with --prompts: prompts taken from each source")
    p.add_argument(
        "--target",
        default="default",
        help="a local model folder, `default` (SmolLM2-135M-Instruct) or `default:NAME` (a shipped fine-tune of it)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--questions-per-category", type=int, default=2, help="sampled with --seed; 0 = all")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded generations per method before measuring")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list (default all: {','.join(ALL_METHODS)}; a sorted --moa drafter adds moa_exit1..K and, once "
        "tuned, moa_adaptive and moa_tree_adaptive); sorted drafters also: moa_tree_exit<k>, and the shorthands "
        "moa_exits / moa_tree_exits (every exit and the adaptive depth)",
    )
    p.add_argument("--moa", default="default", help="MoA drafter folder, or `default` (the shipped drafter)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter folder (`moa train --kind eagle`)")
    p.add_argument("--independent", default=None, help="independent causal-LM drafter folder (`--kind independent`)")
    p.add_argument("--pld-tokens", type=int, default=10, help="prompt lookup decoding: tokens drafted per cycle")
    p.add_argument("--allow-other-target", action="store_true", help="attach drafters recorded for another target")
    p.add_argument("--output", default=None, help="folder for bench.json, bench.md and bench.png")
    p.add_argument("--check", action="store_true", help="also check losslessness in float32 (exit 1 on a difference)")
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="also a batch section, e.g. 1,4,8: left-padded batches, batched target.generate vs the tree engine "
        "(with the --moa drafter); off by default",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_main)
