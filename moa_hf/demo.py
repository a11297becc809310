"""`moa demo` (what `make demo` runs): the default drafter on the embedded SmolLM2-135M-Instruct target.

Generates answers to a few prompts with plain `target.generate` and with `assistant_model=drafter`, checks the text is
identical, and prints the measured acceptance length, tokens/s and speedup. Numbers are measured, never assumed.
"""

import argparse
import time

import torch

__all__ = ["run_demo", "register"]

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for staying focused while studying.",
]


def _load_drafter(target, path: str | None):
    from . import MoADrafterModel, build_drafter

    if path:
        return MoADrafterModel.from_pretrained(path).to(target.dtype).eval(), path
    try:
        from . import load_default_drafter

        return load_default_drafter(dtype=target.dtype), "default (trained)"
    except (ImportError, FileNotFoundError):
        torch.manual_seed(0)
        return build_drafter(target).to(target.dtype).eval(), "untrained (random init: no trained drafter found)"


def run_demo(dtype: str = "bfloat16", max_new_tokens: int = 96, drafter_path: str | None = None) -> dict:
    from . import attached, load_default_target

    torch_dtype = getattr(torch, dtype)
    target, tok = load_default_target(dtype=torch_dtype)
    drafter, origin = _load_drafter(target, drafter_path)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"target: SmolLM2-135M-Instruct ({dtype}), drafter: {origin}")
    print(
        f"drafter parameters (trainable, own): {n_params / 1e6:.2f}M; embedding and LM head borrowed from the target"
    )
    gc = drafter.generation_config
    lookup = drafter.lookup_settings(gc) if drafter.supports_prompt_lookup else None
    halving = ", half as many per shorter n-gram" if lookup and lookup[3] else ""
    print(
        f"speculation (the drafter's generation_config): up to {gc.num_assistant_tokens} tokens per cycle, confidence "
        f"threshold {gc.assistant_confidence_threshold}, prompt lookup "
        + (f"on (up to {lookup[0]} tokens, n-grams of {lookup[1]} down to {lookup[2]}{halving})" if lookup else "off")
    )
    totals = {"vanilla_s": 0.0, "moa_s": 0.0, "tokens": 0, "accepted": [], "differ": 0}
    with attached(drafter, target):
        for prompt in PROMPTS:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            inputs = tok(text, return_tensors="pt")
            kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
            t0 = time.perf_counter()
            ref = target.generate(**inputs, **kw)
            t1 = time.perf_counter()
            out = target.generate(**inputs, assistant_model=drafter, **kw)
            t2 = time.perf_counter()
            stats = drafter.speculation_stats
            n_new = out.shape[1] - inputs["input_ids"].shape[1]
            same = torch.equal(out, ref)
            totals["vanilla_s"] += t1 - t0
            totals["moa_s"] += t2 - t1
            totals["tokens"] += n_new
            totals["accepted"] += stats.accepted_lengths
            totals["differ"] += 0 if same else 1
            answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"\n> {prompt}\n{answer.strip()[:300]}")
            print(
                f"  [{n_new} tokens, acceptance length {stats.mean_accepted_length:.2f}, "
                f"{stats.lookup_cycles}/{len(stats.accepted_lengths)} cycles drafted by lookup, "
                f"vanilla {t1 - t0:.2f}s, moa {t2 - t1:.2f}s, identical to target alone: {same}]"
            )
    acc = sum(totals["accepted"]) / max(1, len(totals["accepted"]))
    result = {
        "acceptance_length": acc,
        "vanilla_tokens_per_s": totals["tokens"] / totals["vanilla_s"],
        "moa_tokens_per_s": totals["tokens"] / totals["moa_s"],
        "speedup": totals["vanilla_s"] / totals["moa_s"],
        "drafter_parameters": n_params,
    }
    print(
        f"\noverall: acceptance length {acc:.2f}, vanilla {result['vanilla_tokens_per_s']:.1f} tok/s, "
        f"moa {result['moa_tokens_per_s']:.1f} tok/s, speedup {result['speedup']:.2f}x "
        f"(measured on this machine, {torch.get_num_threads()} threads)"
    )
    if totals["differ"] and dtype != "float32":
        print(
            f"note: {totals['differ']} answer(s) differ from the target alone in {dtype}: verifying several tokens in "
            "one forward rounds differently from one token at a time at this precision. In float32 the output is "
            "token-identical (`moa demo --dtype float32`; tested in tests/test_smollm2.py, `moa bench --check`)."
        )
    return result


def _main(args: argparse.Namespace) -> int:
    run_demo(dtype=args.dtype, max_new_tokens=args.max_new_tokens, drafter_path=args.drafter)
    return 0


def _costs(args: argparse.Namespace) -> int:
    import json

    from . import attached, load_default_target
    from .costs import measure_costs

    target, tok = load_default_target(dtype=getattr(torch, args.dtype))
    drafter, origin = _load_drafter(target, args.drafter)
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text + " The sky looks blue because" * 12, return_tensors="pt").input_ids
    with attached(drafter, target):
        result = measure_costs(target, drafter, ids)
    result.update(drafter=origin, dtype=args.dtype, context_tokens=ids.shape[1], threads=torch.get_num_threads())
    print(json.dumps(result, indent=2))
    return 0


def register(subparsers) -> None:
    c = subparsers.add_parser("costs", help="Drafter cost per token vs a target step, and per-cycle overhead.")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    c.add_argument("--drafter", default=None)
    c.set_defaults(func=_costs)
    p = subparsers.add_parser("demo", help="Speculative decoding on the embedded SmolLM2 target, measured.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--drafter", default=None, help="a saved drafter folder (default: the shipped default drafter)")
    p.set_defaults(func=_main)
