"""`moa replay`: tokens per target call of greedy chain decoding replayed on held-out answers (`replay.py`), for
several chain rules at once, with bootstrap intervals over prompts, and optionally checked against real decoding.

    moa data --target default --prompts default:test --num-prompts 128 --max-new-tokens 96 --output runs/test
    moa replay --drafter default --data runs/test --rules 24:0.3,24:0,8:0 --check 16 --output replay.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from moa_hf.hardware import fast_dtype, hardware_summary
from moa_hf.loading import load_drafter, load_target

__all__ = ["ReplayArguments", "run_replay"]


@dataclass
class ReplayArguments:
    """`moa replay`: which drafter and target, which held-out answers, which chain rules."""

    data: str = field(
        metadata={
            "help": "A `moa data` folder of the target's greedy answers to held-out prompts (e.g. --prompts "
            "default:test); never the drafter's training data."
        }
    )
    drafter: str = field(default="default", metadata={"help": "The drafter: 'default', or a saved folder."})
    target: str = field(default="default", metadata={"help": "The target: 'default', 'default:NAME' or a folder."})
    dtype: str | None = field(
        default=None, metadata={"help": "Dtype of target and drafter (default: bf16 where native, else float32)."}
    )
    rules: str | None = field(
        default=None,
        metadata={
            "help": "Chain rules MAX_TOKENS:THRESHOLD, comma-separated (default: the drafter's own, then "
            "24:0.5,24:0.2,24:0,8:0,6:0,4:0)."
        },
    )
    num_answers: int | None = field(default=None, metadata={"help": "Replay only the first N answers."})
    check: int = field(
        default=0,
        metadata={
            "help": "Also run real `generate(assistant_model=drafter)` (network alone) on the first N prompts with "
            "the first rule, and replay what it wrote: both tokens per call."
        },
    )
    batch_size: int = field(default=4, metadata={"help": "Sequences per target forward."})
    output: str | None = field(default=None, metadata={"help": "Write the results as JSON here."})


def _rules(args: ReplayArguments, drafter) -> list:
    from .replay import ChainRule, parse_rules

    if args.rules:
        return parse_rules(args.rules)
    own = ChainRule.of(drafter)
    return [own, *(r for r in parse_rules("24:0.5,24:0.2,24:0,8:0,6:0,4:0") if r != own)]


def run_replay(namespace: argparse.Namespace) -> int:
    import datasets

    from .replay import check_replay, draft_tables, replay

    (args,) = HfArgumentParser(ReplayArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    dtype = args.dtype or fast_dtype()
    target, _ = load_target(args.target, dtype=dtype, require_tokenizer=False)
    drafter = load_drafter(args.drafter, target=target)
    folder = Path(args.data)
    meta_path = folder / "moa_data.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("do_sample"):
        raise SystemExit(f"moa replay: error: {folder} holds sampled answers; the replay needs greedy ones.")
    rows = datasets.load_from_disk(str(folder))
    if "response_mask" in rows.column_names:
        raise SystemExit("moa replay: error: the replay covers single-turn answers (prompt + response).")
    if args.num_answers is not None:
        rows = rows.select(range(min(args.num_answers, len(rows))))
    rules = _rules(args, drafter)
    max_new = meta.get("max_new_tokens")
    sequences = [list(r) for r in rows["input_ids"]]
    prompt_lengths = [int(p) for p in rows["prompt_length"]]
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    tables = draft_tables(
        drafter,
        target,
        sequences,
        prompt_lengths,
        max_new,
        depth=max(r.max_tokens for r in rules),
        eos_token_ids=eos,
        batch_size=args.batch_size,
    )
    report = {
        "date": datetime.date.today().isoformat(),
        "hardware": hardware_summary(),
        "dtype": str(dtype).removeprefix("torch."),
        "drafter": args.drafter,
        "data": str(folder),
        "answers": len(tables),
        "answer_tokens": sum(t.new_tokens for t in tables),
        "disagreements": sum(t.disagreements for t in tables),
        "rules": [],
    }
    print(f"{len(tables)} answers, {report['answer_tokens']} tokens ({report['hardware']}, {report['dtype']})")
    print("| rule (max tokens:threshold) | tokens per call | 95% interval | depth 1..4 acceptance |")
    print("| --- | ---: | --- | --- |")
    for rule in rules:
        result = replay(tables, rule)
        lo, hi = result.interval()
        rates = result.depth_rates()[:4]
        report["rules"].append(
            {
                "rule": str(rule),
                "tokens_per_call": result.tokens_per_call,
                "interval95": [lo, hi],
                "calls": sum(result.calls),
                "depth_acceptance": rates,
            }
        )
        depth = " ".join(f"{r:.3f}" for r in rates)
        print(f"| {rule} | {result.tokens_per_call:.3f} | {lo:.3f}-{hi:.3f} | {depth} |")
    if args.check > 0:
        prompts = [s[:p] for s, p in zip(sequences, prompt_lengths)][: args.check]
        checked = check_replay(drafter, target, prompts, max_new or 96, rules[0], eos_token_ids=eos)
        checked.pop("tables")
        report["check"] = checked
        print(
            f"check on {len(prompts)} prompts ({rules[0]}): real generate {checked['real_tokens_per_call']:.3f} "
            f"tokens per call, replay of its output {checked['replay_tokens_per_call']:.3f}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0
