"""Sorted, multi-target drafters in `moa bench`, `moa tune`, `moa costs` and `moa publish`: fixed exits and adaptive
depth as benchmark methods with their tokens drafted per exit, the exit-threshold search, the cost per exit, and a card
and repo for a K=3 drafter serving two targets (loaded with remote code where moa_hf cannot be imported)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_bench import make_tokenizer, questions_list, write_questions

import moa_hf
from moa_hf import bench, hub_cards
from moa_hf.cli import main
from moa_hf.hub import build_repo_folder
from moa_hf.modeling import PRIMARY_TARGET, fixed_exit_thresholds, target_fingerprint
from moa_hf.tune import (
    NEVER,
    _exit_candidates,
    exit_agreement,
    format_exit_agreement_markdown,
    format_exit_tuning_markdown,
    tune_exit_thresholds,
)
from moa_hf.tune_settings import rank

from factory import make_target
from factory import sorted_drafter as random_sorted_drafter

K = 3
TARGET_ID = "moa-test/tiny-random-llama"
REPO_ID = "moa-test/tiny-sorted-moa-drafter"


def second_target():
    """The fine-tune's stand-in: the same architecture with other weights (another fingerprint)."""
    return make_target("llama", seed=1)


def sorted_drafter(target, second=None, thresholds=None, lora_rank: int = 2):
    """A random K=3 drafter for `target` (and `second` as the extra target `pydoc`), drafting 4 tokens per cycle."""
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, num_blocks=K, exit_thresholds=thresholds).eval()
    if second is not None:
        drafter.add_target("pydoc", second, lora_rank=lora_rank)
    drafter.generation_config.num_assistant_tokens = 4
    drafter.generation_config.assistant_confidence_threshold = 0.0  # a random drafter: always draft 4 tokens
    return drafter


def _save(drafter, folder: Path) -> Path:
    drafter.save_pretrained(folder)
    drafter.generation_config.save_pretrained(folder)
    return folder


def _no_hooks(model) -> bool:
    return not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------------------------------
# moa bench
# ---------------------------------------------------------------------------------------------------------------------
def test_exit_methods_report_tokens_per_exit_and_reproduce_greedy(tmp_path):
    target, tokenizer = make_target(), make_tokenizer()
    folder = _save(sorted_drafter(target, thresholds=[0.02, 0.02]), tmp_path / "sorted")
    names = bench.resolve_method_names("moa_exits,moa_tree_exit1,moa_tree_adaptive", {"moa": str(folder)})
    assert names == ["vanilla", "moa_exit1", "moa_exit2", "moa_exit3", "moa_adaptive", "moa_tree_exit1",
                     "moa_tree_adaptive"]  # fmt: skip
    methods = bench.build_methods(names, target, {"moa": str(folder)})
    result = bench.run_benchmark(
        target, tokenizer, questions_list(), methods, max_new_tokens=10, warmup=0, repeats=1, progress=False
    )
    assert _no_hooks(target)
    for record in result["records"]:
        assert record["matches_vanilla"], record  # fp32: every exit and the adaptive depth are lossless
        if record["method"] == "vanilla":
            assert "exit_counts" not in record
            continue
        counts = record["exit_counts"]
        assert len(counts) == K and sum(counts) == record["drafted_tokens"], record  # lookup is off
        # the engine sizes its trees from measured costs and may draft nothing; the chain always drafts
        assert record["drafted_tokens"] > 0 or record["method"].startswith("moa_tree"), record
        exit = bench.exit_methods_of(record["method"])[1]
        if exit is not None:  # a fixed exit drafts every token there
            assert counts[exit - 1] == record["drafted_tokens"], record
    summary = result["methods"]
    for name in names[1:]:
        per_record = [r["exit_counts"] for r in result["records"] if r["method"] == name]
        assert summary[name]["overall"]["exit_counts"] == [sum(c) for c in zip(*per_record)]
    assert summary["vanilla"]["overall"]["exit_counts"] is None
    assert summary["moa_exit2"]["info"]["exit"] == 2 and summary["moa_adaptive"]["info"]["exit"] == "adaptive"
    assert summary["moa_exit2"]["info"]["exit_thresholds"] == fixed_exit_thresholds(2, K)
    assert summary["moa_adaptive"]["info"]["exit_thresholds"] == [0.02, 0.02]
    assert summary["moa_exit1"]["info"]["drafter_target"] == PRIMARY_TARGET
    text = bench.format_markdown({"methods": summary, "max_new_tokens": 10})
    assert "### exits" in text and "| exit 1 | exit 2 | exit 3 | mean exit |" in text
    assert "| moa_exit2 | fixed exit 2 |" in text and "| moa_adaptive | 0.02, 0.02 |" in text
    check = bench.check_lossless(target, tokenizer, questions_list(), methods, max_new_tokens=8, progress=False)
    assert all(entry["passed"] for entry in check.values()) and set(check) == set(names[1:])


