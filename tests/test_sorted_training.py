"""Training sorted drafters (several exits) for several targets: the loss over exits and its weights, gradients in
every block, one-target batches with that target's parts, parts-only training, per-exit / per-target evaluation and
the `moa train` options for all of it (tiny random models, a few steps each)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import moa_hf
from moa_hf.modeling import PRIMARY_TARGET
from moa_hf.training import MoATrainer, format_prompts, measure_acceptance
from moa_hf.training.evaluation import measure_acceptance_by_exit
from moa_hf.training.sampling import TargetBatchSampler

from factory import random_dataset, tiny_target, tiny_tokenizer, tiny_training_args

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def other_target(target):
    """A fine-tune stand-in: the same model with every decoder weight perturbed (another fingerprint)."""
    model = copy.deepcopy(target)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std())
    return model.eval()


def sorted_drafter(target, num_blocks: int = 3, seed: int = 0, **overrides):
    """A sorted drafter whose deeper blocks are not the identity (they start so: their output projections are zero),
    as after some training: every exit drafts differently. A narrow LSA (an LSA input projection, as the shipped
    drafter has) unless `lsa_hidden_size` says otherwise."""
    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, num_blocks=num_blocks, **{"lsa_hidden_size": 32, **overrides})
    with torch.no_grad():
        for block in drafter.blocks if num_blocks > 1 else []:
            for name, p in block.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.normal_(0.0, 0.02)
    return drafter


def one_batch(trainer, n: int = 4, seed: int = 3) -> dict:
    data = random_dataset(n, seed=seed)
    return trainer.data_collator([{**data[i], "sample_index": i} for i in range(n)])


def exit_losses(trainer, batch) -> list[float]:
    """Each exit's mean loss per counted position on `batch`, computed outside the trainer's loss."""
    drafter = trainer.drafter
    states = trainer.target_states(batch)
    starts, _ = trainer.simulated_cycles(batch)
    with torch.no_grad():
        out = drafter(input_ids=batch["input_ids"], target_kv=states.kv, cycle_starts=starts, exits="all")
    counted = (batch["labels"] != -100) & batch["attention_mask"].bool()
    assert len(out.exit_hidden_states) == drafter.config.num_blocks
    return [float(trainer.token_losses(h, h, states, counted)[0].mean()) for h in out.exit_hidden_states]


# ---------------------------------------------------------------------------------------------------------------------
# The loss over exits
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", [None, "0,0,1", "1,0,0", "1,2,1"])
def test_loss_is_the_weighted_mean_of_the_exit_losses(tmp_path, target, weights):
    trainer = MoATrainer(
        model=sorted_drafter(target),
        target=target,
        args=tiny_training_args(tmp_path, exit_loss_weights=weights),
        train_dataset=random_dataset(8),
    )
    trainer.model.eval()  # fixed cycles
    batch = one_batch(trainer)
    per_exit = exit_losses(trainer, batch)
    assert len(set(per_exit)) == 3  # three different exits
    w = [1.0, 1.0, 1.0] if weights is None else [float(x) for x in weights.split(",")]
    expected = sum(wi * li for wi, li in zip(w, per_exit)) / sum(w)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    if weights == "0,0,1":
        assert float(loss) == pytest.approx(per_exit[2], rel=1e-6)


def test_exit_loss_weights_must_match_the_blocks(tmp_path, target):
    with pytest.raises(ValueError, match="3 exits"):
        MoATrainer(
            model=sorted_drafter(target),
            target=target,
            args=tiny_training_args(tmp_path, exit_loss_weights="1,1"),
            train_dataset=random_dataset(4),
        )
    with pytest.raises(ValueError, match="positive sum"):
        tiny_training_args(tmp_path, exit_loss_weights="0,0,0")


def test_gradients_reach_every_block_and_zero_weight_exits_send_none(tmp_path, target):
    def grads(weights):
        drafter = sorted_drafter(target)
        trainer = MoATrainer(
            model=drafter,
            target=target,
            args=tiny_training_args(tmp_path, exit_loss_weights=weights),
            train_dataset=random_dataset(8),
        )
        trainer.compute_loss(trainer.model, one_batch(trainer)).backward()
        blocks = [[drafter.self_attention, drafter.cross_attention], *[[b] for b in drafter.blocks]]
        return [[p.grad for m in block for p in m.parameters()] for block in blocks]

    for k, block in enumerate(grads(None), start=1):  # uniform: every weight of every block learns
        assert all(g is not None and bool(g.abs().sum() > 0) for g in block), f"block {k}"
    first, *deeper = grads("1,0,0")  # exit 1 only: the deeper blocks get no gradient at all
    assert all(g is not None for g in first)
    assert all(g is None or not bool(g.any()) for block in deeper for g in block)


def test_per_exit_losses_are_logged(tmp_path, target):
    trainer = MoATrainer(
        model=sorted_drafter(target),
        target=target,
        args=tiny_training_args(tmp_path, max_steps=2),
        train_dataset=random_dataset(8),
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(
        {"loss_exit1", "loss_exit2", "loss_exit3", "soft_ce", "feature_loss"} <= set(h) for h in logged
    )


def test_warm_start_from_one_block_starts_every_exit_equal(tmp_path, target):
    one = sorted_drafter(target, num_blocks=1)
    one.save_pretrained(tmp_path / "one")
    three = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "one", num_blocks=3)
    trainer = MoATrainer(
        model=three, target=target, args=tiny_training_args(tmp_path), train_dataset=random_dataset(4)
    )
    trainer.model.eval()
    per_exit = exit_losses(trainer, one_batch(trainer))
    assert per_exit[0] == pytest.approx(per_exit[1], rel=1e-6) and per_exit[0] == pytest.approx(per_exit[2], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Several targets
# ---------------------------------------------------------------------------------------------------------------------
def test_target_batch_sampler_groups_by_target_in_proportion():
    sizes, batch = [10, 5, 3], 4
    sampler = TargetBatchSampler(sizes, batch, seed=1)
    order = list(sampler)
    assert len(order) == len(sampler) == (3 + 2 + 1) * batch
    owner = [0 if i < 10 else 1 if i < 15 else 2 for i in order]
    blocks = [owner[i : i + batch] for i in range(0, len(order), batch)]
    assert all(len(set(b)) == 1 for b in blocks)  # one target per batch
    assert [sum(b[0] == t for b in blocks) for t in range(3)] == [3, 2, 1]  # ceil(size / batch) batches each
    assert set(order) == set(range(18))  # every example each epoch
    assert list(TargetBatchSampler(sizes, batch, seed=1)) == order  # deterministic
    sampler.set_epoch(1)
    assert list(sampler) != order


def test_two_targets_each_batch_trains_its_own_parts(tmp_path, target, other_target):
    drafter = sorted_drafter(target, num_blocks=2)
    trainer = MoATrainer(
        model=drafter,
        target={"main": target, "alt": other_target},
        args=tiny_training_args(tmp_path, target_lora_rank=2, max_steps=4),
        train_dataset={"main": random_dataset(8), "alt": random_dataset(6, seed=1)},
    )
    assert drafter.target_names == ["main", "alt"] and drafter.config.extra_targets["alt"]["lora_rank"] == 2
    own = {"main": drafter.lsa_in_proj.weight, "alt": drafter.target_parts["alt"].lsa_in_proj.weight}
    seen = []
    for batch in trainer.get_train_dataloader():
        index = batch["target_index"]
        assert bool((index == index[0]).all())  # one target per batch
        name = trainer.target_names[int(index[0])]
        seen.append(name)
        drafter.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
        assert own[name].grad is not None and bool(own[name].grad.abs().sum() > 0)
        other = own["alt" if name == "main" else "main"]
        assert other.grad is None or not bool(other.grad.any()), f"a {name} batch reached the other target's parts"
        lora = [p for p in drafter.target_part_parameters("alt") if p is not own["alt"]]
        lora_learns = any(p.grad is not None and bool(p.grad.any()) for p in lora)  # B (A's gradient is 0 at B=0)
        assert lora and lora_learns == (name == "alt")
    assert sorted(seen) == ["alt", "alt", "main", "main"]  # 6 / 4 and 8 / 4 batches
    drafter.zero_grad(set_to_none=True)
    trainer.train()
    tokens = trainer.target_token_counts()
    assert tokens["main"] > 0 and tokens["alt"] > 0


def test_parts_only_training_leaves_every_other_weight_bit_identical(tmp_path, target, other_target):
    drafter = sorted_drafter(target, num_blocks=2)
    drafter.add_target("alt", other_target, lora_rank=2)
    parts = {id(p) for p in drafter.target_part_parameters("alt")}
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    names = {id(p): k for k, p in drafter.named_parameters()}
    trainer = MoATrainer(
        model=drafter,
        target={"alt": other_target},
        args=tiny_training_args(tmp_path, train_target_parts="alt", max_steps=3, learning_rate=1e-2),
        train_dataset={"alt": random_dataset(8, seed=2)},
    )
    trainer.train()
    trained = {names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert trained == {names[i] for i in parts}
    after = drafter.state_dict()
    part_keys = {names[i] for i in parts}
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= part_keys, changed - part_keys
    with pytest.raises(ValueError, match="that target's data only"):
        MoATrainer(
            model=drafter,
            target={"main": target, "alt": other_target},
            args=tiny_training_args(tmp_path, train_target_parts="alt"),
            train_dataset={"main": random_dataset(4), "alt": random_dataset(4)},
        )


def test_freeze_blocks_grows_a_drafter_without_changing_its_first_exits(tmp_path, target, other_target):
    """freeze_blocks=1: only blocks 2..K and the other target's parts train, so the primary target's exit 1 drafts
    exactly as before; a drafter with no deeper block is refused."""
    drafter = sorted_drafter(target, num_blocks=3)
    drafter.add_target("alt", other_target, lora_rank=2)
    names = {id(p): k for k, p in drafter.named_parameters()}
    expected = {k for k in names.values() if k.startswith("blocks.")}
    expected |= {names[id(p)] for p in drafter.target_part_parameters("alt")}
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer = MoATrainer(
        model=drafter,
        target={"main": target, "alt": other_target},
        args=tiny_training_args(tmp_path, freeze_blocks=1, max_steps=4, learning_rate=1e-2),
        train_dataset={"main": random_dataset(8), "alt": random_dataset(8, seed=2)},
    )
    trainer.train()
    trained = {names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert trained == expected
    after = drafter.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("blocks.1.") for k in changed) and changed <= expected, changed - expected
    with pytest.raises(ValueError, match="freeze 1..2 of them"):
        MoATrainer(
            model=drafter,
            target=target,
            args=tiny_training_args(tmp_path, freeze_blocks=3),
            train_dataset=random_dataset(4),
        )
    with pytest.raises(ValueError, match="give one of them"):
        MoATrainer(
            model=drafter,
            target={"alt": other_target},
            args=tiny_training_args(tmp_path, freeze_blocks=1, train_target_parts="alt"),
            train_dataset={"alt": random_dataset(4)},
        )


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation per exit and per target
# ---------------------------------------------------------------------------------------------------------------------
def test_acceptance_per_exit_and_per_target(tmp_path, target, other_target):
    tokenizer = tiny_tokenizer()
    drafter = sorted_drafter(target, num_blocks=2)
    drafter.add_target("alt", other_target)
    trainer = MoATrainer(
        model=drafter,
        target={"main": target, "alt": other_target},
        args=tiny_training_args(tmp_path, max_steps=1, eval_num_prompts=2, eval_max_new_tokens=6),
        train_dataset={"main": random_dataset(4), "alt": random_dataset(4, seed=1)},
        eval_prompts={"main": ["Hello there", "What is 2+2?"], "alt": ["Explain json.dumps"]},
        processing_class=tokenizer,
    )
    trainer.train()
    metrics = trainer.evaluate()  # the final evaluation: every exit too
    for name in ("main", "alt"):
        for key in ("", "_exit1", "_exit2"):
            # 6 new tokens per prompt take the prefill and at least one verification: at most 6 / 2 per call
            assert 1.0 <= metrics[f"eval_{name}_acceptance_length{key}"] <= 6 / 2, (name, key)
    assert "eval_main_acceptance_length_adaptive" not in metrics  # no exit thresholds
    prompt = format_prompts(tokenizer, ["Explain json.dumps"])
    by_exit = measure_acceptance_by_exit(other_target, drafter, prompt, 6, target_name="alt")
    assert metrics["eval_alt_acceptance_length_exit1"] == pytest.approx(by_exit["exit1"]["acceptance_length"])
    assert by_exit["exit2"] == measure_acceptance(other_target, drafter, prompt, 6, target_name="alt")  # K: default
    drafter.config.exit_thresholds = [0.0]  # adaptive depth that always leaves at exit 1
    by_exit = measure_acceptance_by_exit(other_target, drafter, prompt, 6, target_name="alt")
    assert by_exit["adaptive"] == by_exit["exit1"] and drafter.config.exit_thresholds == [0.0]


# ---------------------------------------------------------------------------------------------------------------------
# moa train
# ---------------------------------------------------------------------------------------------------------------------
def test_train_options_parse_to_targets_data_and_states(tmp_path):
    from moa_hf.cli import build_parser
    from moa_hf.training.cli import _named_inputs, train_arguments

    argv = [
        "train", "--target", "main=default", "--target", "pydoc=default:pydoc", "--data", "main=runs/a,runs/b",
        "--data", "pydoc=runs/p", "--states", "main=runs/sa", "--states", "pydoc=runs/sp", "--num-blocks", "3",
        "--init-from", "default", "--exit-loss-weights", "1,1,2", "--target-lora-rank", "4", "--max-steps", "2",
        "--eval-prompts", "default:validation", "--eval-prompts", "pydoc=pydoc:heldout", "--output", "o",
    ]  # fmt: skip
    target_args, data_args, drafter_args, training = train_arguments(build_parser().parse_args(argv))
    specs, data, states = _named_inputs(target_args, data_args)
    assert specs == {"main": "default", "pydoc": "default:pydoc"}
    assert data == {"main": ["runs/a", "runs/b"], "pydoc": ["runs/p"]}
    assert states == {"main": ["runs/sa"], "pydoc": ["runs/sp"]}
    assert data_args.prompt_sources(list(specs)) == {"main": "default:validation", "pydoc": "pydoc:heldout"}
    assert (drafter_args.num_blocks, drafter_args.init_drafter) == (3, "default")
    assert training.exit_loss_weights == [1.0, 1.0, 2.0] and training.target_lora_rank == 4
    assert training.exit_weights(3) == [0.25, 0.25, 0.5]
    # one plain target and its folders: target main, as before
    target_args, data_args, *_ = train_arguments(
        build_parser().parse_args(["train", "--target", "t", "--data", "a", "b", "--output", "o", "--max-steps", "1"])
    )
    assert target_args.target == "t" and _named_inputs(target_args, data_args)[1] == {"main": ["a", "b"]}
    with pytest.raises(ValueError, match="no --target"):
        _named_inputs(
            *train_arguments(
                build_parser().parse_args(
                    ["train", "--target", "t", "--data", "x=a", "--output", "o", "--max-steps", "1"]
                )
            )[:2]
        )


def test_moa_train_sorted_two_targets_then_parts_only(tmp_path, target, other_target):
    """`moa train` end to end: a K=2 drafter on two targets with cached states (per-target, per-exit acceptance in
    training_info.json), then a warm start to K=3 training only one target's parts on its own data."""
    from moa_hf.training.cli import main

    tokenizer = tiny_tokenizer()
    for name, model in (("t_main", target), ("t_alt", other_target)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    random_dataset(8).save_to_disk(str(tmp_path / "d_main"))
    random_dataset(8, seed=1).save_to_disk(str(tmp_path / "d_alt"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    common = [
        "train", "--dtype", "float32", "--batch-size", "4", "--eval-prompts", str(prompts), "--eval-num-prompts", "1",
        "--eval-max-new-tokens", "4", "--save-steps", "100", "--quiet", "--cpu",
    ]  # fmt: skip
    alt = ["--target", f"alt={tmp_path / 't_alt'}", "--data", f"alt={tmp_path / 'd_alt'}"]
    alt += ["--states", f"alt={tmp_path / 's_alt'}"]
    first = [
        *common, "--target", f"main={tmp_path / 't_main'}", "--data", f"main={tmp_path / 'd_main'}", *alt,
        "--num-blocks", "2", "--exit-loss-weights", "1,2", "--target-lora-rank", "2", "--max-steps", "2",
        "--output", str(tmp_path / "a"),
    ]  # fmt: skip
    # main runs online (no --states for it), alt reads cached states
    assert main(first) == 0
    info = json.loads((tmp_path / "a" / "training_info.json").read_text())
    assert info["cached_target_states"] == {"main": False, "alt": True}
    assert info["num_blocks"] == 2 and info["exit_loss_weights"] == [1.0, 2.0] and info["steps"] == 2
    assert set(info["targets"]) == {"main", "alt"} and all(n > 0 for n in info["tokens_per_target"].values())
    for name in ("main", "alt"):
        assert {"default", "exit1", "exit2"} <= set(info["acceptance_heldout_by_target"][name])
    main_acceptance = info["acceptance_heldout_by_target"]["main"]["default"]  # the curve follows the primary target
    assert info["learning_curve"][-1]["acceptance_length"] == round(main_acceptance, 4)
    saved = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "a")
    assert saved.config.num_blocks == 2 and saved.target_names == ["main", "alt"]

    parts_only = [
        *common, *alt, "--init-from", str(tmp_path / "a"), "--num-blocks", "3", "--train-target-parts", "alt",
        "--max-steps", "1", "--output", str(tmp_path / "b"),
    ]  # fmt: skip
    assert main(parts_only) == 0
    info_b = json.loads((tmp_path / "b" / "training_info.json").read_text())
    assert info_b["trained"] == "the parts of target alt" and list(info_b["tokens_per_target"]) == ["alt"]
    assert info_b["total_steps"] == 3  # continues the first run's record
    grown = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "b")
    assert grown.config.num_blocks == 3
    names = {id(p): k for k, p in grown.named_parameters()}
    alt_parts = {names[id(p)] for p in grown.target_part_parameters("alt")}
    changed = {k for k, v in saved.state_dict().items() if not torch.equal(v, grown.state_dict()[k])}
    assert changed and changed <= alt_parts, changed - alt_parts
    assert PRIMARY_TARGET in grown.target_names
