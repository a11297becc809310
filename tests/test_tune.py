"""`moa tune`: speculation settings measured per setting against the target alone, the best one written on request."""

import json
import random

import pytest
import torch
from transformers import AutoModel

import moa_hf
from moa_hf.cli import main as moa_main
from moa_hf.prompts import SpecBenchPromptsError
from moa_hf.training import build_for_kind
from moa_hf.tune import SETTING_KEYS, TuneError, format_tuning_markdown, tune_speculation

from factory import OracleDrafter, make_target, tiny_target, tiny_tokenizer


def _no_hooks(model: torch.nn.Module) -> bool:
    return not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.mark.parametrize("kind", ["moa", "eagle", "independent"])
def test_one_row_per_setting_baseline_one_and_config_restored(kind):
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = build_for_kind(kind, target).eval()
    drafter.generation_config.num_assistant_tokens = 7  # outside the grid: must come back as it was
    config, before = drafter.generation_config, drafter.generation_config.to_dict()
    result = tune_speculation(
        target,
        drafter,
        _prompts(2),
        num_assistant_tokens=(1, 3),
        thresholds=(0.0, 0.5),
        schedules=("constant", "heuristic"),
        max_new_tokens=12,
        progress=False,
    )
    assert drafter.generation_config is config and config.to_dict() == before
    assert _no_hooks(target) and not getattr(drafter, "is_attached", False)
    settings = {tuple(row[k] for k in SETTING_KEYS) for row in result["rows"]}
    assert len(result["rows"]) == 8 and len(settings) == 8
    assert result["baseline"]["acceptance_length"] == 1.0 and result["baseline"]["new_tokens"] == 24
    for row in result["rows"]:
        assert row["new_tokens"] == 24 and row["identical_outputs"] == 2  # lossless: the target's greedy output
        assert row["acceptance_length"] == row["new_tokens"] / row["target_calls"] <= 12 / 2  # prefill + a cycle
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert result["best"] in result["rows"]
    assert result["best"]["speedup"] == max(row["speedup"] for row in result["rows"])
    if kind != "independent":  # a near-uniform random drafter stops after one token under a 0.5 threshold
        drafted = {tuple(r[k] for k in SETTING_KEYS[:3]): r["drafted_tokens"] for r in result["rows"]}
        assert drafted[(3, 0.5, "constant")] < drafted[(3, 0.0, "constant")]
    table = format_tuning_markdown(result)
    assert table.count("\n| ") == 1 + 8 + 1 and "**" in table  # header, baseline + 8 rows, best in bold


def test_oracle_acceptance_grows_with_draft_length():
    target = make_target("llama")
    prompt = _prompts(1, seed=3)[0]
    reference = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0].tolist()
    base = moa_hf.build_drafter(target).eval()
    oracle = OracleDrafter(base.config).eval()
    oracle.load_state_dict(base.state_dict())
    oracle.reference, oracle.p_right, oracle.rng = reference, 1.0, random.Random(0)  # always the target's token
    result = tune_speculation(
        target,
        oracle,
        [prompt],
        num_assistant_tokens=(1, 2, 4, 8),
        thresholds=(0.0, 0.5),
        max_new_tokens=40,
        progress=False,
    )
    assert result["baseline"]["acceptance_length"] == 1.0
    for threshold in (0.0, 0.5):  # the oracle is sure of its tokens: the threshold never stops it
        acc = [r["acceptance_length"] for r in result["rows"] if r["assistant_confidence_threshold"] == threshold]
        assert len(acc) == 4 and acc[0] > 1.0
        assert all(a < b for a, b in zip(acc, acc[1:])), acc
    assert all(r["identical_outputs"] == 1 for r in result["rows"])
    assert _no_hooks(target)


class _Broken(OracleDrafter):
    def draft_step(self, new_ids, cache):
        raise RuntimeError("drafter failure")


def test_failure_removes_hooks_and_restores_config():
    target = make_target("llama")
    drafter = _Broken(moa_hf.build_drafter(target).config).eval()
    config, before = drafter.generation_config, drafter.generation_config.to_dict()
    with pytest.raises(RuntimeError, match="drafter failure"):
        tune_speculation(
            target,
            drafter,
            _prompts(1),
            num_assistant_tokens=(4,),
            thresholds=(0.0,),
            max_new_tokens=6,
            progress=False,
        )
    assert drafter.generation_config is config and config.to_dict() == before
    assert _no_hooks(target) and not drafter.is_attached
    with pytest.raises(TuneError, match="num_assistant_tokens"):
        tune_speculation(target, drafter, _prompts(1), num_assistant_tokens=(0,), progress=False)


@pytest.fixture
def saved(tmp_path):
    target, tokenizer = tiny_target(logit_scale=30.0), tiny_tokenizer()
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target)
    drafter.generation_config.num_assistant_tokens = 7  # outside the grid below
    drafter.generation_config.assistant_confidence_threshold = 0.25
    drafter.save_pretrained(drafter_dir)
    drafter.generation_config.save_pretrained(drafter_dir)
    return target_dir, drafter_dir


