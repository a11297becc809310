"""MoA drafter training: masks and cycles, losses, gradient accumulation, frozen/unsaved target, resume, LoRA,
acceptance evaluation, and that training raises the acceptance length (tiny random targets, no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from safetensors import safe_open
from transformers import TrainerCallback

import moa_hf
import moa_hf.training as training
from moa_hf.training import (
    IGNORE_INDEX,
    MoADataCollator,
    MoATrainer,
    apply_lora,
    build_dataset,
    chunked_soft_cross_entropy,
    draw_cycle_lengths,
    format_prompts,
    measure_acceptance,
    merge_lora,
    run_target,
    sa_curriculum_mask,
    staircase_restarts,
)
from moa_hf.training.sampling import IndexedDataset

from factory import random_dataset, tiny_target, tiny_tokenizer, tiny_training_args
from tolerance import assert_close

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------
make_args = tiny_training_args


def make_drafter(target, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return moa_hf.build_drafter(target, **overrides)


def losses_of(trainer: MoATrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def target():
    return tiny_target()


# ---------------------------------------------------------------------------------------------------------------------
# Collator, cycles, masks
# ---------------------------------------------------------------------------------------------------------------------
def test_collator_right_pads_and_counts_response_predictions():
    collate = MoADataCollator(pad_token_id=0)
    batch = collate(
        [
            {"input_ids": [5, 6, 7, 8, 9, 10], "prompt_length": 3, "sample_index": 4},
            {"input_ids": [11, 12, 13, 14], "prompt_length": 2, "sample_index": 9},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    # position i is counted when token i+1 is a response token; its label is that token
    assert batch["labels"].tolist() == [[-100, -100, 8, 9, 10, -100], [-100, 13, 14, -100, -100, -100]]
    assert batch["prompt_lengths"].tolist() == [3, 2]
    assert batch["sample_index"].tolist() == [4, 9]
    truncated = MoADataCollator(max_length=4)([{"input_ids": list(range(3, 10)), "prompt_length": 2}])
    assert truncated["input_ids"].shape == (1, 4) and truncated["labels"].tolist() == [[-100, 5, 6, -100]]


def test_staircase_cycle_starts():
    prompt_lengths, every, T = torch.tensor([3, 5, 0]), torch.tensor([4, 6, 7]), 25
    starts = moa_hf.modeling.cycle_starts_from_restarts(staircase_restarts(prompt_lengths, every, T))
    for b in range(3):
        p, e = int(prompt_lengths[b]), int(every[b])
        expected = [i if i < p else p + (i - p) // e * e for i in range(T)]
        assert starts[b].tolist() == expected
    assert bool((starts <= torch.arange(T)).all())


def test_cycle_lengths_are_uniform_and_reproducible():
    index = torch.arange(2000)
    a = draw_cycle_lengths(index, step=7, seed=3, low=6, high=14)
    assert a.min() == 6 and a.max() == 14 and len(set(a.tolist())) == 9
    counts = torch.bincount(a - 6, minlength=9).float()
    assert counts.min() > 0.7 * counts.mean()  # roughly uniform
    assert torch.equal(a, draw_cycle_lengths(index, step=7, seed=3, low=6, high=14))  # a pure function
    assert not torch.equal(a, draw_cycle_lengths(index, step=8, seed=3, low=6, high=14))


def test_sa_curriculum_mask_and_schedule(tmp_path, target):
    starts = torch.tensor([[0, 1, 2, 2, 2, 5, 5]])
    mask = sa_curriculum_mask(starts.expand(2, -1), torch.tensor([True, False]))
    j = torch.arange(7)
    assert torch.equal(mask[0], j[None, :] >= starts[0][:, None])  # only the current cycle
    assert bool(mask[1].all())  # untouched row (the drafter adds causality)
    trainer = MoATrainer(
        model=make_drafter(target),
        target=target,
        args=make_args(tmp_path, sa_curriculum=True, max_steps=100),
        train_dataset=random_dataset(8),
    )
    batch = trainer.data_collator([{**random_dataset(8)[i], "sample_index": i} for i in range(8)])
    trainer.model.train()
    trainer.state.max_steps, trainer.state.global_step = 100, 0
    _, sa = trainer.simulated_cycles(batch)
    assert sa is not None and not bool(sa.all(-1).all(-1).any())  # probability 1 at the start: every row restricted
    trainer.state.global_step = 50  # half-way (epoch E/2): probability 0
    assert trainer.simulated_cycles(batch)[1] is None


@pytest.mark.parametrize("tli,hidden", [(0, False), (1, False), (0, True)])
def test_no_position_sees_target_state_at_or_after_its_cycle_start(tmp_path, target, tli, hidden):
    """hidden: a drafter whose context reads the target's final hidden states too (`context_final_hidden`) and
    whose CA's input adds the newest context (`ca_latest_context`)."""
    trainer = MoATrainer(
        model=make_drafter(target, target_layer_inference=tli, context_final_hidden=hidden, ca_latest_context=hidden),
        target=target,
        args=make_args(tmp_path),
        train_dataset=random_dataset(4),
    )
    batch = trainer.data_collator([{**random_dataset(4, seed=1)[i], "sample_index": i} for i in range(2)])
    states = run_target(target, batch["input_ids"], batch["attention_mask"], target_layer_inference=tli)
    starts, _ = trainer.simulated_cycles(batch)
    assert bool((starts <= torch.arange(starts.shape[1])).all())
    counted = torch.ones_like(batch["attention_mask"], dtype=torch.bool)  # every position, padding included
    drafter = trainer.drafter.eval()

    def per_position(s: training.TargetStates) -> torch.Tensor:
        with torch.no_grad():
            out = drafter(
                input_ids=batch["input_ids"],
                target_kv=s.kv,
                target_hidden=s.final_hidden,
                cycle_starts=starts,
                target_tli_kv=s.tli_kv,
                return_logits=False,
            )
            student = out.final_hidden_states if out.final_hidden_states is not None else out.hidden_states
            return trainer.token_losses(student, out.hidden_states, states, counted)[0].view(starts.shape)  # [B, T]

    reference = per_position(states)
    T = starts.shape[1]
    g = torch.Generator().manual_seed(0)
    for cut in range(T):  # perturb the target's state of every position >= cut
        kv = states.kv.clone()
        kv[:, cut:] += torch.randn(kv[:, cut:].shape, generator=g)
        tli_kv = None
        if tli:
            tli_kv = [(k.clone(), v.clone()) for k, v in states.tli_kv]
            for k, v in tli_kv:
                k[:, :, cut:] += torch.randn(k[:, :, cut:].shape, generator=g)
                v[:, :, cut:] += torch.randn(v[:, :, cut:].shape, generator=g)
        final = states.final_hidden.clone()
        final[:, cut:] += torch.randn(final[:, cut:].shape, generator=g)
        perturbed = per_position(training.TargetStates(kv, final, feature=states.feature, tli_kv=tli_kv))
        blind = starts <= cut  # these positions may only read the state of tokens j < start(i) <= cut
        torch.testing.assert_close(perturbed[blind], reference[blind], rtol=0, atol=1e-6)
        if (~blind).any():  # the rest do read it: the check can fail
            assert not torch.allclose(perturbed[~blind], reference[~blind])