def test_method_names_of_sorted_drafters(tmp_path):
    target = make_target()
    untuned = _save(sorted_drafter(target), tmp_path / "untuned")
    tuned = _save(sorted_drafter(target, thresholds=[0.5, 0.7]), tmp_path / "tuned")
    paths = {}  # the default methods include the EAGLE and independent drafters: folders with a config.json
    for kind in ("eagle", "independent"):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text("{}")
        paths[kind] = str(tmp_path / kind)
    default = bench.resolve_method_names(None, {**paths, "moa": str(untuned)})
    assert default[-K:] == ["moa_exit1", "moa_exit2", "moa_exit3"] and "moa_adaptive" not in default
    default = bench.resolve_method_names(None, {**paths, "moa": str(tuned)})
    assert default[-K - 2 :] == ["moa_exit1", "moa_exit2", "moa_exit3", "moa_adaptive", "moa_tree_adaptive"]
    assert bench.resolve_method_names("moa_tree_exits", {"moa": str(untuned)})[1:] == [
        "moa_tree_exit1", "moa_tree_exit2", "moa_tree_exit3"
    ]  # fmt: skip
    with pytest.raises(bench.BenchError, match="exits 1 to 3"):
        bench.build_methods(["vanilla", "moa_exit4"], target, {"moa": str(untuned)})
    with pytest.raises(bench.BenchError, match="moa tune"):  # adaptive depth needs tuned thresholds
        bench.build_methods(["vanilla", "moa_adaptive"], target, {"moa": str(untuned)})
    with pytest.raises(bench.BenchError, match="Unknown method"):
        bench.resolve_method_names("moa_exit", {"moa": str(untuned)})
    one_block = tmp_path / "one_block"
    moa_hf.build_drafter(target).save_pretrained(one_block)
    assert "moa_exit1" not in bench.resolve_method_names(None, {**paths, "moa": str(one_block)})
    assert [m.name for m in bench.build_methods(["vanilla", "moa_exit1"], target, {"moa": str(one_block)})][1:] == [
        "moa_exit1"
    ]  # a one-block drafter has one exit


