"""`moa bench`: the command line (see `moa_hf.bench`)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from transformers import HfArgumentParser

from ..chat import ChatTemplateError
from ..hardware import hardware_info
from ..loading import default_device, load_target, parse_dtype
from ..modeling import target_fingerprint
from .arguments import BENCH_ARGUMENTS, BenchArguments, drafter_paths
from .data import BenchError, default_questions_path, load_questions, prompt_questions
from .methods import BATCH_METHOD, build_methods, checked_drafter, method_kind, resolve_method_names
from .report import format_markdown, plot_benchmark
from .runner import check_lossless, run_batches, run_benchmark


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _main(namespace: argparse.Namespace) -> int:
    args, paths = HfArgumentParser(BENCH_ARGUMENTS).parse_dict(vars(namespace), allow_extra_keys=True)
    try:
        return _run(args, drafter_paths(paths))
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


def _run(args: BenchArguments, paths: dict[str, str | None]) -> int:
    """`moa bench` with its options `args` and the drafters' folders `paths` ({kind: folder})."""
    if args.threads:
        torch.set_num_threads(args.threads)
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
    method_kw = dict(pld_tokens=args.pld_tokens, allow_other_target=args.allow_other_target)
    methods = build_methods(names, target, paths, **method_kw)
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
        kind = method_kind(BATCH_METHOD)
        drafter, _ = checked_drafter("--batch-sizes", kind, paths[kind], target, args.allow_other_target, engine=True)
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
        methods32 = build_methods(names, target32, paths, **method_kw)
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
        parents=[HfArgumentParser(BENCH_ARGUMENTS, add_help=False)],
        help="Benchmark decoding methods (vanilla, moa, the tree engine, eagle, independent, pld) on Spec-Bench.",
        description=sys.modules[__package__].__doc__,  # the package doc (moa_hf/bench/__init__.py)
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=_main)
