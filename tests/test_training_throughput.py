"""Training at the machine's speed: batches of similar lengths, an LSA that skips padding, the explicit short
attention, the kept-gradient soft CE, the step profile (tokens/s, parts, MFU) and the allocator setting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import HfArgumentParser

import moa_hf
from moa_hf.hardware import cpu_flags, hardware_summary, keep_freed_memory
from moa_hf.modeling import TargetStates
from moa_hf.modeling.moa_layers import _explicit_attention
from moa_hf.training import MoATrainer
from moa_hf.training.sampling import IndexedDataset, TargetBatchSampler, example_lengths

from factory import random_dataset, tiny_target, tiny_training_args
from tolerance import assert_close


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _padding(order: list[int], lengths: list[int], batch: int) -> int:
    """Padded positions a right-padding collator computes for batches cut from `order`."""
    blocks = [order[i : i + batch] for i in range(0, len(order), batch)]
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in blocks)


def test_length_grouped_batches_cover_every_example_and_pad_less():
    g = torch.Generator().manual_seed(0)
    sizes, batch = [200, 90], 4
    lengths = torch.randint(5, 500, (sum(sizes),), generator=g).tolist()
    grouped = TargetBatchSampler(sizes, batch, seed=3, lengths=lengths)
    plain = TargetBatchSampler(sizes, batch, seed=3)
    order = list(grouped)
    assert sorted(set(order)) == list(range(sum(sizes)))  # every example, each epoch
    for i in range(0, len(order), batch):  # blocks stay one target's
        assert len({idx < sizes[0] for idx in order[i : i + batch]}) == 1
    assert list(TargetBatchSampler(sizes, batch, seed=3, lengths=lengths)) == order  # a pure function of the seed
    grouped.set_epoch(1)
    assert list(grouped) != order  # and of the epoch
    assert _padding(order, lengths, batch) < 0.25 * _padding(list(plain), lengths, batch)
    with pytest.raises(ValueError, match="lengths"):
        TargetBatchSampler(sizes, batch, lengths=lengths[:-1])


def test_example_lengths_read_through_wrappers():
    data = random_dataset(10, seed=1)
    want = [len(ids) for ids in data["input_ids"]]
    assert example_lengths(IndexedDataset(data)) == want
    assert example_lengths(IndexedDataset(data), max_length=12) == [min(n, 12) for n in want]
    assert example_lengths([{"input_ids": [1, 2]}]) is None  # not a datasets.Dataset: no grouping
    view = data.shuffle(seed=3).select([4, 0, 7])  # an index mapping over the table
    assert example_lengths(view) == [len(ids) for ids in view["input_ids"]]


def test_trainer_groups_lengths_by_default(tmp_path, target):
    assert tiny_training_args(tmp_path).train_sampling_strategy == "group_by_length"
    data = random_dataset(24, seed=2)
    trainer = MoATrainer(
        model=moa_hf.build_drafter(target), target=target, args=tiny_training_args(tmp_path), train_dataset=data
    )
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, TargetBatchSampler) and sampler.lengths is not None
    args = tiny_training_args(tmp_path, train_sampling_strategy="random")
    trainer = MoATrainer(model=moa_hf.build_drafter(target), target=target, args=args, train_dataset=data)
    assert not isinstance(trainer._get_train_sampler(), TargetBatchSampler)


def test_lsa_on_selected_tokens_equals_the_full_lsa(target):
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, lsa_hidden_size=32)
    kv = torch.randn(2, 7, target.config.num_hidden_layers, drafter.config.target_kv_width, requires_grad=True)
    where = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    full = drafter.compute_context(TargetStates(kv))
    picked = drafter.compute_context(TargetStates(kv), where=where)
    assert_close(picked[where], full[where])
    assert torch.equal(picked[~where], torch.zeros_like(picked[~where]))
    (picked * where[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    (full * where[..., None]).sum().backward()
    for name, grad in grads.items():
        assert_close(grad, dict(drafter.named_parameters())[name].grad, msg=name)


def test_training_forward_skips_padding_in_the_lsa(target):
    """Padding changes nothing the loss reads: the real tokens' outputs are the same with and without a mask."""
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, lsa_hidden_size=32)
    ids = torch.randint(3, 100, (2, 9))
    kv = torch.randn(2, 9, target.config.num_hidden_layers, drafter.config.target_kv_width)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    calls = []
    hook = drafter.layer_self_attention.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    try:
        with drafter.attached(target):
            masked = drafter(ids, target_kv=kv, attention_mask=mask, return_logits=False).hidden_states
            plain = drafter(ids, target_kv=kv, return_logits=False).hidden_states
    finally:
        hook.remove()
    assert calls == [15, 18]  # 6 + 9 real tokens, then all 18 positions
    assert_close(masked[mask.bool()], plain[mask.bool()])


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_explicit_short_attention_equals_sdpa(heads):
    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, H, 30, 16, generator=g)
    k, v = torch.randn(5, Hkv, 30, 16, generator=g), torch.randn(5, Hkv, 30, 16, generator=g)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=H != Hkv)
    assert_close(_explicit_attention(q, k, v), want)