# ---------------------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["frozen", "stored", "checkpoint"])
def test_chunked_soft_cross_entropy_matches_full(path, monkeypatch):
    """Each of the three ways through the head (frozen; trainable with the logits' gradients kept; trainable and
    recomputed in the backward when N x V is over the budget) gives the plain soft CE's values and gradients."""
    frozen = path == "frozen"
    if path == "checkpoint":
        monkeypatch.setattr(training.losses, "STORED_GRAD_ELEMENTS", 0)
    torch.manual_seed(0)
    student_head, teacher_head = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 50, bias=False)
    student_head.requires_grad_(not frozen)
    teacher_head.requires_grad_(False)
    h = torch.randn(23, 16, requires_grad=True)
    t = torch.randn(23, 16)
    weights = torch.rand(23)

    loss = chunked_soft_cross_entropy(h, t, student_head, teacher_head, chunk_size=5, head_frozen=frozen)
    (loss * weights).sum().backward()
    grad_h = h.grad.clone()
    grad_w = None if frozen else student_head.weight.grad.clone()
    h.grad = None
    student_head.zero_grad()

    full = -(teacher_head(t).softmax(-1) * student_head(h).log_softmax(-1)).sum(-1)
    (full * weights).sum().backward()
    torch.testing.assert_close(loss, full.detach())
    torch.testing.assert_close(grad_h, h.grad)
    if not frozen:
        torch.testing.assert_close(grad_w, student_head.weight.grad)


