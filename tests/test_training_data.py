"""Training data: the offline prompt source, prompt loading (Spec-Bench refused), on-policy dataset building with
resume, and the `moa data` / `moa train` commands end to end (tiny random target, no downloads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from safetensors import safe_open

from moa_hf.cli import main as moa_main
from moa_hf.modeling import MoADrafterModel
from moa_hf.training import (
    SpecBenchPromptsError,
    build_dataset,
    default_prompts,
    format_prompts,
    load_prompts,
    written_briefs,
)
from moa_hf.training.data import _tidy_material
from moa_hf.training.shards import join_shards, take_part, write_shards

from factory import tiny_target, tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_target(initializer_range=0.02, logit_scale=30.0)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# ---------------------------------------------------------------------------------------------------------------------
# Offline prompts
# ---------------------------------------------------------------------------------------------------------------------
def test_default_prompts_are_varied_deterministic_and_split():
    train = default_prompts(600)
    assert len(train) == len(set(train)) == 600
    assert default_prompts(600) == train and default_prompts(600, seed=1) != train
    val = default_prompts(100, split="validation")
    assert len(val) == 100 and not set(val) & set(default_prompts(5000))
    families = {
        "stdlib": lambda p: "`" in p,
        "math": lambda p: any(w in p for w in ("Solve for", "multiplied", "km in", "prime", "rectangle", "saves")),
        "story": lambda p: any(w in p for w in ("story", "poem", "novel")),
        "code": lambda p: any(w in p for w in ("function in", "program", "code that", "unit tests")),
        "chat": lambda p: any(w in p for w in ("tips", "How do I", "email", "plan", "mistakes")),
    }
    for name, test in families.items():
        assert sum(map(test, train)) >= 30, name
    assert any("language reference" in p for p in val)
    docs = default_prompts(60, split="documents")
    assert len(docs) == len(set(docs)) == 60 and default_prompts(60, split="documents") == docs
    assert not set(docs) & (set(val) | set(default_prompts(5000)))
    assert sum(len(p) > 1500 for p in docs) >= 20  # long passages the answer draws on
    for task in ("Summarise", "answer the question", "List the rules", "Translate", "Rewrite"):
        assert sum(p.startswith(task) or task in p[:80] for p in docs) >= 4, task
    test = default_prompts(split="test")  # frozen, reporting only: its own families, none of another split's
    assert len(test) == len(set(test)) == 200 and default_prompts(split="test") == test
    everything_else = set(val) | set(docs) | set(default_prompts(5000)) | set(default_prompts(2000, "validation"))
    assert not set(default_prompts(3000, split="test")) & everything_else
    assert sum("Explain the difference" in p for p in test) >= 10 and sum("litres" in p for p in test) >= 10
    with pytest.raises(ValueError, match="split"):
        default_prompts(3, split="heldout")


def test_written_briefs_are_distinct_deterministic_and_held_apart():
    briefs = written_briefs(300)
    assert briefs == written_briefs(300) and briefs != written_briefs(300, seed=1)
    assert len({(b.brief, b.task) for b in briefs}) == 300
    passages = [b for b in briefs if b.task is not None]
    assert 150 <= len(passages) <= 250  # about two thirds passages, one third user questions
    assert all("{text}" in b.task for b in passages)
    assert len({b.task for b in passages}) >= 8 and len({b.brief for b in briefs}) >= 250
    held_out = " ".join(default_prompts(200, split="validation") + default_prompts(100, split="documents"))
    assert not any(b.brief in held_out for b in briefs)
    with pytest.raises(ValueError, match="distinct written briefs"):
        written_briefs(10**6)


def test_tidy_material():
    assert _tidy_material('A customer might ask: "How do I change my flight to an earlier one?"', question=True) == (
        "How do I change my flight to an earlier one?"
    )
    assert _tidy_material("  How do I keep basil alive?  ", question=True) == "How do I keep basil alive?"
    cut = _tidy_material("The bridge opened on Monday. It has four lanes. Traffic was light and the may", False)
    assert cut == "The bridge opened on Monday. It has four lanes."
    assert _tidy_material("One. Two three four five six seven eight nine ten", False).endswith("ten")  # no early cut


def test_written_prompts_dataset(tmp_path, target, tokenizer):
    with pytest.raises(ValueError, match="written by the target"):
        load_prompts("default:written")
    with pytest.raises(ValueError, match="number of prompts"):
        build_dataset(target, tokenizer, "default:written", tmp_path / "x", max_new_tokens=4, progress=False)
    kw = dict(max_new_tokens=6, batch_size=4, num_prompts=12, progress=False)
    ds = build_dataset(target, tokenizer, "default:written", tmp_path / "w", **kw)
    saved = json.loads((tmp_path / "w" / "written_prompts.json").read_text())
    prompts = saved["prompts"]
    assert load_prompts(tmp_path / "w" / "written_prompts.jsonl") == prompts  # a prompt file for `--part` runs
    assert saved["num_prompts"] == 12 and len(ds) == len(prompts) and 6 <= len(prompts) <= 12
    briefs = written_briefs(12)
    tasks = [b.task.split("{text}")[0] for b in briefs if b.task is not None]
    assert sum(any(p.startswith(t) and len(p) >= len(t) + 40 for t in tasks) for p in prompts) >= 3  # material inside
    assert not any(b.brief in p for b in briefs for p in prompts)  # the briefs themselves are not prompts
    for row, ids in zip(ds, format_prompts(tokenizer, prompts)):
        assert row["input_ids"][: row["prompt_length"]] == ids
    again = build_dataset(target, tokenizer, "default:written", tmp_path / "w2", **kw)
    assert json.loads((tmp_path / "w2" / "written_prompts.json").read_text())["prompts"] == prompts  # seeded
    (tmp_path / "w" / "moa_data.json").unlink()
    resumed = build_dataset(target, tokenizer, "default:written", tmp_path / "w", **kw)  # reuses the material
    assert resumed["input_ids"] == ds["input_ids"] == again["input_ids"]


# ---------------------------------------------------------------------------------------------------------------------
# Prompt sources
# ---------------------------------------------------------------------------------------------------------------------
def test_load_prompts_sources(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "first"}\n\n{"turns": ["second", "ignored"]}\n{"text": "third", "prompt": "x"}\n')
    assert load_prompts(jsonl) == ["first", "second", "x"]
    assert load_prompts(jsonl, num_prompts=2) == ["first", "second"]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\nthree\n")
    assert load_prompts(txt) == ["one", "two", "three"]
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"question": ["q1", "q2"], "other": [1, 2]}).save_to_disk(str(folder))
    assert load_prompts(folder) == ["q1", "q2"]
    with pytest.raises(KeyError, match="nope"):
        load_prompts(folder, column="nope")
    assert load_prompts("default", num_prompts=5) == default_prompts(5)
    assert load_prompts("default:validation", num_prompts=5) == default_prompts(5, split="validation")


def test_evaluation_benchmark_prompts_are_refused(tmp_path):
    record = {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post."]}
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps(record) + "\n")
    with pytest.raises(SpecBenchPromptsError, match="evaluation only"):
        load_prompts(bench)
    named = tmp_path / "spec_bench" / "prompts.txt"
    named.parent.mkdir()
    named.write_text("a harmless prompt\n")
    with pytest.raises(SpecBenchPromptsError):
        load_prompts(named)
    folder = tmp_path / "renamed"
    datasets.Dataset.from_dict({k: [v] for k, v in record.items()}).save_to_disk(str(folder))
    with pytest.raises(SpecBenchPromptsError):
        load_prompts(folder)
    target, tokenizer = tiny_target(), tiny_tokenizer()
    with pytest.raises(SpecBenchPromptsError):
        build_dataset(target, tokenizer, str(bench), tmp_path / "out", max_new_tokens=2)
    ok = tmp_path / "fine.jsonl"  # the same prompt without Spec-Bench's record layout is accepted
    ok.write_text(json.dumps({"prompt": record["turns"][0]}) + "\n")
    assert load_prompts(ok) == record["turns"]


# ---------------------------------------------------------------------------------------------------------------------
# Dataset building
# ---------------------------------------------------------------------------------------------------------------------
def test_build_dataset_matches_unbatched_greedy_and_resumes(tmp_path, target, tokenizer):
    prompts = [
        "Hi",
        "What is the capital of France?",
        "Write a poem about the sea, please.",
        "2+2?",
        "Tell me a joke",
        "x",
        "Summarise: the quick brown fox jumps over the lazy dog.",
        "ok",
    ]
    out = tmp_path / "data"
    ds = build_dataset(target, tokenizer, prompts, out, max_new_tokens=12, batch_size=3, shard_size=3, progress=False)
    assert ds.column_names == ["input_ids", "prompt_length", "prompt_index"]
    assert ds["prompt_index"] == list(range(len(prompts)))
    prompt_ids = format_prompts(tokenizer, prompts)
    for row, ids in zip(ds, prompt_ids):
        assert row["input_ids"][: row["prompt_length"]] == ids
        alone = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, pad_token_id=0)[0].tolist()
        response = alone[len(ids) :]
        if 1 in response:  # eos ends the response
            response = response[: response.index(1) + 1]
        assert row["input_ids"][row["prompt_length"] :] == response  # left padding does not change the answer
    assert datasets.load_from_disk(str(out))["input_ids"] == ds["input_ids"]
    meta = json.loads((out / "moa_data.json").read_text())
    assert meta["num_examples"] == len(prompts)

    # interrupted run: the last shard and the final dataset are missing; finished shards are reused untouched
    shards = sorted((out / "shards").glob("shard-*"))
    assert len(shards) == 3
    import shutil

    shutil.rmtree(shards[-1])
    stamps = {p.name: os.stat(p / "state.json").st_mtime_ns for p in shards[:-1]}
    again = build_dataset(
        target, tokenizer, prompts, out, max_new_tokens=12, batch_size=3, shard_size=3, progress=False
    )
    assert again["input_ids"] == ds["input_ids"]
    assert {p.name: os.stat(p / "state.json").st_mtime_ns for p in shards[:-1]} == stamps
    parts = [
        build_dataset(
            target,
            tokenizer,
            prompts,
            tmp_path / f"part{k}",
            max_new_tokens=12,
            batch_size=3,
            part=(k, 2),
            progress=False,
        )
        for k in range(2)
    ]
    assert [p["prompt_index"] for p in parts] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for p in parts:
        for row in p:
            assert row["input_ids"] == ds[row["prompt_index"]]["input_ids"]
    with pytest.raises(ValueError, match="other prompts"):
        build_dataset(
            target, tokenizer, prompts[:-1], out, max_new_tokens=12, batch_size=3, shard_size=3, progress=False
        )


def test_build_dataset_max_shards_answers_the_first_shards_then_the_rest(tmp_path, target, tokenizer):
    """`max_shards` (`moa data --max-shards K`): a budget on a long prompt list. The dataset holds the first K shards'
    answers (the same as a full run's); a later run with a larger K keeps them and answers the next ones."""
    prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(7)]
    kw = dict(max_new_tokens=6, batch_size=2, shard_size=2, progress=False)
    full = build_dataset(target, tokenizer, prompts, tmp_path / "full", **kw)
    out = tmp_path / "budget"
    first = build_dataset(target, tokenizer, prompts, out, max_shards=2, **kw)
    assert first["prompt_index"] == [0, 1, 2, 3] and first["input_ids"] == full["input_ids"][:4]
    assert sorted(p.name for p in (out / "shards").iterdir() if p.is_dir()) == ["shard-000000", "shard-000001"]
    meta = json.loads((out / "moa_data.json").read_text())
    assert (meta["shards_answered"], meta["shards_in_list"], meta["num_examples"]) == (2, 4, 4)
    stamps = {p.name: os.stat(p / "state.json").st_mtime_ns for p in (out / "shards").glob("shard-*")}
    more = build_dataset(target, tokenizer, prompts, out, max_shards=9, **kw)  # beyond the list: all of it
    assert more["input_ids"] == full["input_ids"]
    assert {n: os.stat(out / "shards" / n / "state.json").st_mtime_ns for n in stamps} == stamps
    with pytest.raises(ValueError, match="max_shards"):
        build_dataset(target, tokenizer, prompts, out, max_shards=0, **kw)


