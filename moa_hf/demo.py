"""`moa demo` (what `make demo` runs): the default drafter on the embedded SmolLM2-135M-Instruct target.

Two parts, both measured on this machine:
1. Speed, in the dtype asked for (by default `moa_hf.fast_dtype()`: bfloat16 where the CPU or GPU computes it
   natively, float32 elsewhere, e.g. on AVX2-only CPUs): each prompt is answered by the target alone and with the
   drafter (`target.generate(..., assistant_model=drafter)`); acceptance length, tokens/s and speedup are printed.
2. Exactness, in float32 on the same prompts: the answer with the drafter must be token-identical to the target's
   own. (In bfloat16 a forward over several tokens rounds differently from one token at a time, so a bf16 answer may
   drift from the target alone late in the text whether or not a drafter is used; float32 is where exactness holds.)
"""

import argparse
import time
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser

from .chat import chat_text, encode_chat

__all__ = ["PROMPTS", "CostsArguments", "DemoArguments", "register", "run_demo"]

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for staying focused while studying.",
]


def _describe(drafter) -> str:
    gc = drafter.generation_config
    lookup = drafter.lookup_settings if getattr(drafter, "supports_prompt_lookup", False) else None
    text = (
        f"up to {gc.num_assistant_tokens} drafted tokens per cycle, confidence threshold "
        f"{gc.assistant_confidence_threshold}, prompt lookup "
    )
    if lookup is None:
        return text + "off"
    halving = ", half as many per shorter n-gram" if lookup.halve_per_ngram else ""
    return (
        text + f"on (up to {lookup.num_tokens} tokens, n-grams of {lookup.max_ngram} to {lookup.min_ngram}{halving})"
    )


