"""Acceptance per unit of compute: cached target states, reduced draft vocabulary, target-layer initialisation, and
the peers trained by the same trainer (EAGLE-style drafter, independent LM)."""

from __future__ import annotations

import datasets
import pytest
import torch

import moa_hf
from moa_hf.training import MoATrainer, run_target
from moa_hf.training.builders import build_independent, frequent_tokens, init_from_target_layer
from moa_hf.training.drafters import ADAPTERS, adapter_for, adapter_named, build_for_kind, drafter_kind
from moa_hf.training.states import TargetStatesDataset, cache_target_states, load_target_states

from factory import random_dataset, tiny_target
from factory import tiny_training_args as make_args

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_cached_states_equal_the_targets_forward(tmp_path, target):
    data = random_dataset(7)
    folder = cache_target_states(target, data, tmp_path / "states", batch_size=3, max_length=20, progress=False)
    cached = TargetStatesDataset(data, folder, target)
    for i in (0, 3, 6):
        item = cached[i]
        ids = torch.tensor([data[i]["input_ids"][:20]])
        states = run_target(target, ids)
        assert len(item["input_ids"]) == ids.shape[1] == item["target_kv"].shape[0]
        torch.testing.assert_close(item["target_kv"].float(), states.kv[0].bfloat16().float())
        torch.testing.assert_close(item["final_hidden"].float(), states.final_hidden[0].bfloat16().float())
    assert cache_target_states(target, data, folder, progress=False) == folder  # reused, not recomputed
    with pytest.raises(ValueError, match="another dataset"):
        TargetStatesDataset(random_dataset(5), folder)
    with pytest.raises(ValueError, match="not by this target"):
        load_target_states(folder, tiny_target(num_hidden_layers=2))


def test_cached_states_say_their_size_and_refuse_a_disk_too_small(tmp_path, target, monkeypatch, caplog):
    import shutil
    from collections import namedtuple

    from moa_hf.training import states

    data = random_dataset(7)
    tokens = sum(len(ids) for ids in data["input_ids"])
    c = target.config
    L, W, d = c.num_hidden_layers, 2 * c.num_key_value_heads * c.head_dim, c.hidden_size
    size = states.states_bytes(tokens, L, W, d)
    assert size == 2 * tokens * (L * W + d)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * size, 9 * size, size - 1))
    with pytest.raises(ValueError, match="Train online instead"):
        cache_target_states(target, data, tmp_path / "states", progress=False)
    assert not list((tmp_path / "states").glob("*.npy"))  # refused before writing anything
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * size, 9 * size, size))
    cache_target_states(target, data, tmp_path / "states", progress=False)
    assert f"{size / 1e9:.2f} GB" in caplog.text
    on_disk = sum(f.stat().st_size for f in (tmp_path / "states").glob("*.npy"))
    assert size <= on_disk < size + 4096  # what was said is what was written (plus .npy headers)


def test_training_on_cached_states_matches_online_training(tmp_path, target):
    """The same steps on cached (bf16) states and on the live target give the same losses, up to bf16 rounding."""
    data = random_dataset(8)
    folder = cache_target_states(target, data, tmp_path / "states", progress=False)
    curves = []
    for train in (data, TargetStatesDataset(data, folder)):
        torch.manual_seed(0)
        drafter = moa_hf.build_drafter(target)
        trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path, max_steps=3), train_dataset=train)
        trainer.train()
        curves.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(curves[0]) == 3
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-2, atol=1e-3)


def test_cached_states_for_target_layer_inference(tmp_path, target):
    """With `tli_layers=2`, the states also hold the residual stream before the last 1 and 2 layers, and the last
    layers' keys/values split back out of `target_kv` are the target's own (what a TLI drafter attends to)."""
    data = random_dataset(5)
    folder = cache_target_states(target, data, tmp_path / "states", batch_size=2, progress=False, tli_layers=2)
    cached = TargetStatesDataset(data, folder, target)
    num_layers = target.config.num_hidden_layers
    for i in (0, 4):
        item = cached[i]
        ids = torch.tensor([data[i]["input_ids"]])
        assert item["tli_hidden"].shape == (ids.shape[1], 2, target.config.hidden_size)
        for n in (1, 2):
            states = run_target(target, ids, target_layer_inference=n)
            torch.testing.assert_close(item["tli_hidden"][:, n - 1].float(), states.feature[0].bfloat16().float())
            for layer, (k, v) in zip(range(num_layers - n, num_layers), states.tli_kv):
                keys, values = moa_hf.modeling.split_target_kv(item["target_kv"][None], layer, 2)
                torch.testing.assert_close(keys.float(), k.bfloat16().float())
                torch.testing.assert_close(values.float(), v.bfloat16().float())
    assert cache_target_states(target, data, folder, progress=False, tli_layers=1) == folder  # enough: reused
    with pytest.raises(ValueError, match="tli_layers=3"):
        cache_target_states(target, data, folder, progress=False, tli_layers=3)
    plain = cache_target_states(target, data, tmp_path / "plain", progress=False)
    assert "tli_hidden" not in TargetStatesDataset(data, plain)[0]