@pytest.mark.parametrize("frozen", [True, False])
def test_chunked_soft_cross_entropy_never_keeps_tokens_by_vocab(frozen, monkeypatch):
    """Over the budget of kept logit gradients, what autograd keeps for the backward is at most [N, d] and
    [chunk, V]-sized, never [N, V]."""
    monkeypatch.setattr(training.losses, "STORED_GRAD_ELEMENTS", 64 * 512 - 1)
    N, d, V, chunk = 64, 8, 512, 4
    head, teacher = torch.nn.Linear(d, V, bias=False), torch.nn.Linear(d, V, bias=False)
    head.requires_grad_(not frozen)
    teacher.requires_grad_(False)
    h = torch.randn(N, d, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_soft_cross_entropy(
            h * 1.0, torch.randn(N, d), head, teacher, chunk_size=chunk, head_frozen=frozen
        )
    loss.sum().backward()
    assert saved and max(saved) <= max(N * d, chunk * V, V * d) < N * V
    assert h.grad is not None and h.grad.abs().sum() > 0


def test_gradient_accumulation_matches_one_large_batch(tmp_path, target):
    """Micro-batches normalised by the accumulated token count give the big batch's loss and gradients."""
    data = random_dataset(8, seed=2)
    trainer = MoATrainer(model=make_drafter(target), target=target, args=make_args(tmp_path), train_dataset=data)
    model = trainer.model.train()
    features = [{**data[i], "sample_index": i} for i in range(8)]

    def grads_of(batches, num_items):
        model.zero_grad()
        total = 0.0
        for b in batches:
            loss = trainer.compute_loss(model, b, num_items_in_batch=num_items)
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    full = trainer.data_collator(features)
    halves = [trainer.data_collator(features[:3]), trainer.data_collator(features[3:])]
    count = int((full["labels"] != IGNORE_INDEX).sum())
    assert count == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in halves)
    loss_big, grad_big = grads_of([full], None)
    loss_acc, grad_acc = grads_of(halves, torch.tensor(count))
    assert loss_acc == pytest.approx(loss_big, rel=1e-5)
    for name in grad_big:
        torch.testing.assert_close(grad_acc[name], grad_big[name], rtol=1e-4, atol=1e-7)
    # the per-micro-batch mean (what a naive loss would do) differs: the test can fail
    naive, _ = grads_of(halves, None)
    assert abs(naive / 2 - loss_big) > 1e-4