def test_cli_tune_writes_tuning_json_and_best_setting(saved, capsys):
    target_dir, drafter_dir = saved
    args = [
        "tune",
        "--target",
        str(target_dir),
        "--drafter",
        str(drafter_dir),
        "--device",
        "cpu",
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--num-assistant-tokens",
        "2,4",
        "--thresholds",
        "0,0.5",
        "--quiet",
    ]
    gc_file = drafter_dir / "generation_config.json"
    original = json.loads(gc_file.read_text())
    assert moa_main(args) == 0
    assert json.loads(gc_file.read_text()) == original  # no --write: untouched
    tuning = json.loads((drafter_dir / "tuning.json").read_text())
    assert tuning["kind"] == "moa" and len(tuning["rows"]) == 4
    assert tuning["prompts"] == ["default:validation", "default:documents"] and tuning["num_prompts"] == 4
    assert "| (target alone) |" in capsys.readouterr().out
    assert moa_main([*args, "--write"]) == 0
    tuning = json.loads((drafter_dir / "tuning.json").read_text())
    written = json.loads(gc_file.read_text())
    assert {k: written[k] for k in SETTING_KEYS[:3]} == {k: tuning["best"][k] for k in SETTING_KEYS[:3]}
    config_file = drafter_dir / "config.json"
    assert json.loads(config_file.read_text()).get("lookup_num_tokens", 0) == 0  # lookup off (the grid's default)
    assert not any("lookup" in key for key in written)  # prompt lookup lives in config.json
    assert written["num_assistant_tokens"] in (2, 4) and written["assistant_confidence_threshold"] in (0.0, 0.5)
    assert tuning["written"] is True
    halving = [
        *args[:-5],
        "--num-assistant-tokens",
        "4",
        "--thresholds",
        "0",
        "--lookup-tokens",
        "4",
        "--lookup-halve-per-ngram",
        "1",
        "--quiet",
        "--write",
    ]
    assert moa_main(halving) == 0
    written = json.loads(config_file.read_text())
    assert (written["lookup_num_tokens"], written["lookup_halve_per_ngram"]) == (4, True)
    assert AutoModel.from_pretrained(drafter_dir).config.lookup_halve_per_ngram is True


def test_cli_tune_refuses_spec_bench(tmp_path):
    with pytest.raises(SpecBenchPromptsError):  # by name, before anything is loaded
        moa_main(["tune", "--target", "missing", "--drafter", "missing", "--prompts", "spec_bench/question.jsonl"])
    renamed = tmp_path / "questions.jsonl"
    renamed.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem."]}) + "\n")
    with pytest.raises(SpecBenchPromptsError):  # by its records
        moa_main(["tune", "--target", "missing", "--drafter", "missing", "--prompts", str(renamed)])
    with pytest.raises(SpecBenchPromptsError):  # any of several sources
        moa_main(
            [
                "tune",
                "--target",
                "missing",
                "--drafter",
                "missing",
                "--prompts",
                "default:validation",
                "spec_bench/question.jsonl",
            ]
        )


def test_lookup_axis_for_moa_and_refused_elsewhere():
    """Prompt lookup is part of the MoA grid: on a repetitive prompt it lifts acceptance; other drafters refuse it."""
    target = make_target("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11] * 3
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target).eval()
    result = tune_speculation(
        target,
        drafter,
        [prompt],
        num_assistant_tokens=(6,),
        thresholds=(0.0,),
        lookup_tokens=(0, 6),
        lookup_min_ngrams=(1, 3),
        max_new_tokens=30,
        progress=False,
    )
    rows = {(r["lookup_num_tokens"], r["lookup_min_ngram"]): r for r in result["rows"]}
    assert set(rows) == {(0, None), (6, 1), (6, 3)}  # lookup off once, not once per minimum n-gram
    assert rows[(6, 1)]["acceptance_length"] > rows[(0, None)]["acceptance_length"]
    assert all(r["identical_outputs"] == 1 for r in result["rows"])
    assert "off" in format_tuning_markdown(result) and "6 (1)" in format_tuning_markdown(result)
    halving = tune_speculation(
        target,
        drafter,
        [prompt],
        num_assistant_tokens=(6,),
        thresholds=(0.0,),
        lookup_tokens=(0, 6),
        lookup_halving=(False, True),
        max_new_tokens=30,
        progress=False,
    )
    keys = {(r["lookup_num_tokens"], r["lookup_halve_per_ngram"]) for r in halving["rows"]}
    assert keys == {(0, False), (6, False), (6, True)}  # halving is a lookup setting: off once
    assert "6 (1, halving)" in format_tuning_markdown(halving)
    assert drafter.config.lookup_halve_per_ngram is False  # put back after tuning
    assert drafter.config.lookup_num_tokens == 0 and drafter.config.lookup_min_ngram == 1
    with pytest.raises(TuneError, match="lookup_max_ngram"):  # a minimum n-gram above the drafter's longest
        tune_speculation(target, drafter, [prompt], lookup_tokens=(4,), lookup_min_ngrams=(4,), progress=False)
    eagle = build_for_kind("eagle", target).eval()
    with pytest.raises(TuneError, match="no prompt lookup"):
        tune_speculation(target, eagle, [prompt], lookup_tokens=(4,), progress=False)