def test_shard_writer_writes_only_missing_shards_and_enters_the_engine_for_them(tmp_path):
    """`shards.write_shards`, the one writer of prompt data and conversations: shard k holds items [k*size, (k+1)*size)
    as `make_shard` gives them, only the first `max_shards`; a finished shard is never made again, and the engine is
    entered once, around the missing shards only; other inputs (fingerprint) are refused."""
    calls, entered = [], []

    class Engine:
        def __enter__(self):
            entered.append(True)
            return "answerer"

        def __exit__(self, *exc):
            return False

    def make_shard(k, lo, hi, answerer, advance):
        calls.append((k, lo, hi, answerer))
        advance(hi - lo)
        return {"input_ids": [[i, i + 1] for i in range(lo, hi)], "prompt_length": [1] * (hi - lo)}

    kw = dict(max_shards=2, engine=Engine(), progress=False)
    assert write_shards(tmp_path, "fp", 7, 3, make_shard, **kw) == (2, 3)
    assert calls == [(0, 0, 3, "answerer"), (1, 3, 6, "answerer")] and len(entered) == 1
    assert write_shards(tmp_path, "fp", 7, 3, make_shard, **kw) == (2, 3)  # all there: nothing made, no engine
    assert len(calls) == 2 and len(entered) == 1
    assert write_shards(tmp_path, "fp", 7, 3, make_shard, engine=Engine(), progress=False) == (3, 3)
    assert calls[2:] == [(2, 6, 7, "answerer")] and len(entered) == 2
    assert join_shards(tmp_path, 3, progress=False)["input_ids"] == [[i, i + 1] for i in range(7)]
    with pytest.raises(ValueError, match="other prompts"):
        write_shards(tmp_path, "other", 7, 3, make_shard, progress=False)
    assert take_part(list("abcdefg"), (1, 3)) == (["b", "e"], 1, 3)
    assert take_part(list("ab"), None) == (["a", "b"], 0, 1)


