"""What the LSA reads of the target (`lsa_keys`, `lsa_layers`, `lsa_pooling`) and the context ablation
(`context_ablated`, `--eval-context-ablation`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import moa_hf
from moa_hf.modeling import CACHE_NAME, CacheReader, TargetStates, gather_target_kv
from moa_hf.training import MoATrainer

from factory import make_target, random_dataset, tiny_target, tiny_training_args
from tolerance import assert_close

torch.set_num_threads(1)


def _cache(target, ids):
    cache = {CACHE_NAME: DynamicCache(config=target.config)}
    out = target(ids, use_cache=True, output_hidden_states=True, **cache)
    return cache[CACHE_NAME], out.hidden_states


def _keys_of(drafter, lsa_inputs):
    """The key half of `lsa_inputs` [B, T, L, Hkv*2*hd] -> [B, T, L, Hkv, hd]."""
    c = drafter.config
    return lsa_inputs.unflatten(-1, (c.target_num_key_value_heads, 2, c.target_head_dim))[..., 0, :]


def test_unrotated_keys_are_the_targets_keys_before_rope():
    target = make_target("llama").eval()
    drafter = moa_hf.build_drafter(target, lsa_keys="unrotated").eval()
    ids = torch.randint(3, 128, (2, 13))
    with torch.no_grad():
        cache, hidden = _cache(target, ids)
        kv = gather_target_kv(cache, 0, ids.shape[1])  # [B, T, L, Hkv*2*hd], keys after RoPE
        got = _keys_of(drafter, drafter.lsa_inputs(kv, torch.arange(ids.shape[1])))  # [B, T, L, Hkv, hd]
        rotated = _keys_of(drafter, kv)
        for i, layer in enumerate(target.model.layers):
            want = layer.self_attn.k_proj(layer.input_layernorm(hidden[i]))  # [B, T, Hkv*hd] before RoPE
            want = want.unflatten(-1, (drafter.config.target_num_key_value_heads, -1))  # [B, T, Hkv, hd]
            assert_close(got[:, :, i], want)
            assert (rotated[:, 1:, i] - want[:, 1:]).abs().max() > 1e-3  # the cache's keys are rotated
        split = (drafter.config.target_num_key_value_heads, 2, drafter.config.target_head_dim)
        values = drafter.lsa_inputs(kv, torch.arange(13)).unflatten(-1, split)[..., 1, :]
        assert torch.equal(values, kv.unflatten(-1, split)[..., 1, :])  # values are read as they are


def test_unrotated_reads_match_the_parallel_forward_and_generation_stays_exact():
    """Reading the context of positions [start, end) from the cache undoes RoPE at those positions (not at 0..)."""
    target = make_target("llama").eval()
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target, lsa_keys="unrotated").eval().attach(target)
    ids = torch.randint(3, 128, (1, 20))
    with torch.no_grad():
        cache, _ = _cache(target, ids)
        states = TargetStates(gather_target_kv(cache, 0, 20))
        full = drafter.compute_context(states, positions=torch.arange(20))  # [1, 20, d]
        assert_close(drafter.read_context(CacheReader(cache), 7, 20), full[:, 7:])
        with pytest.raises(ValueError, match="positions"):
            drafter.compute_context(states)
        plain = target.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0)
        assisted = target.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0, assistant_model=drafter)
    assert torch.equal(plain, assisted)


def test_values_only_layer_subset_and_last_pooling():
    target = make_target("llama")
    c = target.config
    drafter = moa_hf.build_drafter(target, lsa_keys="none", lsa_layers=[-1, 0], lsa_pooling="last", lsa_hidden_size=48)
    kv_heads, head_dim = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    assert drafter.config.lsa_layers == [c.num_hidden_layers - 1, 0]
    assert drafter.lsa_in_proj.in_features == kv_heads * head_dim
    kv = torch.randn(2, 5, c.num_hidden_layers, 2 * kv_heads * head_dim)
    picked = drafter.lsa_inputs(kv, None)  # [2, 5, 2, Hkv*hd]: the values of the last and first layer
    joined = kv.unflatten(-1, (kv_heads, 2, head_dim))[..., 1, :].flatten(-2)  # values only
    assert torch.equal(picked, joined[:, :, [c.num_hidden_layers - 1, 0]])
    with torch.no_grad():
        ctx = drafter.compute_context(TargetStates(kv))
        x = drafter.lsa_in_proj(picked.reshape(10, 2, -1))
        cos, sin = drafter.lsa_rotary_emb(torch.arange(2), x.dtype)
        last = drafter.layer_self_attention(x, cos, sin)[:, -1]  # the output at the last layer read
    assert_close(ctx, drafter.Ekv2E(last).view(2, 5, -1))
    for bad in (dict(lsa_keys="both"), dict(lsa_pooling="max"), dict(lsa_layers=[0, 0]), dict(lsa_layers=[99])):
        with pytest.raises(ValueError, match="lsa_"):
            moa_hf.build_drafter(target, **bad)


def test_unrotated_keys_refused_for_scaled_rope():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    target = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="plain RoPE"):
        moa_hf.build_drafter(target, lsa_keys="unrotated")
    moa_hf.build_drafter(target, lsa_keys="none")  # values only need no rotation


def test_context_ablation_zeroes_the_context_and_stays_exact():
    target = make_target("llama").eval()
    drafter = moa_hf.build_drafter(target).eval().attach(target)
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        kv = gather_target_kv(_cache(target, ids)[0], 0, 12)
        with drafter.context_ablated():
            assert not drafter.compute_context(TargetStates(kv)).any()
            ablated = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0, assistant_model=drafter)
        assert drafter.compute_context(TargetStates(kv)).abs().sum() > 0  # restored after the block
        plain = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(plain, ablated)


def test_eval_context_ablation_equals_a_drafter_whose_context_is_zero(tmp_path):
    """`*_no_context` metrics are those of the same drafter with its LSA projection zeroed (context vectors 0)."""
    target = tiny_target()
    torch.manual_seed(0)
    drafter = moa_hf.build_drafter(target)
    args = tiny_training_args(tmp_path, max_steps=2, eval_context_ablation=True)
    trainer = MoATrainer(model=drafter, target=target, args=args, train_dataset=random_dataset(8))
    trainer.train()
    with torch.no_grad():  # the context matters to this drafter: make it count
        drafter.Ekv2E.weight.mul_(50.0)
    metrics = trainer.evaluate(random_dataset(6, seed=5))
    assert metrics["eval_loss_no_context"] != metrics["eval_loss"]
    with torch.no_grad():
        drafter.Ekv2E.weight.zero_()
        drafter.Ekv2E.bias.zero_()
    zeroed = trainer.evaluate(random_dataset(6, seed=5))
    assert zeroed["eval_loss"] == pytest.approx(metrics["eval_loss_no_context"], rel=1e-5)
    assert zeroed["eval_top1"] == pytest.approx(metrics["eval_top1_no_context"])
    assert zeroed["eval_top1_first"] == pytest.approx(metrics["eval_top1_first_no_context"])