def test_profile_steps_write_throughput(tmp_path, target):
    data = random_dataset(24, seed=4)
    args = tiny_training_args(tmp_path, max_steps=5, profile_steps=3)
    trainer = MoATrainer(model=moa_hf.build_drafter(target), target=target, args=args, train_dataset=data)
    trainer.train()
    report = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert report["steps_timed"] == 3
    parts = report["ms_per_step"]
    for part in ("data", "target states", "drafter forward", "drafter forward: LSA layer", "loss", "backward"):
        assert parts[part] > 0, part
    assert parts["drafter forward: LSA layer"] < parts["drafter forward"]
    assert report["train_tokens_per_second"] > 0 and report["flops_per_token"] > 0
    achieved = report["flops_per_token"] * report["train_tokens_per_second"]
    assert report["mfu"] == pytest.approx(achieved / report["matmul_flops_per_second"], rel=0.01)
    assert report["matmul_dtype"] == "float32"  # tiny_training_args train in float32
    assert report["hardware"]["cpu_flags"] == cpu_flags()
    assert not trainer.profile.active and not trainer.profile._hooks  # the LSA hooks are gone


def test_profile_steps_without_enough_steps_time_nothing(tmp_path, target, caplog):
    args = tiny_training_args(tmp_path, max_steps=3, profile_steps=3)
    trainer = MoATrainer(
        model=moa_hf.build_drafter(target), target=target, args=args, train_dataset=random_dataset(12)
    )
    trainer.train()
    assert not (tmp_path / "out" / "throughput.json").exists()
    assert "nothing was timed" in caplog.text


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_count_grouped_query_attention_as_repeated_heads(causal):
    """The step's FLOP count includes attention, on the CPU's fused kernel too, and counts grouped-query attention
    (3 key/value heads for 9 query heads, as in SmolLM2: torch's own formula refuses it) as the same attention with
    repeated key/value heads."""
    from moa_hf.training.throughput import _FlopCount

    def flops(kv_heads: int) -> int:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 9, 16, 64, generator=g, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, 16, 64, generator=g, requires_grad=True) for _ in range(2))
        with _FlopCount() as counter:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 9)
            out.sum().backward()
        return counter.total

    # forward 2 products of [16, 64] x [64, 16] per head (4*b*h*s*s*d), backward 2.5 times that
    assert flops(3) == flops(9) == int(4 * 2 * 9 * 16 * 16 * 64 * 3.5)