def test_build_dataset_sampling_is_seeded(tmp_path, target, tokenizer):
    kw = dict(max_new_tokens=10, batch_size=4, do_sample=True, temperature=1.5, progress=False)
    a = build_dataset(target, tokenizer, ["a", "b", "c"], tmp_path / "a", seed=1, **kw)
    b = build_dataset(target, tokenizer, ["a", "b", "c"], tmp_path / "b", seed=1, **kw)
    c = build_dataset(target, tokenizer, ["a", "b", "c"], tmp_path / "c", seed=2, **kw)
    greedy = build_dataset(target, tokenizer, ["a", "b", "c"], tmp_path / "g", max_new_tokens=10, progress=False)
    assert a["input_ids"] == b["input_ids"]  # same seed, same samples
    assert a["input_ids"] != c["input_ids"] and a["input_ids"] != greedy["input_ids"]  # it does sample


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _saved_keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as st:
        return set(st.keys())


def test_cli_data_then_train(tmp_path, target, tokenizer, capsys):
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p[:40].replace("\n", " ") for p in default_prompts(24)) + "\n")
    data = tmp_path / "data"
    assert (
        moa_main(
            [
                "data",
                "--target",
                str(folder),
                "--prompts",
                str(prompts),
                "--output",
                str(data),
                "--max-new-tokens",
                "8",
                "--batch-size",
                "8",
                "--num-prompts",
                "16",
                "--quiet",
            ]
        )
        == 0
    )
    assert len(datasets.load_from_disk(str(data))) == 16
    out = tmp_path / "drafter"
    assert (
        moa_main(
            [
                "train",
                "--target",
                str(folder),
                "--data",
                str(data),
                "--output",
                str(out),
                "--max-steps",
                "4",
                "--batch-size",
                "4",
                "--grad-accum",
                "2",
                "--lr",
                "1e-3",
                "--cpu",
                "--quiet",
                "--save-steps",
                "2",
                "--eval-prompts",
                str(prompts),
                "--eval-num-prompts",
                "2",
                "--eval-max-new-tokens",
                "6",
                "--eval-steps",
                "2",
                "--logging-steps",
                "1",
                "--eval-data",
                str(data),
            ]
        )
        == 0
    )
    drafter = MoADrafterModel.from_pretrained(out)
    assert (out / "generation_config.json").exists() and (out / "config.json").exists()
    assert _saved_keys(out / "model.safetensors") == set(drafter.state_dict())
    assert not any(k.startswith(("model.", "lm_head", "embed_tokens")) for k in _saved_keys(out / "model.safetensors"))
    info = json.loads((out / "training_info.json").read_text())
    # 6 new tokens per prompt take the prefill and at least one verification: at most 6 / 2 per target call
    assert info["steps"] == 4 and info["tokens"] > 0 and 1.0 <= info["acceptance_length_heldout"] <= 6 / 2
    assert 0.0 <= info["top1_heldout"] <= 1.0 and 0.0 <= info["top1_first_heldout"] <= 1.0
    assert (out / "checkpoint-4").is_dir()
    # resume from the latest checkpoint with more steps
    assert (
        moa_main(
            [
                "train",
                "--target",
                str(folder),
                "--data",
                str(data),
                "--output",
                str(out),
                "--max-steps",
                "6",
                "--batch-size",
                "4",
                "--cpu",
                "--quiet",
                "--resume",
                "--eval-prompts",
                "none",
                "--save-steps",
                "100",
            ]
        )
        == 0
    )
    assert json.loads((out / "training_info.json").read_text())["steps"] == 6