def test_cli_natural_prompts_and_exits(tmp_path, capsys):
    target, tokenizer = make_target(), make_tokenizer()
    target.config.name_or_path = str(tmp_path / "target")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    folder = _save(sorted_drafter(target, thresholds=[0.02, 0.02]), tmp_path / "sorted")
    prompts = tmp_path / "heldout.txt"
    prompts.write_text("w1 w2 w3 w1 w2\nw9 w8 w7\nw5 w6\n")
    out = tmp_path / "out"
    argv = [
        "bench", "--prompts", str(prompts), "--num-prompts", "2", "--target", str(tmp_path / "target"),
        "--methods", "vanilla,moa,moa_exits", "--moa", str(folder), "--max-new-tokens", "6", "--warmup", "0",
        "--output", str(out), "--check", "--no-progress", "--dtype", "float32",
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "### exits" in stdout and "moa_adaptive: PASS" in stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["prompts"] == [str(prompts)] and data["questions"] is None and data["num_prompts"] == 2
    assert data["target_fingerprint"] == target_fingerprint(target)
    assert list(data["methods"]) == ["vanilla", "moa", "moa_exit1", "moa_exit2", "moa_exit3", "moa_adaptive"]
    assert {r["category"] for r in data["records"]} == {str(prompts)} and len(data["records"]) == 2 * 6
    for name in ("moa", "moa_exit1", "moa_adaptive"):
        overall = data["methods"][name]["overall"]
        assert len(overall["exit_counts"]) == K and sum(overall["exit_counts"]) == overall["drafted_tokens"]
    assert main([*argv, "--questions", str(write_questions(tmp_path / "q.jsonl"))]) == 2
    assert "not both" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# moa tune
# ---------------------------------------------------------------------------------------------------------------------
def test_exit_threshold_search():
    target = make_target()
    drafter = sorted_drafter(target, thresholds=[0.3, 0.3])
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23]]
    result = tune_exit_thresholds(target, drafter, prompts, grid=(0.5,), max_new_tokens=8, progress=False)
    assert drafter.config.exit_thresholds == [0.3, 0.3] and _no_hooks(target)  # put back
    exit1_best = max(result["steps"][1]["rows"], key=rank)
    skipped = exit1_best["exit_thresholds"][0] == 0.0  # no token reaches exit 2: its threshold is not searched
    assert [step["step"] for step in result["steps"]] == [
        "fixed exits", "exit 1 threshold (round 1)", *([] if skipped else ["exit 2 threshold (round 1)"])
    ]  # fmt: skip
    fixed = result["steps"][0]["rows"]
    assert [row["exit"] for row in fixed] == [1, 2, 3]
    assert [row["exit_thresholds"] for row in fixed] == [fixed_exit_thresholds(k, K) for k in (1, 2, 3)]
    for step in result["steps"][1:]:  # the grid, 0, never and the current value (once)
        assert 3 <= len(step["rows"]) <= 4
        assert {0.0, 0.5, NEVER} <= {row["exit_thresholds"][int(step["step"][5]) - 1] for row in step["rows"]}
    for step in result["steps"]:
        assert step["baseline"]["acceptance_length"] == 1.0
        for row in step["rows"]:
            assert row["identical_outputs"] == 2 and sum(row["exit_counts"]) == row["drafted_tokens"]
    best = result["best"]
    assert best in result["steps"][-1]["rows"] and len(best["exit_thresholds"]) == K - 1
    assert result["best_fixed"] in fixed
    assert result["agreement"]["drafting_exit"] == 1 and len(result["agreement"]["top1_by_exit"]) == K
    text = format_exit_tuning_markdown(result)
    assert "**" in text and "fixed exit 3" in text and "never" in text and "Best: exit_thresholds=" in text
    assert "Top-1 agreement with the target, drafting at exit 1" in text
    with pytest.raises(ValueError, match="num_blocks > 1"):
        tune_exit_thresholds(target, moa_hf.build_drafter(target), prompts, progress=False)


def _two_token_target():
    """A target whose greedy token is always 40 or 41 (its LM head: +v, -v, zeros), so that a random drafter with the
    borrowed head is often right."""
    target = make_target()
    with torch.no_grad():
        v = target.lm_head.weight[40].clone()
        target.lm_head.weight.zero_()
        target.lm_head.weight[40], target.lm_head.weight[41] = v, -v
    return target


@pytest.mark.parametrize("exit", [1, 2, 3])
def test_exit_agreement_lines_up_with_the_accepted_tokens(exit):
    """The reachable tokens right at the drafting exit are exactly the draft tokens the target accepted (so positions,
    cycles and truths line up); shares are consistent and the drafter is left as it was."""
    target = _two_token_target()
    drafter = random_sorted_drafter(target, scale=0.5, exit_thresholds=[0.3, 0.3])  # exits that disagree
    drafter.generation_config.num_assistant_tokens = 6
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 23], [30, 31]]
    result = exit_agreement(
        target, drafter, prompts, exit=exit, thresholds=(0.6, 0.9), max_new_tokens=24, progress=False
    )
    assert drafter.config.exit_thresholds == [0.3, 0.3] and drafter.exit_thresholds_for() == [0.3, 0.3]
    assert drafter.sorted_exits.tops is None and _no_hooks(target)
    n, shares = result["tokens"], result["top1_by_exit"]
    assert n > 0 and result["accepted_draft_tokens"] > 0
    assert round(shares[exit - 1] * n) == result["accepted_draft_tokens"]
    assert max(shares) <= result["any_exit"] <= 1.0 and len(set(shares)) > 1  # each exit counted on its own
    below = result["below"]
    assert [row["threshold"] for row in below] == [0.6, 0.9]
    assert below[0]["tokens"] <= below[1]["tokens"] <= n and below[1]["share"] == below[1]["tokens"] / n
    text = format_exit_agreement_markdown(result)
    assert f"drafting at exit {exit}: {n} reachable" in text and "| < 0.6 |" in text and "right at exit 3" in text
    with pytest.raises(ValueError, match="num-blocks 3"):
        exit_agreement(target, moa_hf.build_drafter(target), prompts, progress=False)


