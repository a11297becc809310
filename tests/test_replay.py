"""The exact replay of greedy chain decoding (`moa_hf.training.replay`) against real `generate`, and the
acceptance-led training options it selects between (hard CE, depth weights, on-policy cycle starts)."""

from __future__ import annotations

import datasets
import pytest
import torch

import moa_hf
from moa_hf.training import MoATrainer
from moa_hf.training.cycles import on_policy_restarts
from moa_hf.training.losses import hard_cross_entropy
from moa_hf.training.replay import (
    ChainRule,
    DraftTable,
    bootstrap_interval,
    check_replay,
    draft_tables,
    parse_rules,
    replay,
    replay_chain,
)

from factory import random_dataset, tiny_target, tiny_training_args

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def loopy_target():
    return tiny_target(initializer_range=0.02, logit_scale=30.0)  # peaky, repetitive greedy continuations


def _drafter(target, seed=0, **overrides):
    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, **overrides).eval()
    with torch.no_grad():  # start close to the target: its own embedding read back by its head drafts its loops
        for p in drafter.parameters():
            if p.dim() == 2 and p.requires_grad:
                p.mul_(0.3)
    return drafter


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 100, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.mark.parametrize(
    "options",
    [{}, {"draft_vocab_size": 64}, {"ca_latest_context": True, "context_final_hidden": True}],
    ids=["plain", "draft_vocab", "latest_and_final_hidden"],
)
@pytest.mark.parametrize("rule", [ChainRule(1, 0.0), ChainRule(5, 0.0), ChainRule(8, 0.3)], ids=str)
def test_replay_equals_real_generate_per_prompt(loopy_target, options, rule):
    """float32: the replay's target calls equal real assisted generation's, prompt by prompt."""
    drafter = _drafter(loopy_target, **options)
    if options.get("draft_vocab_size"):
        drafter.init_draft_vocab(torch.arange(3, 67), loopy_target.get_output_embeddings().weight)
    result = check_replay(drafter, loopy_target, _prompts(6), 30, rule, pad_token_id=0)
    assert result["replay_calls"] == result["real_calls"], result
    assert result["replay_new_tokens"] == result["real_new_tokens"]
    assert result["disagreements"] == 0
    assert result["replay_tokens_per_call"] == pytest.approx(result["real_tokens_per_call"])
    if rule.max_tokens > 1:  # the drafts were accepted sometimes: the comparison had something to compare
        assert result["real_tokens_per_call"] > 1.05, result


def test_first_cycle_reads_no_context_on_the_assistant_path(loopy_target):
    """The first drafting call runs before the target: a replay that gives the first cycle the prompt's context
    (the engine's order) predicts other first drafts."""
    drafter = _drafter(loopy_target, ca_latest_context=True)
    seqs = [list(p) + [5] * 12 for p in _prompts(8, seed=3)]
    lengths = [len(p) for p in _prompts(8, seed=3)]
    without = draft_tables(drafter, loopy_target, seqs, lengths, 12, depth=4)
    with_ctx = draft_tables(drafter, loopy_target, seqs, lengths, 12, depth=4, first_cycle_context=True)
    assert any(not torch.equal(a.confidence[0], b.confidence[0]) for a, b in zip(without, with_ctx))
    for a, b in zip(without, with_ctx):  # every later cycle is the same
        assert torch.equal(a.confidence[1:], b.confidence[1:]) and torch.equal(a.hits[1:], b.hits[1:])


def test_replay_chain_rules_by_hand():
    K = 4
    hits = torch.tensor(
        [[True, True, False, True], [False] * 4, [True] * 4, [True, False, False, False]] + [[False] * 4] * 4
    )
    conf = torch.full((8, K), 0.9)
    conf[0, 1] = 0.1  # low confidence after the second draft of the first cycle
    table = DraftTable(
        prompt_length=3, length=11, max_length=11, hits=hits, confidence=conf, eos=torch.zeros(8, K, dtype=torch.bool)
    )
    # no threshold: cycle at s=2 accepts 2 -> s=5 (row 3) accepts 1 -> s=7 (row 5) 0 -> 8 -> 9 (limit 0) -> 10
    assert replay_chain(table, ChainRule(4, 0.0))[:2] == (8, 5)
    # threshold 0.3: the first cycle stops after its second (accepted) draft: the same path here
    assert replay_chain(table, ChainRule(4, 0.3))[:2] == (8, 5)
    # one token per chain: s=2 accepts 1 -> 4 (row 2) accepts 1 -> 6 (row 4) 0 -> 7 -> 8 -> 9 -> 10
    assert replay_chain(table, ChainRule(1, 0.0))[:2] == (8, 6)
    with pytest.raises(ValueError, match="depth"):
        replay_chain(table, ChainRule(5, 0.0))
    result = replay([table, table], ChainRule(4, 0.0))
    assert result.tokens_per_call == pytest.approx(16 / 10)
    assert result.reached[0] == 8 and result.accepted[0] == 4  # 4 cycles drafting per sequence, 2 first drafts right