def test_target_layer_inference_trains_on_cached_states_like_online(tmp_path, target):
    """A TLI drafter (the target's last layer inside it) takes the same steps on cached states as with the live
    target, up to bf16 rounding; states cached without the layer inputs are refused with the fix."""
    data = random_dataset(8)
    folder = cache_target_states(target, data, tmp_path / "states", progress=False, tli_layers=1)
    curves = []
    for train in (data, TargetStatesDataset(data, folder)):
        torch.manual_seed(0)
        drafter = moa_hf.build_drafter(target, target_layer_inference=1)
        trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path, max_steps=3), train_dataset=train)
        trainer.train()
        curves.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(curves[0]) == 3
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-2, atol=1e-3)
    plain = TargetStatesDataset(data, cache_target_states(target, data, tmp_path / "plain", progress=False))
    drafter = moa_hf.build_drafter(target, target_layer_inference=1)
    trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path, max_steps=1), train_dataset=plain)
    with pytest.raises(ValueError, match="tli_layers=1"):
        trainer.train()


def test_frequent_tokens_counts_responses_only():
    data = datasets.Dataset.from_dict({"input_ids": [[9, 9, 9, 5, 5, 7], [9, 3, 5]], "prompt_length": [3, 1]})
    assert frequent_tokens(data, 2, vocab_size=10).tolist() == [3, 5]  # 5 x3; 3 and 7 x1, tie -> lower id
    assert frequent_tokens(data, 5, vocab_size=10).tolist() == [0, 1, 3, 5, 7]  # padded with unused ids


def test_draft_vocabulary_head_and_lossless_generation(target):
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, draft_vocab_size=16)
    ids = torch.arange(40, 56)
    drafter.init_draft_vocab(ids, target.get_output_embeddings().weight)
    drafter.attach(target)
    try:
        h = torch.randn(2, 3, target.config.hidden_size)
        full = drafter.head(h)  # [2, 3, V]
        assert full.shape == (2, 3, target.config.vocab_size)
        outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
        outside[ids] = False
        assert bool(torch.isinf(full[..., outside]).all()) and bool(torch.isfinite(full[..., ids]).all())
        expected = h @ target.get_output_embeddings().weight[ids].T  # draft head starts from the target's rows
        torch.testing.assert_close(drafter.draft_logits(h), expected)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(3, 100, (1, 6), generator=g)
            plain = target.generate(prompt, do_sample=False, max_new_tokens=20, attention_mask=torch.ones_like(prompt))
            spec = target.generate(
                prompt,
                do_sample=False,
                max_new_tokens=20,
                assistant_model=drafter,
                attention_mask=torch.ones_like(prompt),
            )
            assert torch.equal(plain, spec)
    finally:
        drafter.detach()
    with pytest.raises(ValueError, match="distinct"):
        drafter.init_draft_vocab(torch.zeros(16, dtype=torch.long), target.get_output_embeddings().weight)


def test_evaluation_top1_reads_the_draft_vocabulary(tmp_path, target):
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, draft_vocab_size=16)
    drafter.init_draft_vocab(torch.arange(40, 56), target.get_output_embeddings().weight)
    trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path))
    h = torch.randn(12, target.config.hidden_size)
    top = trainer.adapter.top1(trainer.drafter, h)
    assert torch.equal(top, drafter.head(h).argmax(-1)) and bool(((top >= 40) & (top < 56)).all())