def _parsed(argv: list[str]) -> tuple:
    from moa_hf.cli import build_parser
    from moa_hf.training.cli import data_arguments, train_arguments

    args = build_parser().parse_args(argv)
    return train_arguments(args) if args.command == "train" else data_arguments(args)


def test_train_help_lists_every_training_argument(capsys):
    """`moa train` takes every `MoATrainingArguments` field (`HfArgumentParser`), in both spellings."""
    import dataclasses

    from moa_hf.training import MoATrainingArguments

    with pytest.raises(SystemExit):
        moa_main(["train", "--help"])
    text = capsys.readouterr().out
    names = [f.name for f in dataclasses.fields(MoATrainingArguments) if f.init]
    assert len(names) > 100 and {"min_cycle", "sa_curriculum", "learning_rate", "eval_acceptance_steps"} <= set(names)
    for name in names:
        assert f"--{name} " in text or f"--{name}," in text, name
        assert "_" not in name or f"--{name.replace('_', '-')}" in text, name


def test_makefile_flags_parse_to_the_right_fields(tmp_path):
    """The hyphenated flags of the Makefile's `data` and `drafters` targets (and the README's) keep their meaning."""
    target, data, drafter, training = _parsed([
        "train", "--target", "default", "--dtype", "bfloat16", "--data", "runs/data", "runs/written",
        "--states", "runs/states", "--max-steps", "480", "--batch-size", "8", "--lr", "1e-3", "--warmup-steps", "10",
        "--min-cycle", "2", "--max-cycle", "8", "--eval-num-prompts", "8", "--eval-max-new-tokens", "64",
        "--save-steps", "100", "--save-total-limit", "1", "--kind", "moa", "--draft-vocab-size", "8192",
        "--lsa-hidden-size", "128", "--eval-steps", "60", "--output", str(tmp_path / "moa"),
    ])  # fmt: skip
    assert (target.target, target.dtype) == ("default", "bfloat16")
    assert data.data == ["runs/data", "runs/written"] and data.states == ["runs/states"]
    assert (drafter.kind, drafter.draft_vocab_size, drafter.lsa_hidden_size) == ("moa", 8192, 128)
    assert training.output_dir == str(tmp_path / "moa") and training.max_steps == 480
    assert training.per_device_train_batch_size == training.per_device_eval_batch_size == 8
    assert training.learning_rate == 1e-3 and training.warmup_steps == 10
    assert (training.min_cycle, training.max_cycle) == (2, 8)
    assert (training.eval_num_prompts, training.eval_max_new_tokens) == (8, 64)
    assert (training.save_steps, training.save_total_limit) == (100, 1)
    # no --eval-data: --eval-steps is the period of the acceptance length on held-out prompts
    assert training.eval_acceptance_steps == 60 and training.eval_strategy == "no"
    # the command's own defaults (not TrainingArguments')
    assert (training.lr_scheduler_type, training.max_grad_norm, training.seed) == ("cosine", 0.5, 0)
    assert training.include_num_input_tokens_seen == "non_padding" and training.report_to == []

    *_, training = _parsed(
        [
            "train",
            "--target",
            "t",
            "--data",
            "d",
            "--output",
            "o",
            "--max_steps",
            "6",
            "--cpu",
            "--quiet",
            "--resume",
            "--grad-accum",
            "2",
            "--lr-scheduler",
            "linear",
            "--num-workers",
            "1",
            "--eval-data",
            "e",
            "--eval_steps",
            "3",
            "--per_device_eval_batch_size",
            "2",
        ]
    )
    assert training.use_cpu and training.disable_tqdm and training.resume_from_checkpoint == "latest"
    assert (training.gradient_accumulation_steps, training.lr_scheduler_type) == (2, "linear")
    assert training.dataloader_num_workers == 1 and training.per_device_eval_batch_size == 2
    assert training.eval_strategy == "steps" and training.eval_steps == 3 and training.eval_acceptance_steps is None
    with pytest.raises(ValueError, match="--max-steps"):
        _parsed(["train", "--target", "t", "--data", "d", "--output", "o"])

    target, data_args = _parsed([
        "data", "--target", "default", "--dtype", "bfloat16", "--prompts", "default:written", "--num-prompts", "100",
        "--max-new-tokens", "256", "--batch-size", "64", "--shard-size", "64", "--output", "runs/written",
        "--part", "1/4", "--do-sample", "--no-chat-template",
    ])  # fmt: skip
    assert (data_args.prompts, data_args.num_prompts, data_args.max_new_tokens) == ("default:written", 100, 256)
    assert (data_args.batch_size, data_args.shard_size, data_args.output) == (64, 64, "runs/written")
    assert data_args.part_indices() == (1, 4) and data_args.do_sample and data_args.no_chat_template