def test_parse_rules_and_bootstrap():
    assert parse_rules("24:0.3, 8:0,4") == [ChainRule(24, 0.3), ChainRule(8, 0.0), ChainRule(4, 0.0)]
    for bad in ("", "x:0.3", "0:0.1", "4:1.5"):
        with pytest.raises(ValueError):
            parse_rules(bad)
    lo, hi = bootstrap_interval([96] * 20, [48] * 10 + [60] * 10)
    assert lo < 96 * 20 / (48 * 10 + 60 * 10) < hi and hi - lo < 0.4
    assert bootstrap_interval([96] * 5, [48] * 5) == (2.0, 2.0)


def test_unsupported_drafters_are_refused(loopy_target):
    for overrides, match in (
        ({"num_blocks": 2}, "2 blocks"),
        ({"target_layer_inference": 1}, "target_layer_inference"),
    ):
        with pytest.raises(ValueError, match=match):
            draft_tables(_drafter(loopy_target, **overrides), loopy_target, [[3, 4, 5, 6]], [2], 2, depth=2)


def test_on_policy_restarts_follow_first_draft_misses():
    hits = torch.tensor([[False, False, True, True, True, True, False, True, True, True, True, True]])
    restarts = on_policy_restarts(torch.tensor([3]), torch.tensor([3]), hits, torch.tensor([12]))
    # prompt positions 0-2; s=2 hits -> 5 hits -> 8 hits -> 11
    assert restarts[0].nonzero().flatten().tolist() == [0, 1, 2, 5, 8, 11]
    hits[0, 5] = False  # a miss at 5: the next cycle starts at 6, which misses too: 7
    restarts = on_policy_restarts(torch.tensor([3]), torch.tensor([3]), hits, torch.tensor([12]))
    assert restarts[0].nonzero().flatten().tolist() == [0, 1, 2, 5, 6, 7, 10]


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    "options",
    [{"hard_ce_weight": 1.0}, {"depth_decay": 0.8}, {"cycle_starts": "on_policy"}],
    ids=["hard_ce", "depth_decay", "on_policy"],
)
def test_acceptance_led_options_change_the_loss(tmp_path, loopy_target, options):
    base = dict(max_steps=2, soft_ce_weight=1.0, feature_weight=0.1, mask_outside_draft_vocab=True)
    data = random_dataset(8)
    runs = []
    for extra in ({}, options):
        args = tiny_training_args(tmp_path, **base, **extra)
        drafter = _drafter(loopy_target, draft_vocab_size=64)
        trainer = MoATrainer(model=drafter, target=loopy_target, args=args, train_dataset=data)
        trainer.train()
        runs.append(_losses(trainer))
    assert all(torch.isfinite(torch.tensor(r)).all() for r in runs)
    assert runs[0] != runs[1]


def test_hard_cross_entropy_over_the_draft_vocabulary(tmp_path, loopy_target):
    drafter = _drafter(loopy_target, draft_vocab_size=64)
    drafter.init_draft_vocab(torch.arange(3, 67), loopy_target.get_output_embeddings().weight)
    trainer = MoATrainer(
        model=drafter, target=loopy_target, args=tiny_training_args(tmp_path), train_dataset=random_dataset(4)
    )
    student = torch.randn(5, drafter.config.hidden_size)
    labels = torch.tensor([3, 10, 66, 67, 99])  # the last two are outside the draft vocabulary
    head, draft_ids = trainer.adapter.student_head(drafter)
    ce = hard_cross_entropy(head, draft_ids, drafter.config.vocab_size, student, labels, chunk=2)
    logits = drafter.draft_logits(student)
    expected = torch.nn.functional.cross_entropy(logits[:3], labels[:3] - 3, reduction="none")
    torch.testing.assert_close(ce[:3], expected)
    assert ce[3:].eq(0).all()


