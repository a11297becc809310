"""A Target Layer Inference drafter that drafts well, on every route: tokens and target calls.

The drafter is the target itself with noise: TLI over all 30 layers of SmolLM2, its SA/CA output projections drawn
with std NOISE (seed 0), so its feature is nearly the token's embedding and it drafts the target's token often, not
always. Float32 greedy, 4 Spec-Bench questions (every 10th), 48 new tokens, lookup off, 4 tokens per
`assistant_model` call, confidence threshold 0; with --engine also the engine's tree (depth 4, top-k 2, 8 nodes) and
chain (depth 4). Writes {question: {route: [tokens, calls(, drafted)]}}.

    python docs/journal/scripts/tli_routes.py OUT.json --noise 0.01 --engine [--questions PATH]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import moa_hf

ROOT = Path(__file__).resolve().parents[3]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
sys.path.insert(0, str(ROOT / "tests"))
from factory import target_as_drafter  # noqa: E402  the tests' constructor of a drafter that is its target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--engine", action="store_true", help="the engine's tree and chain too")
    parser.add_argument("--questions", default=str(SPEC_BENCH), help="Spec-Bench question.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target, tok = moa_hf.load_target("default", dtype=torch.float32)
    drafter = target_as_drafter(target, noise=args.noise).float()
    drafter.generation_config.num_assistant_tokens = 4
    drafter.config.lookup_num_tokens = 0
    questions = [json.loads(line) for line in open(args.questions)][::10][:4]
    results = {}
    for i, q in enumerate(questions):
        messages = [{"role": "user", "content": q["turns"][0]}]
        inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        n = inputs["input_ids"].shape[1]
        row = {}
        with moa_hf.attached(drafter, target):
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=48, do_sample=False)
            row["assistant"] = (out[0, n:].tolist(), drafter.speculation_stats.target_calls)
        shapes = {
            "engine_tree": dict(tree_depth=4, tree_top_k=2, tree_budget=8, lookup=False),
            "engine_chain": dict(tree_depth=4, tree_top_k=1, tree_budget=4, lookup=False),
        }
        for name, shape in shapes.items() if args.engine else ():
            out = moa_hf.generate(
                target, drafter, **inputs, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, **shape
            )
            stats = out.speculation_stats[0]
            row[name] = (out.sequences[0, n:].tolist(), stats.target_calls, stats.drafted_tokens)
        results[i] = row
        print(i, {k: v[1:] for k, v in row.items()}, flush=True)
    Path(args.output).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
