"""Tokens and target calls on every route, for a before/after check of a change that must not change outputs.

Float32 greedy, 4 Spec-Bench questions (every 10th), 48 new tokens, the shipped drafter: `assistant_model` with and
without prompt lookup, the shipped weights with Target Layer Inference (N = 2) through `assistant_model`, the
engine's tree and chain, and the client through an in-process server. Writes {question: {route: [tokens, calls]}}.

    python docs/journal/scripts/same_tokens.py OUT.json [--questions PATH]

For "before", run it with the older commit's package first on the path (a `git worktree` of it, with `moa_hf/modeling`,
`moa_hf/training` and `moa_hf/hub_cards` linked to its `modeling`, `training`, `hub_cards`, and `PYTHONPATH=.`).
"""

import argparse
import copy
import json
from pathlib import Path

import torch

import moa_hf
from moa_hf import MoADrafterModel
from moa_hf.serving import MoAClient, ServerThread, ServingState, create_app

SPEC_BENCH = Path(__file__).resolve().parents[4] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--questions", default=str(SPEC_BENCH), help="Spec-Bench question.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target, tok = moa_hf.load_target("default", dtype=torch.float32)
    drafter = moa_hf.load_drafter("default", target=target).float()
    config = copy.deepcopy(drafter.config)
    config.target_layer_inference = 2
    tli = MoADrafterModel(config).float().eval()
    tli.load_state_dict(drafter.state_dict())
    tli.generation_config = copy.deepcopy(drafter.generation_config)
    questions = [json.loads(line) for line in open(args.questions)][::10][:4]
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    results = {}
    for i, messages in enumerate(prompts):
        inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        n = inputs["input_ids"].shape[1]
        row = {}
        for name, d, lookup in (
            ("assistant_lookup", drafter, 24),
            ("assistant_nolookup", drafter, 0),
            ("assistant_tli2", tli, 0),
        ):
            d.config.lookup_num_tokens = lookup
            with moa_hf.attached(d, target):
                out = target.generate(**inputs, assistant_model=d, max_new_tokens=48, do_sample=False)
                row[name] = (out[0, n:].tolist(), d.speculation_stats.target_calls)
        drafter.config.lookup_num_tokens = 24
        shapes = {
            "engine_tree": dict(tree_depth=5, tree_top_k=3, tree_budget=16, lookup=False),
            "engine_chain": dict(tree_depth=6, tree_top_k=1, tree_budget=6, lookup=False),
        }
        for name, shape in shapes.items():
            out = moa_hf.generate(
                target, drafter, **inputs, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, **shape
            )
            row[name] = (out.sequences[0, n:].tolist(), out.speculation_stats[0].target_calls)
        results[i] = row
        print(i, {k: v[1] for k, v in row.items()}, flush=True)
    with ServerThread(create_app(ServingState(target, drafter, tokenizer=tok))) as server:
        for i, messages in enumerate(prompts):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            with MoAClient(server.url, draft_length=4) as client:
                answer = client.generate(list(ids), 48)
            results[i]["client"] = (answer.token_ids, answer.server_calls)
            print(i, "client", answer.server_calls, flush=True)
    Path(args.output).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