@torch.no_grad()
def _answer_both(
    target, drafter, inputs: dict, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(target alone, with drafter, seconds alone, seconds with drafter): greedy, same settings."""
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    t0 = time.perf_counter()
    ref = target.generate(**inputs, **kw)
    t1 = time.perf_counter()
    out = target.generate(**inputs, assistant_model=drafter, **kw)
    return ref, out, t1 - t0, time.perf_counter() - t1


def _check_exact(drafter_spec: str, prompts: list[str], max_new_tokens: int) -> int:
    """Answers with the drafter that differ from the target alone, in float32 (0 = lossless on every prompt)."""
    from . import attached
    from .loading import load_drafter, load_target

    target, tok = load_target("default", dtype=torch.float32)
    drafter = load_drafter(drafter_spec, target=target, dtype=torch.float32)
    differ = 0
    with attached(drafter, target):
        for i, prompt in enumerate(prompts, 1):
            ref, out, _, _ = _answer_both(target, drafter, encode_chat(tok, prompt), max_new_tokens)
            same = torch.equal(ref, out)
            differ += not same
            print(
                f"  {i}/{len(prompts)} {'token-identical' if same else 'DIFFERS'} ({out.shape[1] - ref.shape[1]:+d})"
            )
    return differ


def _dtype(name: str) -> torch.dtype:
    """`auto`: the fastest dtype on this machine (`fast_dtype`); else the named one."""
    from .hardware import fast_dtype
    from .loading import parse_dtype

    return fast_dtype() if name == "auto" else parse_dtype(name)


def run_demo(
    dtype: str = "auto", max_new_tokens: int = 96, drafter_path: str | None = None, check: bool = True
) -> dict:
    from . import attached
    from .loading import load_drafter, load_target

    spec = drafter_path or "default"
    target, tok = load_target("default", dtype=_dtype(dtype))
    dtype = str(target.dtype).removeprefix("torch.")
    drafter = load_drafter(spec, target=target)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"target: SmolLM2-135M-Instruct ({dtype}); drafter: {spec} ({n_params / 1e6:.2f}M own parameters)")
    print(f"speculation: {_describe(drafter)}")
    print(f"\n1. Speed ({dtype}, greedy, {max_new_tokens} new tokens, {torch.get_num_threads()} threads)")
    alone_s = with_s = 0.0
    tokens, accepted, differ = 0, [], 0
    with attached(drafter, target):
        for prompt in PROMPTS:
            inputs = encode_chat(tok, prompt)
            ref, out, t_alone, t_with = _answer_both(target, drafter, inputs, max_new_tokens)
            stats = drafter.speculation_stats
            n_new = out.shape[1] - inputs["input_ids"].shape[1]
            alone_s, with_s, tokens = alone_s + t_alone, with_s + t_with, tokens + n_new
            accepted += stats.accepted_lengths
            differ += not torch.equal(ref, out)
            answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
            print(f"\n> {prompt}\n{answer[:300]}")
            print(
                f"  [{n_new} tokens, acceptance length {stats.mean_accepted_length:.2f} "
                f"({stats.lookup_cycles}/{len(stats.accepted_lengths)} cycles from prompt lookup), "
                f"target alone {t_alone:.2f} s, with drafter {t_with:.2f} s: {t_alone / t_with:.2f}x]"
            )
    result = {
        "acceptance_length": sum(accepted) / max(1, len(accepted)),
        "vanilla_tokens_per_s": tokens / alone_s,
        "moa_tokens_per_s": tokens / with_s,
        "speedup": alone_s / with_s,
        "drafter_parameters": n_params,
    }
    print(
        f"\noverall: acceptance length {result['acceptance_length']:.2f}, target alone "
        f"{result['vanilla_tokens_per_s']:.1f} tok/s, with drafter {result['moa_tokens_per_s']:.1f} tok/s, "
        f"speedup {result['speedup']:.2f}x"
    )
    if check:
        print("\n2. Exactness (float32, the same prompts, greedy): the drafter's answer vs the target alone")
        if target.dtype == torch.float32:  # the speed part ran in float32: its answers are the check
            result["differ_float32"] = differ
            print(f"  {len(PROMPTS) - differ}/{len(PROMPTS)} answers above are token-identical")
        else:
            result["differ_float32"] = _check_exact(spec, PROMPTS, max_new_tokens)
        print(
            "  lossless: every answer is token-identical to the target alone"
            if not result["differ_float32"]
            else f"  ERROR: {result['differ_float32']} answer(s) differ in float32: please report this as a bug"
        )
    return result


_DRAFTER_HELP = "a saved drafter folder (default: the shipped default drafter)"


@dataclass
class DemoArguments:
    """`moa demo`'s options."""

    dtype: str = field(
        default="auto",
        metadata={
            "choices": ["auto", "bfloat16", "float32"],
            "help": "dtype of the speed part (auto: bfloat16 where it is native here, else float32)",
        },
    )
    max_new_tokens: int = 96
    drafter: str | None = field(default=None, metadata={"help": _DRAFTER_HELP})
    check: bool = field(default=True, metadata={"help": "check exactness in float32 afterwards"})


@dataclass
class CostsArguments:
    """`moa costs`' options."""

    dtype: str = field(
        default="auto", metadata={"choices": ["auto", "bfloat16", "float32"], "help": "auto: `fast_dtype()`"}
    )
    drafter: str | None = field(default=None, metadata={"help": _DRAFTER_HELP})


def _main(namespace: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    (args,) = HfArgumentParser(DemoArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    hf_logging.disable_progress_bar()  # the command's own output only (this process ends after the demo)
    result = run_demo(
        dtype=args.dtype, max_new_tokens=args.max_new_tokens, drafter_path=args.drafter, check=args.check
    )
    return 1 if result.get("differ_float32") else 0


def _costs(namespace: argparse.Namespace) -> int:
    import json

    from . import attached
    from .costs import measure_costs
    from .loading import load_drafter, load_target

    (args,) = HfArgumentParser(CostsArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    target, tok = load_target("default", dtype=_dtype(args.dtype))
    drafter = load_drafter(args.drafter or "default", target=target)
    ids = tok(chat_text(tok, PROMPTS[0]) + " The sky looks blue because" * 12, return_tensors="pt").input_ids  # [1, T]
    with attached(drafter, target):
        result = measure_costs(target, drafter, ids)
    result.update(
        drafter=args.drafter or "default",
        dtype=str(target.dtype).removeprefix("torch."),
        context_tokens=ids.shape[1],
        threads=torch.get_num_threads(),
    )
    print(json.dumps(result, indent=2))
    return 0


def register(subparsers) -> None:
    """Add `moa costs` and `moa demo` (their options: the fields of `CostsArguments` and `DemoArguments`)."""
    subparsers.add_parser(
        "costs",
        parents=[HfArgumentParser(CostsArguments, add_help=False)],
        help="Drafter cost per token vs a target step, and per-cycle overhead.",
    ).set_defaults(func=_costs)
    subparsers.add_parser(
        "demo",
        parents=[HfArgumentParser(DemoArguments, add_help=False)],
        help="Speculative decoding on the embedded SmolLM2 target: speed and exactness.",
    ).set_defaults(func=_main)