def test_cli_tune_writes_exit_thresholds_for_two_targets(tmp_path, capsys):
    target, second, tokenizer = make_target(), second_target(), make_tokenizer()
    for name, model in (("target", target), ("pydoc", second)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    folder = _save(sorted_drafter(target, second), tmp_path / "sorted")
    (tmp_path / "main.txt").write_text("w1 w2 w3 w1 w2\nw9 w8 w7\n")
    (tmp_path / "pydoc.txt").write_text("w30 w31 w32\n")
    gc_before = (folder / "generation_config.json").read_text()
    argv = [
        "tune", "--target", str(tmp_path / "target"), "--target", f"{tmp_path / 'pydoc'}={tmp_path / 'pydoc.txt'}",
        "--prompts", str(tmp_path / "main.txt"), "--drafter", str(folder), "--device", "cpu", "--max-new-tokens", "6",
        "--exit-grid", "0.5", "--quiet", "--write",
    ]  # fmt: skip
    assert main(argv) == 0  # each target its own thresholds, on its own prompts
    out = capsys.readouterr().out
    assert "### target 'main'" in out and "### target 'pydoc'" in out
    assert "## moa tune: exit thresholds of a 3-block drafter, 2 prompts" in out
    tuning = json.loads((folder / "tuning.json").read_text())
    assert tuning["tuned"] == "exits" and tuning["num_prompts"] == 3 and tuning["written"] is True
    assert [t["prompts"] for t in tuning["targets"]] == [[str(tmp_path / "main.txt")], [str(tmp_path / "pydoc.txt")]]
    by_target = {name: r["best"]["exit_thresholds"] for name, r in tuning["exits_by_target"].items()}
    assert [r["num_prompts"] for r in tuning["exits_by_target"].values()] == [2, 1] and "exits" not in tuning
    config = json.loads((folder / "config.json").read_text())
    assert config["exit_thresholds"] == by_target["main"] and len(config["exit_thresholds"]) == 2
    assert config["extra_targets"]["pydoc"]["exit_thresholds"] == by_target["pydoc"]
    assert config["extra_targets"]["pydoc"]["target_fingerprint"] == target_fingerprint(second)  # the rest kept
    assert (folder / "generation_config.json").read_text() == gc_before  # exits only: the speculation setting stays
    reloaded = moa_hf.load_drafter(folder)
    assert reloaded.target_names == ["main", "pydoc"]
    assert [reloaded.exit_thresholds_for(n) for n in ("main", "pydoc")] == [by_target["main"], by_target["pydoc"]]

    assert main([*argv, "--pooled-exits"]) == 0  # one set for both: the per-target ones go
    assert "## moa tune: exit thresholds of a 3-block drafter, 3 prompts" in capsys.readouterr().out
    tuning = json.loads((folder / "tuning.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    assert config["exit_thresholds"] == tuning["exits"]["best"]["exit_thresholds"]
    assert "exit_thresholds" not in config["extra_targets"]["pydoc"]
    reloaded = moa_hf.load_drafter(folder)
    assert reloaded.exit_thresholds_for("pydoc") == reloaded.exit_thresholds_for("main") == config["exit_thresholds"]


# ---------------------------------------------------------------------------------------------------------------------
# moa costs
# ---------------------------------------------------------------------------------------------------------------------
def test_costs_per_exit():
    from moa_hf.costs import measure_costs

    target = make_target()
    drafter = sorted_drafter(target, thresholds=[0.4, 0.6])
    ids = torch.randint(3, 128, (1, 24))  # [1, T]
    with moa_hf.attached(drafter, target):
        result = measure_costs(target, drafter, ids, repeats=2, gen_tokens=8)
    assert drafter.config.exit_thresholds == [0.4, 0.6]  # put back
    assert [row["exit"] for row in result["exits"]] == [1, 2, 3]  # one row per exit
    for row in result["exits"]:
        assert row["drafter_token_ms"] > 0 and row["over_target_step"] > 0
    assert result["exits"][-1]["over_full_depth"] == 1.0
    assert result["exit1_over_full_depth"] == result["exits"][0]["over_full_depth"] > 0
    json.dumps(result)


# ---------------------------------------------------------------------------------------------------------------------
# Hub card and repo
# ---------------------------------------------------------------------------------------------------------------------
def _exit_benchmark(fingerprint: str, seed: int, target: str = TARGET_ID) -> dict:
    """A `moa bench` JSON of a sorted drafter: moa, every exit and the adaptive depth (numbers from `seed`)."""
    gen = torch.Generator().manual_seed(seed)

    def metrics(counts=None):
        a, t, s = (float(x) for x in torch.rand(3, generator=gen))
        return {"acceptance_length": 1 + 3 * a, "tokens_per_s": 10 + 90 * t, "speedup": 0.5 + 2 * s,
                "exit_counts": counts}  # fmt: skip

    methods = {"vanilla": {"overall": {**metrics(), "speedup": 1.0}}, "moa": {"overall": metrics([0, 0, 40])}}
    for k in (1, 2, 3):
        counts = [40 if j == k else 0 for j in (1, 2, 3)]
        methods[f"moa_exit{k}"] = {"overall": metrics(counts), "info": {"exit": k, "exit_thresholds": None}}
    methods["moa_adaptive"] = {
        "overall": metrics([25, 10, 5]),
        "info": {"exit": "adaptive", "exit_thresholds": [0.7, 0.9]},
    }
    return {
        "hardware": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "device": "cpu"},
        "target": target,
        "target_fingerprint": fingerprint,
        "dtype": "bfloat16",
        "prompts": ["default:validation"],
        "methods": methods,
    }


@pytest.fixture(scope="module")
def two_targets():
    target, second = make_target(), second_target()
    target.config.name_or_path = TARGET_ID
    second.config.name_or_path = "moa-test/tiny-random-llama-pydoc"
    return target, second


def test_card_lists_both_targets_and_exits(two_targets):
    target, second = two_targets
    drafter = sorted_drafter(target, second, thresholds=[0.7, 0.9])
    main_bench = _exit_benchmark(target_fingerprint(target), seed=1)
    pydoc_bench = _exit_benchmark(target_fingerprint(second), seed=2, target="moa-test/tiny-random-llama-pydoc")
    info = {"tokens": 1000, "targets": {"pydoc": {"acceptance_length_heldout": 1.87, "acceptance_length_exit1": 1.42}}}
    card = hub_cards.render_card(drafter, main_bench, info, repo_id=REPO_ID, target_benchmarks={"pydoc": pydoc_bench})
    text = card.text
    assert "## Targets and exits" in text and "3 blocks of 1 self-attention layer" in text
    assert "| Targets | 2: `main`, `pydoc` |" in text
    for name, model, measured in (("main", TARGET_ID, main_bench), ("pydoc", second.config.name_or_path, pydoc_bench)):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` | `{model}`"))
        adaptive = measured["methods"]["moa_adaptive"]["overall"]
        assert (
            drafter.config.extra_targets.get(name, {}).get("target_fingerprint", drafter.config.target_fingerprint)
            in row
        )
        assert f"{adaptive['acceptance_length']:.2f}" in row and f"{adaptive['speedup']:.2f}×" in row
        exit2 = measured["methods"]["moa_exit2"]["overall"]
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` | `moa_exit2` |"))
        assert "fixed exit 2" in row and "0 / 40 / 0" in row and f"{exit2['tokens_per_s']:.1f}" in row
    assert "| `pydoc` | exit1 | 1.42 |" in text and "[0.7, 0.9]" in text and "easy tokens take the cheap exits" in text
    drafter.config.exit_thresholds = [0.0, 2.0]  # tuned to leave every token at exit 1: the card says so
    text = hub_cards.render_card(drafter, main_bench, info, repo_id=REPO_ID).text
    assert "every token leaves at exit 1" in text and "easy tokens" not in text
    drafter.set_exit_thresholds([0.4, 0.0], target="pydoc")  # per-target thresholds: one line each
    text = hub_cards.render_card(drafter, main_bench, info, repo_id=REPO_ID).text
    assert "on each target's prompts" in text and "`main`: `[0.0, 2.0]`, so every token leaves at exit 1" in text
    assert "`pydoc`: `[0.4, 0.0]`, so easy tokens take the cheap exits." in text
    assert "rank-2 LoRA deltas" in text
    with pytest.raises(ValueError, match="fingerprint"):  # a benchmark of another model
        hub_cards.render_card(drafter, main_bench, repo_id=REPO_ID, target_benchmarks={"pydoc": main_bench})
    with pytest.raises(ValueError, match="does not serve"):
        hub_cards.render_card(drafter, repo_id=REPO_ID, target_benchmarks={"other": pydoc_bench})
    one = hub_cards.render_card(moa_hf.build_drafter(target), repo_id=REPO_ID).text
    assert "## Targets and exits" not in one and "| Targets |" not in one  # a one-block, one-target drafter


# Runs in a fresh interpreter where moa_hf cannot be imported. argv: repo folder, main target, pydoc target.
_SCRIPT = textwrap.dedent(
    r"""
    import importlib.abc, json, sys

    class BlockMoaHf(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "moa_hf" or name.startswith("moa_hf."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, BlockMoaHf())
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    repo, targets = sys.argv[1], {"main": sys.argv[2], "pydoc": sys.argv[3]}
    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True)
    result = {"class": f"{type(drafter).__module__}.{type(drafter).__name__}", "num_blocks": drafter.config.num_blocks,
              "targets": drafter.target_names, "runs": {}}
    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 8, 120, 31]])
    for name, folder in targets.items():
        target = AutoModelForCausalLM.from_pretrained(folder)
        alone = target.generate(ids, max_new_tokens=16, do_sample=False)
        for thresholds in ([0.0, 0.0], [2.0, 2.0], [0.02, 0.02]):  # exit 1, exit 3, adaptive
            drafter.config.exit_thresholds = thresholds
            with drafter.attached(target):
                active = drafter.active_target
                out = target.generate(ids, assistant_model=drafter, max_new_tokens=16, do_sample=False)
                stats = drafter.speculation_stats
            result["runs"][f"{name} {thresholds}"] = {
                "active": active, "equal": torch.equal(out, alone), "exit_counts": list(stats.exit_counts),
                "drafted": stats.drafted_tokens,
            }
    result["moa_hf_loaded"] = any(m == "moa_hf" or m.startswith("moa_hf.") for m in sys.modules)
    print("RESULT " + json.dumps(result))
    """
)


def test_publish_sorted_two_target_drafter_loads_without_moa_hf(two_targets, tmp_path):
    target, second = two_targets
    folder = _save(sorted_drafter(target, second, thresholds=[0.7, 0.9]), tmp_path / "sorted")
    (folder / "benchmark.json").write_text(json.dumps(_exit_benchmark(target_fingerprint(target), seed=3)))
    pydoc_bench = _exit_benchmark(target_fingerprint(second), seed=4, target=second.config.name_or_path)
    (folder / "benchmark.pydoc.json").write_text(json.dumps(pydoc_bench))  # found next to the drafter
    repo = build_repo_folder(folder, REPO_ID, tmp_path / "repo")
    assert json.loads((repo / "moa_benchmark.pydoc.json").read_text()) == pydoc_bench
    card = (repo / "README.md").read_text()
    assert "| `pydoc` | `moa-test/tiny-random-llama-pydoc` |" in card and "| `main` | `moa_exit3` |" in card
    config = json.loads((repo / "config.json").read_text())
    assert config["num_blocks"] == K and set(config["extra_targets"]) == {"pydoc"}
    for name, model in (("main", target), ("pydoc", second)):
        model.save_pretrained(tmp_path / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(PYTHONPATH="", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    script = tmp_path / "load.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(repo), str(tmp_path / "main"), str(tmp_path / "pydoc")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["class"].startswith("transformers_modules.") and result["class"].endswith("MoADrafterModel")
    assert result["moa_hf_loaded"] is False
    assert result["num_blocks"] == K and result["targets"] == ["main", "pydoc"]
    for key, run in result["runs"].items():
        assert run["active"] == key.split()[0], key  # attach selected the target's parts by its fingerprint
        assert run["equal"] is True, key
        assert len(run["exit_counts"]) == K and sum(run["exit_counts"]) == run["drafted"] > 0, (key, run)
        if "[0.0, 0.0]" in key:
            assert run["exit_counts"][0] == run["drafted"]
        if "[2.0, 2.0]" in key:
            assert run["exit_counts"][-1] == run["drafted"]


def test_exit_candidates_also_fall_back_to_the_next_exit():
    """From "always exit 1" ([0, never]) the exit-1 round tries each grid threshold with the unsure tokens going to
    exit 3 (the current fallback) and to exit 2 (the next exit); elsewhere only threshold i moves."""
    got = _exit_candidates([0.0, NEVER], 0, (0.5,))
    assert got == [[0.0, NEVER], [0.5, NEVER], [NEVER, NEVER], [0.5, 0.0]]
    assert _exit_candidates([0.5, NEVER], 0, (0.5,)) == [[0.0, NEVER], [0.5, NEVER], [NEVER, NEVER]]
    assert _exit_candidates([0.0, NEVER], 1, (0.5,)) == [[0.0, NEVER]]  # exit 2 unreachable: one setting
    assert _exit_candidates([0.5, NEVER], 1, (0.5,)) == [[0.5, 0.0], [0.5, 0.5], [0.5, NEVER]]
