"""`moa bench`: the whole benchmark on a tiny random target and an offline tokenizer (no downloads)."""

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import moa_hf
from moa_hf import bench
from moa_hf.chat import encode_chat
from moa_hf.cli import main
from moa_hf.modeling import TargetStates, cache_argument

from factory import make_independent, make_target

HAS_EAGLE = importlib.util.find_spec("moa_hf.modeling.modeling_eagle") is not None
WORDS = [f"w{i}" for i in range(122)]  # ids 6..127: the tiny target's vocabulary is 128
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QUESTIONS = [  # a repeated phrase gives prompt lookup something to find
    {"question_id": 81, "category": "writing", "turns": ["w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2", "ignored"]},
    {"question_id": 201, "category": "translation", "turns": ["w9 w8 w7 w9 w8 w7 w9 w8 w7 w10 w11"]},
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<|user|>": 4, "<|assistant|>": 5}
    vocab.update({w: i + 6 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_eagle(target):
    from moa_hf.modeling.configuration_eagle import EagleDrafterConfig
    from moa_hf.modeling.modeling_eagle import EagleDrafterModel

    torch.manual_seed(2)
    return EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config)).eval()


def write_questions(path, rows=QUESTIONS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def questions_list():
    return [{"question_id": q["question_id"], "category": bench.category_of(q["category"]), "prompt": q["turns"][0]}
            for q in QUESTIONS]  # fmt: skip


def honest_methods(target) -> list[bench.BenchMethod]:
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target).eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0  # random drafter: always draft 5 tokens
    methods = [
        bench.vanilla_method(),
        bench.drafter_method("moa", drafter),
        bench.drafter_method("moa_lookup", _with_lookup(moa_hf.build_drafter(target).eval())),
        bench.independent_method("independent", make_independent()),
        bench.pld_method(4),
    ]
    if HAS_EAGLE:
        methods.append(bench.drafter_method("eagle", make_eagle(target)))
    return methods


def _with_lookup(drafter, tokens: int = 4):
    drafter.config.lookup_num_tokens = tokens
    drafter.config.lookup_min_ngram = 1
    return drafter


def _no_hooks_left(model) -> bool:
    return not (model._forward_hooks or model._forward_pre_hooks)


# ---------------------------------------------------------------------------------------------------------------------
def test_load_questions_groups_mt_bench_and_samples_deterministically(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate(
        ["writing", "math", "coding", "qa", "qa", "qa", "rag", "translation", "qa"], start=81)]  # fmt: skip
    path = write_questions(tmp_path / "q.jsonl", rows)
    a = bench.load_questions(path, per_category=2, seed=3)
    assert a == bench.load_questions(path, per_category=2, seed=3)
    cats = [q["category"] for q in a]
    assert cats == ["mt_bench", "mt_bench", "translation", "qa", "qa", "rag"]  # Spec-Bench order, 2 per category
    assert {q["question_id"] for q in a if q["category"] == "mt_bench"} <= {81, 82, 83}
    assert len(bench.load_questions(path, per_category=0)) == len(rows)
    assert {q["prompt"] for q in a} <= {r["turns"][0] for r in rows}
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(bench.BenchError, match="category"):
        bench.load_questions(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("alpha,gamma", [(0.0, 3.0), (0.3, 4.0), (0.8, 5.0), (0.95, 2.5)])
def test_alpha_bisection_inverts_expected_length(alpha, gamma):
    length = bench.expected_length(alpha, gamma)
    solved = bench.solve_alpha(length, gamma)
    assert solved == pytest.approx(alpha, abs=1e-9)
    assert bench.speedup_bound(solved, gamma, 0.0) == pytest.approx(length)
    assert bench.speedup_bound(solved, gamma, 0.5) == pytest.approx(length / (0.5 * gamma + 1))
    assert bench.solve_alpha(gamma + 1.0, gamma) == 1.0 and bench.solve_alpha(1.0, gamma) == 0.0


def test_run_benchmark_metrics_and_records():
    target, tokenizer = make_target(), make_tokenizer()
    methods = honest_methods(target)
    result = bench.run_benchmark(
        target, tokenizer, questions_list(), methods, max_new_tokens=12, warmup=1, repeats=2, progress=False
    )
    assert _no_hooks_left(target)
    names = [m.name for m in methods]
    records = result["records"]
    assert len(records) == len(QUESTIONS) * 2 * len(methods)
    # interleaved: the first method differs between (question, repeat) slots
    firsts = [r["method"] for r in records if r["order"] == 0]
    assert len(set(firsts)) == min(len(methods), len(firsts))
    for r in records:
        assert r["new_tokens"] == 12 and r["time_s"] > 0 and r["target_calls"] >= 1
        assert r["matches_vanilla"], r  # fp32 target: every honest method reproduces greedy decoding
    summary = result["methods"]
    assert list(summary) == names
    vanilla = summary["vanilla"]["overall"]
    assert vanilla["acceptance_length"] == 1.0 and vanilla["speedup"] == 1.0
    assert vanilla["theoretical_speedup"] == 1.0 and vanilla["gamma"] == 0.0 and vanilla["cost_ratio"] == 0.0
    for name in names:
        entry = summary[name]
        assert set(entry["per_category"]) == {"mt_bench", "translation"}
        for values in [entry["overall"], *entry["per_category"].values()]:
            assert 1.0 <= values["acceptance_length"] <= 1.0 + max(values["gamma"], 0.0) + 1e-9
            assert values["tokens_per_s"] > 0 and values["speedup"] > 0 and values["theoretical_speedup"] > 0
            assert 0.0 <= values["alpha"] <= 1.0 and values["cost_ratio"] >= 0.0
        for cat in entry["per_category"]:
            assert summary["vanilla"]["per_category"][cat]["acceptance_length"] == 1.0
    for name in ("moa", "independent") + (("eagle",) if HAS_EAGLE else ()):
        overall = summary[name]["overall"]
        assert overall["drafted_tokens"] > 0 and overall["gamma"] > 0 and overall["cost_ratio"] > 0
    for r in records:
        if r["method"] == "moa":  # what the target verified (counted on its side) is what the drafter drafted
            assert r["verified_draft_tokens"] == r["drafted_tokens"] > 0
    pld = summary["pld"]["overall"]
    assert pld["drafted_tokens"] == 0 and pld["cost_ratio"] == 0.0
    assert pld["acceptance_length"] > 1.0  # the repeated phrases are found in the prompt


def _logit_bias_method() -> bench.BenchMethod:
    """Breaks losslessness: a hook that pushes the target's logits towards token 7."""

    @contextlib.contextmanager
    def context(target):
        def hook(module, args, kwargs, output):
            output.logits[..., 7] += 1e4

        handle = target.register_forward_hook(hook, with_kwargs=True)
        try:
            yield None
        finally:
            handle.remove()

    return bench.BenchMethod("logit_bias", context)


def _cache_corrupting_method() -> bench.BenchMethod:
    """Breaks losslessness: a PLD 'drafter' that scrambles the target's cached values of layer 0 after each call."""

    @contextlib.contextmanager
    def context(target):
        def hook(module, args, kwargs, output):
            cache = cache_argument(kwargs)
            if cache is not None:
                values = cache.layers[0].values  # [B, Hkv, T, hd]
                values.copy_(values.flip(-2))

        handle = target.register_forward_hook(hook, with_kwargs=True)
        try:
            yield None
        finally:
            handle.remove()

    return bench.BenchMethod("cache_corruptor", context, {"prompt_lookup_num_tokens": 3})


def test_check_catches_broken_methods_and_passes_honest_ones():
    target, tokenizer = make_target(), make_tokenizer()
    methods = honest_methods(target) + [_logit_bias_method(), _cache_corrupting_method()]
    check = bench.check_lossless(target, tokenizer, questions_list(), methods, max_new_tokens=10, progress=False)
    assert _no_hooks_left(target)
    assert "vanilla" not in check
    for name in [m.name for m in methods if m.name != "vanilla"]:
        entry = check[name]
        assert entry["questions"] == len(QUESTIONS)
        if name in ("logit_bias", "cache_corruptor"):
            assert not entry["passed"], name
            first = entry["mismatches"][0]
            assert first["question_id"] in {q["question_id"] for q in QUESTIONS}
            assert 0 <= first["position"] < 10 and first["expected"] != first["got"]
        else:
            assert entry["passed"] and entry["mismatches"] == [], (name, entry)
    text = bench.format_markdown({"methods": {}, "check": check})
    assert "logit_bias: FAIL" in text and "moa: PASS" in text


def test_run_benchmark_needs_vanilla_and_unique_names():
    target, tokenizer = make_target(), make_tokenizer()
    with pytest.raises(bench.BenchError, match="vanilla"):
        bench.run_benchmark(target, tokenizer, questions_list(), [bench.pld_method()], progress=False)
    with pytest.raises(bench.BenchError, match="unique"):
        bench.run_benchmark(
            target, tokenizer, questions_list(), [bench.vanilla_method(), bench.vanilla_method()], progress=False
        )


def test_cli_errors_say_how_to_fix(tmp_path, capsys):
    questions = write_questions(tmp_path / "q.jsonl")
    assert main(["bench", "--questions", str(questions), "--methods", "vanilla,eagle"]) == 2
    assert "moa train --kind eagle" in capsys.readouterr().err
    assert main(["bench", "--questions", str(questions), "--methods", "vanilla,independent"]) == 2
    assert "--kind independent" in capsys.readouterr().err
    assert main(["bench", "--questions", str(questions), "--methods", "vanilla,bogus"]) == 2
    assert "Unknown method" in capsys.readouterr().err
    assert main(["bench", "--questions", str(tmp_path / "missing.jsonl"), "--methods", "vanilla"]) == 2
    assert "--questions" in capsys.readouterr().err
    target_dir = tmp_path / "tiny-random-llama"
    assert main(["bench", "--questions", str(questions), "--target", str(target_dir), "--methods", "vanilla"]) == 2
    assert "not a saved model folder" in capsys.readouterr().err


def test_cli_end_to_end(tmp_path, capsys):
    target, tokenizer = make_target(), make_tokenizer()
    target_dir = tmp_path / "tiny-random-llama"  # the drafters record this target name
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    torch.manual_seed(0)
    _with_lookup(moa_hf.build_drafter(target)).save_pretrained(tmp_path / "moa")
    make_independent().save_pretrained(tmp_path / "independent")
    methods, extra = "vanilla,moa,moa_nolookup,independent,pld", []
    if HAS_EAGLE:
        make_eagle(target).save_pretrained(tmp_path / "eagle")
        methods, extra = methods + ",eagle", ["--eagle", str(tmp_path / "eagle")]
    out = tmp_path / "out"
    argv = [
        "bench", "--questions", str(write_questions(tmp_path / "q.jsonl")), "--target", str(target_dir),
        "--dtype", "bfloat16", "--max-new-tokens", "8", "--methods", methods, "--moa", str(tmp_path / "moa"),
        "--independent", str(tmp_path / "independent"), "--pld-tokens", "4", "--warmup", "1", "--repeats", "1",
        "--output", str(out), "--check", "--no-progress", "--seed", "1", *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| method | acceptance length | tokens/s | speedup | bound |" in stdout
    assert "### mt_bench" in stdout and "### translation" in stdout and "moa: PASS" in stdout
    data = json.loads((out / "bench.json").read_text())
    assert set(data["hardware"]) >= {"cpu", "cores", "torch", "device", "threads"}
    assert data["hardware"]["device"] == "cpu" and data["hardware"]["cores"] >= 1
    flags = " ".join(data["hardware"]["cpu_flags"]) or "none of avx2, avx512, amx"
    assert f"(CPU flags: {flags};" in stdout  # every figure names the CPU kind it was measured on
    assert data["dtype"] == "bfloat16" and data["max_new_tokens"] == 8 and data["date"]
    assert data["target"].rstrip("/").endswith("tiny-random-llama")
    assert list(data["methods"]) == methods.split(",")
    for entry in data["methods"].values():
        for values in [entry["overall"], *entry["per_category"].values()]:
            assert {"acceptance_length", "tokens_per_s", "speedup", "theoretical_speedup"} <= set(values)
            assert {"alpha", "gamma", "cost_ratio"} <= set(values)
        assert set(entry["per_category"]) == {"mt_bench", "translation"}
    assert data["methods"]["vanilla"]["overall"]["acceptance_length"] == 1.0
    assert data["methods"]["vanilla"]["overall"]["speedup"] == 1.0
    assert data["methods"]["independent"]["info"]["num_assistant_tokens"] == 3  # as saved with the drafter
    assert data["methods"]["moa"]["info"]["lookup_num_tokens"] == 4  # as saved
    assert data["methods"]["moa_nolookup"]["info"]["lookup_num_tokens"] == 0  # the same drafter, lookup off
    assert len(data["records"]) == len(QUESTIONS) * len(data["methods"])
    record_keys = {"method", "question_id", "category", "new_tokens", "time_s", "target_calls", "drafted_tokens"}
    assert all(record_keys | {"draft_time_s", "repeat"} <= set(r) for r in data["records"])
    assert all(entry["passed"] for entry in data["check"].values()) and "vanilla" not in data["check"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "bench.md").read_text().startswith("## moa bench")
    from moa_hf.hub_cards import load_benchmark

    assert load_benchmark(out / "bench.json")["methods"]["moa"]["overall"]["speedup"] > 0  # what hub cards consume


# ---------------------------------------------------------------------------------------------------------------------
# The tree engine's methods and the batch section
# ---------------------------------------------------------------------------------------------------------------------
BATCH_QUESTIONS = [  # prompts of different lengths: left padding in every batch
    {"question_id": 1, "category": "qa", "prompt": "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3"},
    {"question_id": 2, "category": "qa", "prompt": "w9 w8"},
    {"question_id": 3, "category": "rag", "prompt": "w20 w21 w22 w20 w21 w22 w20"},
]


def engine_methods(target, drafters: list | None = None) -> list[bench.BenchMethod]:
    """vanilla, then the engine's methods, each with its own random drafter whose prompt lookup is on (appended to
    `drafters`). A fixed tree shape: with the automatic one the engine finds that a random drafter's trees do not pay
    and verifies none."""
    methods = [bench.vanilla_method()]
    drafters = [] if drafters is None else drafters
    for name, settings in bench.ENGINE_METHODS.items():
        torch.manual_seed(0)
        drafters.append(_with_lookup(moa_hf.build_drafter(target).eval()))
        shape = {"tree_depth": 3, "tree_top_k": 2, "tree_budget": 6, **settings}
        methods.append(bench.engine_method(name, drafters[-1], shape))
    return methods


def test_engine_methods_record_tree_statistics_and_reproduce_greedy():
    target, tokenizer = make_target(), make_tokenizer()
    drafters = []
    methods = engine_methods(target, drafters)
    result = bench.run_benchmark(
        target, tokenizer, questions_list(), methods, max_new_tokens=12, warmup=1, repeats=1, progress=False
    )
    assert _no_hooks_left(target)
    assert not any(d.is_attached for d in drafters)  # attached around each call only
    engine_keys = {"verify_time_s", "cycles", "mean_tree_size", "lookup_tokens", "engine_mean_accepted_length"}
    for r in result["records"]:
        assert r["matches_vanilla"], r  # fp32 target: the engine reproduces greedy decoding
        assert r["new_tokens"] == 12
        if r["method"] == "vanilla":
            assert not engine_keys & set(r)
            continue
        assert engine_keys <= set(r)
        # acceptance length: new tokens per target call, the prefill included, as the engine counts it
        assert r["target_calls"] == r["cycles"] + 1
        assert r["new_tokens"] / r["target_calls"] == pytest.approx(r["engine_mean_accepted_length"])
        assert r["drafted_tokens"] >= r["verified_draft_tokens"] > 0 and r["draft_time_s"] > 0
        assert r["verify_time_s"] > 0 and r["mean_tree_size"] == r["verified_draft_tokens"] / r["cycles"]
        if r["method"] != "moa_tree":
            assert r["lookup_tokens"] == 0  # lookup=False
    summary = result["methods"]
    assert summary["vanilla"]["overall"]["mean_tree_size"] is None
    for name in bench.ENGINE_METHODS:
        overall = summary[name]["overall"]
        assert overall["mean_tree_size"] > 0 and overall["verify_time_s"] > 0
        assert 1.0 <= overall["acceptance_length"] and summary[name]["info"]["engine"]
    assert summary["moa_chain"]["info"]["settings"] == {
        "tree_depth": 3, "tree_top_k": 1, "tree_budget": 6, "lookup": False
    }  # fmt: skip
    assert max(r["mean_tree_size"] for r in result["records"] if r["method"] == "moa_chain") <= 3  # a chain: depth
    costs = summary["moa_tree"]["info"]["costs"]  # what the engine measured on this machine
    assert costs is None or (set(costs) == {"verify", "step"} and costs["verify"])
    text = bench.format_markdown({"methods": summary, "max_new_tokens": 12})
    assert "### tree engine" in text and "| moa_chain |" in text and "top-k 1" in text and "lookup off" in text


def test_check_covers_the_engine_methods():
    target, tokenizer = make_target(), make_tokenizer()
    methods = engine_methods(target) + [_logit_bias_method()]
    check = bench.check_lossless(target, tokenizer, questions_list(), methods, max_new_tokens=10, progress=False)
    for name in bench.ENGINE_METHODS:
        assert check[name]["passed"] and check[name]["questions"] == len(QUESTIONS), (name, check[name])
    assert not check["logit_bias"]["passed"]  # the check can fail


def test_build_methods_makes_the_engine_methods_from_the_moa_drafter(tmp_path):
    target = make_target()
    torch.manual_seed(0)
    _with_lookup(moa_hf.build_drafter(target)).save_pretrained(tmp_path / "moa")
    names = ["vanilla", "moa", "moa_tree", "moa_tree_nolookup", "moa_chain"]
    methods = bench.build_methods(names, target, {"moa": str(tmp_path / "moa")})
    assert [m.name for m in methods] == names
    for method in methods[2:]:
        assert method.info["engine"] and method.info["drafter"] == str(tmp_path / "moa")
        assert method.info["lookup_num_tokens"] == 4  # the same drafter, its config untouched
    assert [m.info["settings"]["lookup"] for m in methods[2:]] == [None, False, False]
    assert [m.info["settings"]["tree_top_k"] for m in methods[2:]] == [None, None, 1]
    with pytest.raises(bench.BenchError, match="needs a drafter"):
        bench.build_methods(["vanilla", "moa_tree"], target, {"moa": None})


def test_real_new_tokens_stop_at_each_rows_eos():
    sequences = torch.tensor(
        [
            [0, 5, 6, 7, 8, 2, 0, 0],  # EOS (2) at the 4th new token, then padding
            [5, 5, 6, 2, 2, 2, 2, 2],  # EOS first, then more EOS (pad = eos)
            [5, 5, 6, 7, 8, 9, 10, 11],  # no EOS: all new tokens
        ]
    )  # [B=3, P=2 + N=6]
    assert bench.real_new_tokens(sequences, 2, [2]) == [4, 2, 6]
    assert bench.real_new_tokens(sequences, 2, [9, 2]) == [4, 2, 4]
    assert bench.real_new_tokens(sequences, 2, []) == [6, 6, 6]


def test_run_batches_rows_count_only_real_tokens():
    target, tokenizer = make_target(), make_tokenizer()
    torch.manual_seed(0)
    drafter = _with_lookup(moa_hf.build_drafter(target).eval())
    # make a token the target writes in the middle of one answer its EOS: that row stops early and is padded
    batch = encode_chat(tokenizer, [q["prompt"] for q in BATCH_QUESTIONS], target.device)
    width = batch["input_ids"].shape[1]
    assert (batch["attention_mask"][:, 0] == 0).any() and batch["attention_mask"][:, -1].all()  # left padding
    answers = target.generate(**batch, do_sample=False, max_new_tokens=8, pad_token_id=0)[:, width:]  # [3, 8]
    target.generation_config.eos_token_id = int(answers[1, 3])
    shape = {"tree_depth": 3, "tree_top_k": 2, "tree_budget": 6}  # automatic: no tree pays for a random drafter
    rows = bench.run_batches(
        target,
        tokenizer,
        BATCH_QUESTIONS,
        drafter,
        [1, 2],
        max_new_tokens=8,
        repeats=2,
        settings=shape,
        progress=False,
    )
    assert _no_hooks_left(target) and not drafter.is_attached
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert [(r["batches"], r["rows"]) for r in rows] == [(3, 3), (2, 4)]  # the last batch of 2 wraps around
    for row in rows:
        vanilla, engine = row["vanilla"], row["engine"]
        assert row["prompt_tokens"]["min"] < row["prompt_tokens"]["max"]
        assert row["identical_rows"] == row["rows"]  # fp32: the engine's rows equal the target's
        assert engine["new_tokens"] == vanilla["new_tokens"] < 2 * row["rows"] * 8  # EOS and padding not counted
        assert vanilla["tokens_per_s"] > 0 and engine["tokens_per_s"] > 0 and row["speedup"] > 0
        assert engine["acceptance_length"] == pytest.approx(engine["new_tokens"] / engine["target_calls"])
        assert engine["acceptance_length"] <= shape["tree_depth"] + 1  # a call accepts at most a path and one token
        assert 0 < engine["mean_tree_size"] <= shape["tree_budget"]
        assert engine["settings"] == shape and engine["target_calls"] >= engine["batch_calls"] > 0
    text = bench.format_markdown({"methods": {}, "batch": rows})
    assert "| batch | vanilla tokens/s | engine tokens/s | speedup |" in text and "| 2 |" in text


def _saved_target_and_moa(tmp_path) -> Path:
    """A tiny random target with its tokenizer in tmp_path/tiny-random-llama and a MoA drafter for it (prompt lookup
    on) in tmp_path/moa; returns the target's folder."""
    target, tokenizer = make_target(), make_tokenizer()
    target_dir = tmp_path / "tiny-random-llama"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    torch.manual_seed(0)
    _with_lookup(moa_hf.build_drafter(target)).save_pretrained(tmp_path / "moa")
    return target_dir


def test_cli_engine_methods_check_and_batches(tmp_path, capsys):
    target_dir, out = _saved_target_and_moa(tmp_path), tmp_path / "out"
    methods = "vanilla,moa_tree,moa_tree_nolookup,moa_chain"
    argv = [
        "bench", "--questions", str(write_questions(tmp_path / "q.jsonl")), "--target", str(target_dir),
        "--dtype", "bfloat16", "--max-new-tokens", "6", "--methods", methods, "--moa", str(tmp_path / "moa"),
        "--warmup", "1", "--output", str(out), "--check", "--no-progress", "--batch-sizes", "1,2",
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "### tree engine" in stdout and "moa_chain: PASS" in stdout and "| batch |" in stdout
    data = json.loads((out / "bench.json").read_text())
    assert list(data["methods"]) == methods.split(",")
    assert all(data["check"][name]["passed"] for name in bench.ENGINE_METHODS)
    assert [row["batch_size"] for row in data["batch"]] == [1, 2]
    assert all(row["engine"]["tokens_per_s"] > 0 for row in data["batch"])
    assert main([*argv[:-1], "1,x"]) == 2 and "--batch-sizes" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Method variants: an engine method's fixed tree shape (`@DxKxB`) and the context vectors zeroed (`_nocontext`)
# ---------------------------------------------------------------------------------------------------------------------
def test_method_variants_parse_and_refuse_what_does_not_apply(tmp_path):
    shape = {"tree_depth": 6, "tree_top_k": 8, "tree_budget": 24}
    assert bench.method_variant("moa_tree_nolookup@6x8x24") == bench.MethodVariant("moa_tree_nolookup", shape)
    assert bench.method_variant("moa_tree_nolookup@6x8x24_nocontext").no_context
    assert bench.method_variant("moa_nolookup_nocontext") == bench.MethodVariant("moa_nolookup", None, True)
    assert bench.method_variant("moa") == bench.MethodVariant("moa")
    assert bench.method_kind("moa_tree@2x2x4_nocontext") == "moa"
    paths = {"moa": "default"}
    names = "moa_nolookup,moa_nolookup_nocontext,moa_tree_nolookup@6x8x24,moa_chain@5x1x5,moa_tree@2x2x4_nocontext"
    assert bench.resolve_method_names(names, paths) == ["vanilla", *names.split(",")]
    refused = {
        "moa@6x8x24": "engine's methods",  # assisted generation drafts chains
        "moa_chain@5x2x8": "top-k 1",
        "moa_tree@0x2x4": "positive",
        "pld_nocontext": "has none",
        "moa_tree@6x8": "Unknown method",  # a shape is three numbers
    }
    for name, message in refused.items():
        with pytest.raises(bench.BenchError, match=message):
            bench.resolve_method_names(f"vanilla,{name}", paths)


def test_build_methods_fix_the_tree_shape_and_zero_the_context_inside_the_method_only(tmp_path):
    target = make_target()
    torch.manual_seed(0)
    _with_lookup(moa_hf.build_drafter(target)).save_pretrained(tmp_path / "moa")
    names = ["moa_nolookup_nocontext", "moa_tree_nolookup@3x2x6", "moa_tree_nolookup@3x2x6_nocontext"]
    methods = bench.build_methods(names, target, {"moa": str(tmp_path / "moa")})
    assert methods[1].info["settings"] == {"tree_depth": 3, "tree_top_k": 2, "tree_budget": 6, "lookup": False}
    assert methods[2].info["settings"] == methods[1].info["settings"] and methods[2].info["engine"]
    assert methods[0].info["lookup_num_tokens"] == 0  # the base method's config override still applies
    assert [m.info.get("context") for m in methods] == ["zeroed", None, "zeroed"]
    cfg = target.config
    kv = torch.randn(
        1, 3, cfg.num_hidden_layers, 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    )
    zeroed_drafter = methods[0].generate_kwargs["assistant_model"]
    with torch.no_grad():
        states = TargetStates(kv)
        assert zeroed_drafter.compute_context(states).abs().sum() > 0  # outside the method: the target's state
        with methods[0].context(target):
            assert zeroed_drafter.is_attached and zeroed_drafter.compute_context(states).abs().sum() == 0
        assert not zeroed_drafter.is_attached and zeroed_drafter.compute_context(states).abs().sum() > 0
    if HAS_EAGLE:
        make_eagle(target).save_pretrained(tmp_path / "eagle")
        with pytest.raises(bench.BenchError, match="no context vectors"):
            bench.build_methods(["eagle_nocontext"], target, {"eagle": str(tmp_path / "eagle")})


def test_report_gives_the_share_of_the_gain_from_the_target():
    assert bench.context_share(1.5, 1.2) == pytest.approx(0.6)
    assert bench.context_share(1.0, 1.0) is None and bench.context_share(1.4, None) is None

    def entry(length):
        return {"overall": {"acceptance_length": length, "tokens_per_s": 1.0, "speedup": 1.0,
                            "theoretical_speedup": None, "alpha": None, "gamma": None, "cost_ratio": None},
                "per_category": {}, "info": {}}  # fmt: skip

    methods = {"vanilla": entry(1.0), "moa_nolookup": entry(1.5), "moa_nolookup_nocontext": entry(1.2)}
    text = bench.format_markdown({"methods": methods, "max_new_tokens": 8})
    assert "### the target's state" in text and "| moa_nolookup | 1.50 | 1.20 | 60% |" in text
    del methods["moa_nolookup"]  # no pair: no table
    assert "### the target's state" not in bench.format_markdown({"methods": methods, "max_new_tokens": 8})


def test_cli_variants_end_to_end_and_lossless(tmp_path, capsys):
    target_dir, out = _saved_target_and_moa(tmp_path), tmp_path / "out"
    methods = "vanilla,moa_nolookup,moa_nolookup_nocontext,moa_tree_nolookup@3x2x6,moa_tree_nolookup@3x2x6_nocontext"
    argv = [
        "bench", "--questions", str(write_questions(tmp_path / "q.jsonl")), "--target", str(target_dir),
        "--dtype", "bfloat16", "--max-new-tokens", "6", "--methods", methods, "--moa", str(tmp_path / "moa"),
        "--warmup", "0", "--output", str(out), "--check", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "### the target's state" in stdout and "| moa_tree_nolookup@3x2x6 |" in stdout
    data = json.loads((out / "bench.json").read_text())
    assert list(data["methods"]) == methods.split(",")
    assert all(entry["passed"] for entry in data["check"].values()) and len(data["check"]) == 4
    assert data["methods"]["moa_tree_nolookup@3x2x6_nocontext"]["info"]["settings"]["tree_budget"] == 6
    assert data["methods"]["moa_nolookup_nocontext"]["info"]["context"] == "zeroed"
    for name in ("moa_nolookup_nocontext", "moa_tree_nolookup@3x2x6_nocontext"):  # what the run itself records
        assert (
            data["methods"][name]["info"]["drafter_target"]
            == data["methods"]["moa_nolookup"]["info"]["drafter_target"]
        )
    assert main([*argv[:10], "vanilla,moa@3x2x6", *argv[11:]]) == 2 and "engine's methods" in capsys.readouterr().err


@pytest.mark.parametrize("hidden", [False, True])
def test_moa_costs_reports_the_engines_measured_costs(hidden):
    """hidden: a drafter whose context reads the target's final hidden states too (`context_final_hidden`)."""
    from moa_hf.costs import measure_costs

    target = make_target()
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, context_final_hidden=hidden, ca_latest_context=hidden).eval()
    ids = torch.randint(3, 128, (1, 24))  # [1, T]
    with moa_hf.attached(drafter, target):
        result = measure_costs(target, drafter, ids, repeats=2, gen_tokens=8)
    assert _no_hooks_left(target)
    engine = result["engine"]
    assert list(engine["target_verify_over_decode_step"]) == [1, 2, 4, 8, 16, 32, 64]
    assert engine["target_verify_over_decode_step"][1] == 1.0  # relative to one decode step
    assert {1, 4, 8} <= set(engine["drafter_depth_over_decode_step"])
    assert all(v > 0 for v in [*engine["target_verify_ms"].values(), *engine["drafter_depth_ms"].values()])
    # 8 new tokens over the prefill's target call and one per cycle (no EOS in 8 tokens of this target)
    assert engine["cycles"] >= 1 and engine["mean_accepted_length"] == pytest.approx(8 / (engine["cycles"] + 1))
    # the cycles' time outside the two models' forwards: some (tree building, acceptance, bookkeeping), and part of
    # the measured generation's wall time (per cycle: draft + verify + the rest)
    wall_per_cycle = sum(engine[f"{k}_per_cycle_ms"] for k in ("draft_time", "verify_time", "overhead"))
    assert 0 < engine["loop_per_cycle_ms"] < wall_per_cycle
    assert set(engine["shape_policy"]["arm_cycles"]) == {"none/tree", "none/chain", "plain"}
    json.dumps(result)  # `moa costs` prints it as JSON


def test_default_questions_path_is_the_shared_folder_beside_the_checkout():
    from moa_hf.bench import default_questions_path

    root = Path(__file__).resolve().parents[1]  # the checkout (tests/ is at its top)
    assert default_questions_path() == root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