def test_gradient_accumulation_trainer_matches_large_batch(tmp_path, target):
    data = random_dataset(16, seed=3)
    params = {}
    for name, bs, ga in (("big", 8, 1), ("accumulated", 4, 2)):
        args = make_args(tmp_path / name, max_steps=2, per_device_train_batch_size=bs, gradient_accumulation_steps=ga)
        trainer = MoATrainer(model=make_drafter(target), target=target, args=args, train_dataset=data)
        trainer.train()
        params[name] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, losses_of(trainer))
    (p_big, l_big), (p_acc, l_acc) = params["big"], params["accumulated"]
    assert l_big.keys() == l_acc.keys() == {1, 2}
    for step in l_big:
        assert l_acc[step] == pytest.approx(l_big[step], rel=1e-4)
    for n in p_big:
        torch.testing.assert_close(p_acc[n], p_big[n], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# The target stays frozen and out of checkpoints; resume
# ---------------------------------------------------------------------------------------------------------------------
def _saved_keys(folder: Path) -> set[str]:
    files = list(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    keys = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    return keys


@pytest.mark.parametrize("own_embeddings", [False, True])
def test_target_frozen_unchanged_and_absent_from_checkpoints(tmp_path, own_embeddings):
    target = tiny_target(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = make_drafter(target, own_embeddings=own_embeddings)
    own_before = {k: v.clone() for k, v in drafter.state_dict().items() if k.startswith(("embed_tokens", "lm_head"))}
    args = make_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    trainer = MoATrainer(model=drafter, target=target, args=args, train_dataset=random_dataset(8))
    trainer.train()
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target weight {k} changed"
    drafter_keys = set(drafter.state_dict())
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert _saved_keys(ckpt) == drafter_keys
    trainer.save_model(str(tmp_path / "final"))
    assert _saved_keys(tmp_path / "final") == drafter_keys
    assert not any(k.startswith("model.") for k in drafter_keys)  # nothing of the target's decoder
    shared = drafter_keys & set(target.state_dict())
    assert shared == ({"lm_head.weight"} if own_embeddings else set())  # the drafter's own frozen copy only
    assert any(k.startswith("embed_tokens") for k in drafter_keys) == own_embeddings
    for k, v in own_before.items():  # own copies stay frozen, like the borrowed ones
        assert torch.equal(drafter.state_dict()[k], v)
    n_trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert n_trainable == sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    reloaded = moa_hf.MoADrafterModel.from_pretrained(tmp_path / "final")
    for k, v in reloaded.state_dict().items():
        torch.testing.assert_close(v, drafter.state_dict()[k])


def test_target_layer_inference_drafter_trains(tmp_path, target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = make_drafter(target, target_layer_inference=1)
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer = MoATrainer(
        model=drafter, target=target, args=make_args(tmp_path, max_steps=2), train_dataset=random_dataset(8)
    )
    trainer.train()
    assert all(torch.isfinite(torch.tensor(v)) for v in losses_of(trainer).values())
    assert any(not torch.equal(v, start[k]) for k, v in drafter.state_dict().items())  # the drafter learned
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # the borrowed layers did not


class _StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("steps,stop", [(6, 3), (11, 9)], ids=["within-epoch", "next-epoch"])
def test_resume_continues_the_same_loss_curve(tmp_path, target, steps, stop):
    """Stopped at `stop` and resumed: the same losses as one uninterrupted run (8 steps an epoch: the second case
    resumes inside epoch 2, with the length-grouped order of that epoch)."""
    data = random_dataset(24, seed=4)
    common = dict(
        max_steps=steps, save_strategy="steps", save_steps=stop, sa_curriculum=True, per_device_train_batch_size=3
    )

    full = MoATrainer(
        model=make_drafter(target), target=target, args=make_args(tmp_path / "a", **common), train_dataset=data
    )
    full.train()
    reference = losses_of(full)

    first = MoATrainer(
        model=make_drafter(target),
        target=target,
        args=make_args(tmp_path / "b", **common),
        train_dataset=data,
        callbacks=[_StopAt(stop)],
    )
    first.train()
    assert max(losses_of(first)) == stop
    ckpt = tmp_path / "b" / "out" / f"checkpoint-{stop}"
    assert ckpt.is_dir()
    resumed = MoATrainer(
        model=make_drafter(target, seed=123),
        target=target,
        args=make_args(tmp_path / "b", **common),
        train_dataset=data,
    )
    resumed.train(resume_from_checkpoint=str(ckpt))
    after = losses_of(resumed)
    everything = list(range(1, steps + 1))
    assert sorted(reference) == everything and sorted(after) == everything  # history is restored
    for step in range(1, stop + 1):
        assert losses_of(first)[step] == pytest.approx(reference[step], rel=1e-5)
    for step in range(stop + 1, steps + 1):
        assert after[step] == pytest.approx(reference[step], rel=1e-5)
    # the tally (tokens per target, wall time) goes on from the checkpoint's, not from zero
    saved = json.loads((ckpt / "trainer_state.json").read_text())["stateful_callbacks"]["TrainingTally"]["attributes"]
    assert saved["tokens"] == first.tally.tokens != {} and 0 < saved["wall_time_s"]
    assert resumed.target_token_counts() == full.target_token_counts()
    assert resumed.tally.elapsed() > saved["wall_time_s"]
    fresh = MoATrainer(model=make_drafter(target), target=target, args=make_args(tmp_path / "c", **common))
    assert fresh.target_token_counts() == {name: 0 for name in fresh.target_names}


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation, LoRA
# ---------------------------------------------------------------------------------------------------------------------
def test_acceptance_eval_callback_logs(tmp_path, target):
    tokenizer = tiny_tokenizer()
    args = make_args(tmp_path, max_steps=2, eval_num_prompts=2, eval_max_new_tokens=8, eval_acceptance_steps=2)
    trainer = MoATrainer(
        model=make_drafter(target),
        target=target,
        args=args,
        train_dataset=random_dataset(8),
        eval_prompts=["Hello there", "What is 2+2?", "unused"],
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "eval_acceptance_length" in h]
    assert [h["step"] for h in logged] == [2]
    assert 1.0 <= logged[0]["eval_acceptance_length"] <= 1 + trainer.drafter.generation_config.num_assistant_tokens
    assert logged[0]["eval_acceptance_tokens"] > 0
    metrics = trainer.evaluate()
    assert "eval_loss" not in metrics  # no eval dataset: acceptance only
    assert metrics["eval_acceptance_length"] == pytest.approx(
        measure_acceptance(target, trainer.model, format_prompts(tokenizer, ["Hello there", "What is 2+2?"]), 8)[
            "acceptance_length"
        ]
    )
    with_loss = trainer.evaluate(random_dataset(6, seed=5))
    assert with_loss["eval_loss"] > 0 and "eval_acceptance_length" in with_loss
    assert trainer.evaluate(random_dataset(6, seed=5))["eval_loss"] == with_loss["eval_loss"]  # fixed eval cycles
    # top-1 agreement with the target's next token. Every other response token is made the drafter's own top-1
    # (positions <= i decide the prediction at i), then the metric is recomputed through its full-vocabulary logits
    drafter = trainer.drafter
    trainer.model.eval()

    def logits_and_cycles(batch):
        _, out = trainer.compute_loss(trainer.model, batch, return_outputs=True)
        kv = trainer.target_states(batch).kv
        return drafter(input_ids=batch["input_ids"], target_kv=kv, cycle_starts=out["cycle_starts"]).logits, out

    rows, prompt_lengths = [], []
    with torch.no_grad():
        for k, ex in enumerate(random_dataset(4, seed=5)):
            ids, p = list(ex["input_ids"]), int(ex["prompt_length"])
            for i in range(p - 1, len(ids) - 1, 2):
                batch = trainer.data_collator([{"input_ids": ids, "prompt_length": p, "sample_index": k}])
                ids[i + 1] = int(logits_and_cycles(batch)[0][0, i].argmax())
            rows.append(ids)
            prompt_lengths.append(p)
    eval_data = datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": prompt_lengths})
    metrics = trainer.evaluate(eval_data)
    hits = total = hits_first = total_first = 0
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader(IndexedDataset(eval_data)):  # as `evaluate` indexes it
            logits, out = logits_and_cycles(batch)
            counted = (batch["labels"] != -100) & batch["attention_mask"].bool()
            hit = (logits.argmax(-1) == batch["labels"])[counted]
            first = (out["cycle_starts"] == torch.arange(counted.shape[1]))[counted]
            hits, total = hits + int(hit.sum()), total + hit.numel()
            hits_first, total_first = hits_first + int(hit[first].sum()), total_first + int(first.sum())
    assert 0 < total_first < total and total // 3 < hits < total, (hits, total)
    assert metrics["eval_top1"] == pytest.approx(hits / total)
    assert metrics["eval_top1_first"] == pytest.approx(hits_first / total_first)


def _greedy(target, ids, **kw):
    return target.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, **kw
    )


def test_lora_drafter_trains_and_works_as_assistant(tmp_path):
    pytest.importorskip("peft")
    target = tiny_target(seed=2)
    drafter = make_drafter(target)
    base_state = {k: v.clone() for k, v in drafter.state_dict().items()}
    model = apply_lora(drafter, r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = MoATrainer(
        model=model,
        target=target,
        args=make_args(tmp_path, max_steps=3, learning_rate=1e-2),
        train_dataset=random_dataset(8),
    )
    trainer.train()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    for name, value in drafter.state_dict().items():  # base weights untouched
        if "lora_" not in name:
            base_name = name.replace(".base_layer", "")
            torch.testing.assert_close(value, base_state[base_name])

    ids = torch.tensor([[2, 40, 50, 60, 70, 3, 4]])
    reference = _greedy(target, ids)
    adapted = _greedy(target, ids, assistant_model=model)
    assert torch.equal(adapted, reference)  # lossless with the PEFT-wrapped drafter
    stats_adapted = model.speculation_stats.as_dict()
    assert stats_adapted["target_calls"] > 0

    batch = trainer.data_collator([{**random_dataset(2)[i], "sample_index": i} for i in range(2)])
    states = run_target(target, batch["input_ids"], batch["attention_mask"])

    def features(m):
        with torch.no_grad():
            return m(input_ids=batch["input_ids"], target_kv=states.kv, return_logits=False).hidden_states

    adapted_features = features(model)
    with model.disable_adapter():
        assert not torch.allclose(features(model), adapted_features)  # the adapter is active
    merged = merge_lora(model)
    assert isinstance(merged, moa_hf.MoADrafterModel)
    assert_close(features(merged), adapted_features)
    assert torch.equal(_greedy(target, ids, assistant_model=merged), reference)
    assert merged.speculation_stats.as_dict()["accepted_lengths"] == stats_adapted["accepted_lengths"]


# ---------------------------------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_raises_acceptance_length(tmp_path):
    """A tiny random Llama's greedy continuations are learnable: a few hundred steps lift the acceptance length
    on held-out prompts clearly above the untrained drafter's."""
    from moa_hf.offline_prompts import default_prompts

    target = tiny_target(initializer_range=0.02, logit_scale=30.0)  # peaky, loopy greedy continuations
    tokenizer = tiny_tokenizer()
    data = build_dataset(
        target,
        tokenizer,
        [p[:40] for p in default_prompts(256)],
        tmp_path / "data",
        max_new_tokens=32,
        batch_size=32,
        progress=False,
    )
    held_out = format_prompts(tokenizer, [p[:40] for p in default_prompts(8, split="validation")])
    drafter = make_drafter(target)
    before = measure_acceptance(target, drafter, held_out, max_new_tokens=32)["acceptance_length"]
    args = make_args(
        tmp_path,
        max_steps=300,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=10,
        lr_scheduler_type="cosine",
        logging_steps=50,
    )
    trainer = MoATrainer(model=drafter, target=target, args=args, train_dataset=data)
    trainer.train()
    after = measure_acceptance(target, drafter, held_out, max_new_tokens=32)["acceptance_length"]
    losses = losses_of(trainer)
    assert losses[max(losses)] < 0.6 * losses[min(losses)]
    assert after > before + 0.8, (before, after)
    print(json.dumps({"acceptance_before": before, "acceptance_after": after}))


def test_with_own_embeddings_gives_the_same_standalone_drafter(target):
    drafter = make_drafter(target)
    own = training.with_own_embeddings(drafter, target)
    assert own.config.own_embeddings and not drafter.config.own_embeddings
    ids = torch.randint(3, 100, (1, 12))
    kv = run_target(target, ids).kv
    with torch.no_grad(), moa_hf.attached(drafter, target):
        borrowed = drafter(input_ids=ids, target_kv=kv).logits
    with torch.no_grad():
        standalone = own(input_ids=ids, target_kv=kv).logits  # not attached to anything
    torch.testing.assert_close(standalone, borrowed)


def test_public_exports():
    from moa_hf.training import _EXPORTS

    assert sorted(training.__all__) == sorted(_EXPORTS)
    for name in training.__all__:
        assert getattr(training, name) is not None


def test_measure_acceptance_uses_default_settings_without_lookup():
    """Learning-curve points measure the network with fixed settings, whatever the drafter's tuned ones."""
    target = tiny_target()
    drafter = moa_hf.build_drafter(target).eval()
    own = drafter.generation_config
    own.num_assistant_tokens, own.assistant_confidence_threshold = 6, 0.0  # own: always 6 tokens
    drafter.config.lookup_num_tokens, drafter.config.lookup_min_ngram = 4, 1
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    with drafter.attached(target):
        measure_acceptance(target, drafter, prompt, max_new_tokens=12)
        stats = drafter.speculation_stats
        # default threshold 0.3: a random drafter stops after one token (its own settings would draft 6)
        assert stats.lookup_cycles == 0 and stats.drafted_tokens <= len(stats.accepted_lengths)
        assert drafter.generation_config is own and drafter.config.lookup_num_tokens == 4
        target.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert drafter.speculation_stats.lookup_cycles > 0  # its own settings are back