def test_draft_vocabulary_survives_save_and_load(tmp_path, target):
    drafter = moa_hf.build_drafter(target, draft_vocab_size=8)
    drafter.init_draft_vocab(torch.arange(10, 18) * 3, target.get_output_embeddings().weight)
    drafter.save_pretrained(tmp_path)
    loaded = moa_hf.MoADrafterModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    torch.testing.assert_close(loaded.draft_head.weight, drafter.draft_head.weight)


def test_draft_vocabulary_drafter_trains_on_the_reduced_teacher(tmp_path, target):
    data = random_dataset(8)
    drafter = moa_hf.build_drafter(target, draft_vocab_size=32)
    drafter.init_draft_vocab(frequent_tokens(data, 32, 100), target.get_output_embeddings().weight)
    before = drafter.draft_head.weight.clone()
    trainer = MoATrainer(model=drafter, target=target, args=make_args(tmp_path, max_steps=3), train_dataset=data)
    trainer.train()
    assert not torch.equal(before, drafter.draft_head.weight)  # the draft head is trained
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_init_from_target_layer_copies_the_layer(target):
    drafter = moa_hf.build_drafter(target)
    copied = init_from_target_layer(drafter, target, -1)
    layer = target.model.layers[-1]
    assert copied >= 9 + 7
    torch.testing.assert_close(drafter.self_attention.self_attn.q_proj.weight, layer.self_attn.q_proj.weight)
    torch.testing.assert_close(drafter.cross_attention.mlp.down_proj.weight, layer.mlp.down_proj.weight)


def test_independent_lm_is_the_targets_first_layers(target):
    lm = build_independent(target, num_layers=target.config.num_hidden_layers)
    ids = torch.randint(3, 100, (2, 9))
    torch.testing.assert_close(lm(ids).logits, target(ids).logits)
    small = build_independent(target, num_layers=1)
    assert small.config.num_hidden_layers == 1 and drafter_kind(small) == "independent"
    assert not small.get_input_embeddings().weight.requires_grad


def test_drafter_adapters_are_picked_by_class_and_by_kind(target):
    """One adapter per drafter class (PEFT-style registry): found through wrappers, by `--kind` name, or refused."""
    pytest.importorskip("peft")
    from moa_hf.training import apply_lora

    moa = moa_hf.build_drafter(target)
    assert adapter_for(moa) is adapter_named("moa") is ADAPTERS[moa_hf.MoADrafterModel]
    assert adapter_for(apply_lora(moa, r=2)) is adapter_named("moa")
    assert adapter_for(tiny_target(num_hidden_layers=1)) is adapter_named("independent")
    with pytest.raises(ValueError, match="Unknown drafter kind 'medusa'"):
        adapter_named("medusa")
    with pytest.raises(TypeError, match="No training adapter for Linear"):
        adapter_for(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kind", ["independent", "eagle"])
def test_peers_train_with_the_same_trainer_on_cached_states(tmp_path, target, kind):
    data = random_dataset(8)
    folder = cache_target_states(target, data, tmp_path / "states", progress=False)
    torch.manual_seed(0)
    model = build_for_kind(kind, target, **({"num_layers": 1} if kind == "independent" else {}))
    assert drafter_kind(model) == kind
    trainer = MoATrainer(
        model=model,
        target=target,
        args=make_args(tmp_path, max_steps=6, learning_rate=3e-3),
        train_dataset=TargetStatesDataset(data, folder),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "saved"))
    names = {p.name for p in (tmp_path / "saved").iterdir()}
    assert "model.safetensors" in names