def test_hardware_names_the_cpu_flags():
    flags = cpu_flags()
    assert set(flags) <= {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"}
    if not torch.cuda.is_available():
        assert (" ".join(flags) or "no AVX2") in hardware_summary()


def test_keep_freed_memory_on_glibc():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert keep_freed_memory() is True


def test_moa_train_takes_bf16_where_the_cpu_has_it(tmp_path, monkeypatch):
    from moa_hf.training import arguments

    common = ["--output", str(tmp_path), "--max-steps", "1", "--report-to", "none"]
    parse = HfArgumentParser(arguments.TrainCommandArguments).parse_args_into_dataclasses
    for native in (True, False):
        monkeypatch.setattr(arguments, "native_bf16", lambda cpu=True, native=native: native)
        (args,) = parse(common)
        assert args.bf16 is native and (args.use_cpu or not native)
    (args,) = parse([*common, "--bf16", "false"])
    assert args.bf16 is False


def test_the_loss_heads_run_under_bf16_autocast(tmp_path, target):
    """Accelerate autocasts the model's forward only; the draft head in the loss must run in bf16 too."""
    data = random_dataset(8, seed=5)
    drafter = moa_hf.build_drafter(target, draft_vocab_size=32)
    seen = []
    drafter.draft_head.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    args = tiny_training_args(tmp_path, max_steps=1, bf16=True, use_cpu=True)
    MoATrainer(model=drafter, target=target, args=args, train_dataset=data).train()
    assert seen and set(seen) == {torch.bfloat16}


def test_sa_runs_sdpa_causal_without_a_mask_and_matches_the_masked_forward(target):
    """With no SA curriculum the training forward builds no [T, T] SA mask (SDPA's causal kernel): the same hidden
    states and gradients as the same forward given an all-visible `sa_mask` (which is AND-ed with causal)."""
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, lsa_hidden_size=32)
    ids = torch.randint(3, 100, (2, 12))
    kv = torch.randn(2, 12, target.config.num_hidden_layers, drafter.config.target_kv_width)
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9]).expand(2, 12)
    seen = []
    hook = drafter.self_attention.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["mask"]), with_kwargs=True)
    outs, grads = [], []
    with drafter.attached(target):
        for sa_mask in (None, torch.ones(2, 12, 12, dtype=torch.bool)):
            drafter.zero_grad()
            out = drafter(ids, target_kv=kv, cycle_starts=starts, sa_mask=sa_mask, return_logits=False).hidden_states
            out.pow(2).mean().backward()
            outs.append(out.detach())
            grads.append(drafter.self_attention.self_attn.q_proj.weight.grad.clone())
    hook.remove()
    assert seen[0] is None and seen[1] is not None
    assert_close(outs[0], outs[1])
    assert_close(grads[0], grads[1])
    with pytest.raises(ValueError, match="causal attention takes no mask"):
        q = torch.randn(1, 2, 3, 8)
        drafter.self_attention.self_attn.attend(q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool), causal=True)


def test_gradient_checkpointing_same_gradients_less_kept(target):
    """`activation_checkpointing_enable()` (HF's, as `--activation_checkpointing true` calls it) recomputes the SA, CA
    and LSA layers in the backward: the same gradients in float32, far fewer activations kept for the backward."""
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, lsa_hidden_size=32).train()
    ids = torch.randint(3, 100, (2, 12))
    kv = torch.randn(2, 12, target.config.num_hidden_layers, drafter.config.target_kv_width)
    starts = torch.tensor([0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9]).expand(2, 12)

    def run():
        drafter.zero_grad()
        kept = []

        def pack(t):
            kept.append(t.numel() * t.element_size())
            return t

        with drafter.attached(target), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = drafter(ids, target_kv=kv, cycle_starts=starts, return_logits=False).hidden_states
            out.pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return grads, sum(kept)

    plain, plain_kept = run()
    drafter.activation_checkpointing_enable()
    assert drafter.layer_self_attention.gradient_checkpointing and drafter.self_attention.gradient_checkpointing
    checkpointed, checkpointed_kept = run()
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name, grad in plain.items():
        assert_close(checkpointed[name], grad, msg=name)
    assert checkpointed_kept < 0.5 * plain_kept
    drafter.activation_checkpointing_disable()
    with torch.no_grad(), drafter.attached(target):  # inference is untouched
        assert drafter(ids, target_kv=kv, return_logits=False).hidden_states.shape == (2, 12, 64)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_step_check_trains_a_random_target_online(checkpointing):
    """`moa_hf.training.step_check` (the GPU measurement script; a small target on a CPU): online steps timed by the
    profiler, with the drafter's layers checkpointed only when asked."""
    from moa_hf.training.step_check import run_setting

    result = run_setting("small", 2, 64, 1, checkpointing, "cpu")
    assert result["train_tokens_per_second"] > 0 and result["peak_memory_gib"] > 0
    assert result["ms_per_step"]["target states"] > 0  # the target ran inside the step (online)
    assert (result["checkpointed_layers"] > 0) == checkpointing