def test_replay_eval_callback_logs_and_selects(tmp_path, loopy_target):
    """`--eval-data` of greedy answers: each evaluation logs the replay's tokens per call, equal to a direct replay."""
    prompts = _prompts(4, seed=7)
    rows = []
    for p in prompts:
        out = loopy_target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        rows.append(out[0].tolist())
    eval_data = datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": [len(p) for p in prompts]})
    args = tiny_training_args(
        tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, eval_replay_rules="4:0,2:0.3"
    )
    drafter = _drafter(loopy_target)
    trainer = MoATrainer(
        model=drafter, target=loopy_target, args=args, train_dataset=random_dataset(8), eval_dataset=eval_data
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "eval_replay_tokens_per_call" in h]
    assert [h["step"] for h in logged] == [2]
    metrics = trainer.evaluate()
    assert metrics["eval_replay_tokens_per_call"] == logged[0]["eval_replay_tokens_per_call"]  # no training since
    tables = draft_tables(drafter.eval(), loopy_target, rows, [len(p) for p in prompts], 16, depth=4)
    assert metrics["eval_replay_tokens_per_call"] == pytest.approx(replay(tables, ChainRule(4, 0.0)).tokens_per_call)
    assert metrics["eval_replay_k2_t0.3"] == pytest.approx(replay(tables, ChainRule(2, 0.3)).tokens_per_call)


@pytest.mark.parametrize("base", [1, 2])
def test_deep_windows_give_the_staircase_tables(loopy_target, monkeypatch, base):
    """Depths past the first `_BASE_PERIOD` are drafted only in packed windows after runs of right drafts: the
    reachable entries and every replay equal those of one staircase pass per depth."""
    import moa_hf.training.replay as replay_module

    drafter = _drafter(loopy_target, ca_latest_context=True)
    prompts = _prompts(8, seed=11)
    seqs = [loopy_target.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0].tolist() for p in prompts]
    lengths = [len(p) for p in prompts]
    monkeypatch.setattr(replay_module, "_BASE_PERIOD", 8)  # one staircase pass per depth
    full = draft_tables(drafter, loopy_target, seqs, lengths, 40, depth=8)
    monkeypatch.setattr(replay_module, "_BASE_PERIOD", base)
    packed = draft_tables(drafter, loopy_target, seqs, lengths, 40, depth=8)
    for rule in (ChainRule(8, 0.0), ChainRule(8, 0.3), ChainRule(3, 0.0)):
        a, b = replay(full, rule), replay(packed, rule)
        assert a.calls == b.calls and a.reached == b.reached and a.accepted == b.accepted
    deep_hits = 0
    for f, p in zip(full, packed):
        reach = torch.cat([torch.ones(len(f.hits), 1, dtype=torch.bool), f.hits.cumprod(1).bool()[:, :-1]], 1)
        assert torch.equal(f.hits & reach, p.hits & reach)
        assert torch.equal(f.confidence[reach], p.confidence[reach])
        deep_hits += int((f.hits & reach)[:, base:].sum())
    assert deep_hits > 0  # windows were drafted and hit


def test_moa_replay_command(tmp_path, loopy_target):
    """`moa replay` on a saved target, drafter and `moa data`-style folder: its rules' figures equal `replay`'s, and
    `--check` compares with real decoding."""
    import json

    from moa_hf.cli import main

    loopy_target.save_pretrained(tmp_path / "target")
    drafter = _drafter(loopy_target)
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = _prompts(5, seed=13)
    rows = [loopy_target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0].tolist() for p in prompts]
    datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": [len(p) for p in prompts]}).save_to_disk(
        str(tmp_path / "answers")
    )
    (tmp_path / "answers" / "moa_data.json").write_text(json.dumps({"max_new_tokens": 20, "do_sample": False}))
    out = tmp_path / "replay.json"
    argv = ["replay", "--data", str(tmp_path / "answers"), "--target", str(tmp_path / "target")]
    argv += ["--drafter", str(tmp_path / "drafter"), "--dtype", "float32", "--rules", "6:0,3:0.3", "--check", "3"]
    assert main([*argv, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    tables = draft_tables(drafter, loopy_target, rows, [len(p) for p in prompts], 20, depth=6)
    for entry, rule in zip(report["rules"], (ChainRule(6, 0.0), ChainRule(3, 0.3))):
        assert entry["rule"] == str(rule)
        assert entry["tokens_per_call"] == pytest.approx(replay(tables, rule).tokens_per_call)
        lo, hi = entry["interval95"]
        assert lo <= entry["tokens_per_call"] <= hi
    assert report["check"]["real_calls"] == report["check"]["replay_calls"]
    assert report["answers"] == 5 and report["disagreements"] == 0