def test_moa_train_cli_on_cached_states_records_a_continuing_learning_curve(tmp_path):
    """`moa train --states --draft-vocab-size` trains, saves the draft vocabulary and writes the held-out learning
    curve; `--init-drafter` continues that curve (tokens and steps add up)."""
    import json

    from moa_hf.training.cli import main

    from factory import tiny_tokenizer

    folder = tmp_path / "target"
    tiny_target().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    random_dataset(8).save_to_disk(str(tmp_path / "data"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "one two three"}\n')
    common = [
        "train",
        "--target",
        str(folder),
        "--dtype",
        "float32",
        "--data",
        str(tmp_path / "data"),
        "--states",
        str(tmp_path / "states"),
        "--batch-size",
        "4",
        "--eval-prompts",
        str(prompts),
        "--eval-num-prompts",
        "2",
        "--eval-max-new-tokens",
        "8",
        "--eval-steps",
        "2",
        "--save-steps",
        "100",
        "--quiet",
        "--cpu",
    ]
    assert (
        main(
            [
                *common,
                "--output",
                str(tmp_path / "a"),
                "--max-steps",
                "4",
                "--draft-vocab-size",
                "16",
                "--lsa-hidden-size",
                "32",
            ]
        )
        == 0
    )
    info = json.loads((tmp_path / "a" / "training_info.json").read_text())
    assert info["cached_target_states"] is True and info["kind"] == "moa"
    curve = info["learning_curve"]
    assert [p["step"] for p in curve] == [2, 4] and 0 < curve[0]["tokens"] < curve[1]["tokens"]
    # the last point measured the saved drafter: measured again here, its new tokens are the target's own greedy
    # answers to the two held-out prompts (lossless) and its target calls at least one per prompt, one per token
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moa_hf.prompts import format_prompts
    from moa_hf.training.evaluation import measure_acceptance

    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = format_prompts(AutoTokenizer.from_pretrained(folder), ["hello there", "one two three"])
    again = measure_acceptance(target, moa_hf.MoADrafterModel.from_pretrained(tmp_path / "a"), ids, max_new_tokens=8)
    answers = [target.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :] for p in ids]
    assert again["acceptance_tokens"] == sum(len(a) for a in answers) and 2 <= again["acceptance_cycles"] <= 16
    assert curve[-1]["acceptance_length"] == round(again["acceptance_tokens"] / again["acceptance_cycles"], 4)
    drafter = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "a")
    assert drafter.config.draft_vocab_size == 16 and drafter.config.lsa_hidden_size == 32
    # continue on the first dataset plus a new one: the first one's states are reused, the new one's computed
    random_dataset(6, seed=1).save_to_disk(str(tmp_path / "data2"))
    kv_file = tmp_path / "states" / "target_kv.npy"
    before = kv_file.stat().st_mtime_ns
    two = [str(tmp_path / "data"), str(tmp_path / "data2")]
    more_args = [a for a in common if a not in (str(tmp_path / "data"), str(tmp_path / "states"))]
    more_args[more_args.index("--data") + 1 : more_args.index("--data") + 1] = two
    more_args[more_args.index("--states") + 1 : more_args.index("--states") + 1] = [
        str(tmp_path / "states"), str(tmp_path / "states2")]  # fmt: skip
    assert (
        main([*more_args, "--output", str(tmp_path / "b"), "--max-steps", "2", "--init-drafter", str(tmp_path / "a")])
        == 0
    )
    assert kv_file.stat().st_mtime_ns == before and (tmp_path / "states2" / "states.json").exists()
    info_b = json.loads((tmp_path / "b" / "training_info.json").read_text())
    more = info_b["learning_curve"]
    assert [p["step"] for p in more] == [2, 4, 6] and more[2]["tokens"] > curve[1]["tokens"]
    assert [r["steps"] for r in info_b["previous_runs"]] == [4] and info_b["total_steps"] == 6
    assert info_b["total_tokens"] == info["tokens"] + info_b["tokens"]
    with pytest.raises(SystemExit, match="one per --data folder"):
        main([*more_args, "--states", "x", "y", "z", "--output", str(tmp_path / "c"), "--max-steps", "1"])


def test_soft_ce_can_skip_labels_outside_the_draft_vocabulary(tmp_path, target):
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, draft_vocab_size=16)
    drafter.init_draft_vocab(torch.arange(40, 56), target.get_output_embeddings().weight)
    data = random_dataset(2)
    losses = {}
    for mask in (False, True):
        args = make_args(tmp_path, mask_outside_draft_vocab=mask)
        trainer = MoATrainer(model=drafter, target=target, args=args, train_dataset=data)
        inputs = trainer.data_collator([data[0], data[1]])
        labels = inputs["labels"]
        counted = labels != -100
        states = trainer.target_states(inputs)
        student = torch.randn(*labels.shape, target.config.hidden_size)
        losses[mask] = trainer.token_losses(student, None, states, counted, labels=labels)[1]  # soft CE [N]
    inside = (labels[counted] >= 40) & (labels[counted] < 56)
    assert 0 < int(inside.sum()) < int(counted.sum())  # both kinds of position are present
    torch.testing.assert_close(losses[True][inside], losses[False][inside])
    assert bool((losses[True][~inside] == 0).all()) and bool((losses[False][~inside] > 0).all())
