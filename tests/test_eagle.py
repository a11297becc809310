"""The EAGLE-2-style drafter: training forward, incremental drafting, lossless assisted generation, hooks, saving."""

import copy
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList, T5Config, TopKLogitsWarper

from moa_hf.modeling.configuration_eagle import EagleDrafterConfig
from moa_hf.modeling.modeling_eagle import EagleDrafterCache, EagleDrafterModel

from factory import make_target
from tolerance import assert_close


def _drafter(target, seed: int = 0, **overrides) -> EagleDrafterModel:
    torch.manual_seed(seed)
    drafter = EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config, **overrides)).eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return drafter


def _features(target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target(ids, output_hidden_states=True).hidden_states[-1]  # [B, T, d] post-norm


def _hooks(target) -> int:
    modules = [target, target.get_decoder()]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


@pytest.fixture(scope="module")
def trained():
    """A drafter trained for a few hundred steps on the tiny target's own greedy continuations (seconds on CPU)."""
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = EagleDrafterModel(EagleDrafterConfig.from_target_config(target.config))
    with torch.no_grad():
        seqs = target.generate(torch.randint(3, 128, (512, 6)), max_new_tokens=26, do_sample=False)  # [512, 32]
        out = target(seqs, output_hidden_states=True)
    feats, labels = out.hidden_states[-1], out.logits.argmax(-1)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    drafter.train()
    with drafter.attached(target):
        for _ in range(400):
            idx = torch.randint(0, seqs.shape[0], (16,))
            o = drafter(seqs[idx], target_hidden=feats[idx], return_logits=True, noise_std=0.01)
            loss = 10 * F.smooth_l1_loss(o.hidden_states, feats[idx]) + F.cross_entropy(
                o.logits.flatten(0, 1), labels[idx].flatten()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    drafter.eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return target, drafter


def test_config_from_target():
    target = make_target("qwen2")
    cfg = EagleDrafterConfig.from_target_config(target.config)
    assert cfg.model_type == "moa_eagle_drafter" and cfg.num_hidden_layers == 1
    sizes = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    assert sizes == (64, 4, 2, 128)
    assert cfg.target_name_or_path == "tiny-random-qwen2" and cfg.signature()["vocab_size"] == 128
    with pytest.raises(ValueError, match="hidden_size"):
        EagleDrafterConfig.from_target_config(target.config, hidden_size=32)
    with pytest.raises(ValueError, match="encoder-decoder"):
        EagleDrafterConfig.from_target_config(T5Config())


def test_forward_shapes_dtypes_and_noise():
    target = make_target("llama")
    drafter = _drafter(target)
    ids = torch.randint(3, 128, (2, 9))
    feats = _features(target, ids)
    with pytest.raises(RuntimeError, match="attach"):
        drafter(ids, target_hidden=feats)
    with drafter.attached(target):
        out = drafter(ids, target_hidden=feats, return_logits=True)
        assert out.hidden_states.shape == (2, 9, 64) and out.hidden_states.dtype == torch.float32
        assert out.logits.shape == (2, 9, 128) and out.logits.dtype == torch.float32
        assert drafter(ids, target_hidden=feats).logits is None
        # position i reads feature i-1 only: changing the last feature changes nothing
        changed = feats.clone()
        changed[:, -1] += 1.0
        assert torch.equal(drafter(ids, target_hidden=changed).hidden_states, out.hidden_states)
        changed[:, 3] += 1.0
        diff = (drafter(ids, target_hidden=changed).hidden_states - out.hidden_states).abs().amax(-1)  # [B, T]
        assert (diff[:, :4] == 0).all() and (diff[:, 4] > 0).all()
        noisy = drafter(ids, target_hidden=feats, noise_std=0.1, noise_type="gaussian").hidden_states
        assert not torch.allclose(noisy, out.hidden_states)
        with pytest.raises(ValueError, match="noise_type"):
            drafter(ids, target_hidden=feats, noise_std=0.1, noise_type="pink")
        with pytest.raises(ValueError, match="target_hidden"):
            drafter(ids, target_hidden=feats[:, :-1])
        target16 = make_target("llama").to(torch.bfloat16)
        drafter16 = _drafter(target16).to(torch.bfloat16)
        with drafter16.attached(target16):
            out16 = drafter16(ids, target_hidden=_features(target16, ids), return_logits=True)
        assert out16.hidden_states.dtype == torch.bfloat16 and out16.logits.dtype == torch.float32


def test_padding_mask_matches_unpadded():
    target = make_target("llama")
    drafter = _drafter(target)
    ids = torch.randint(3, 128, (1, 7))
    feats = _features(target, ids)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)  # left padding
    pad_feats = torch.cat([torch.randn(1, 3, 64), feats], dim=1)  # garbage at padding must not matter
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], dim=1).long()
    with drafter.attached(target):
        ref = drafter(ids, target_hidden=feats).hidden_states
        out = drafter(padded, target_hidden=pad_feats, attention_mask=mask).hidden_states
    assert torch.allclose(out[:, 3:], ref, atol=1e-6)
    assert torch.isfinite(out).all()


def test_incremental_draft_equals_parallel_forward():
    target = make_target("llama")
    drafter = _drafter(target, seed=1)
    with torch.no_grad():  # random weights large enough that every part matters
        for p in drafter.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    ids = torch.randint(3, 128, (1, 16))
    feats = _features(target, ids)
    previous = F.pad(feats[:, :-1], (0, 0, 1, 0))  # [1, 16, d]: f_{i-1}
    with drafter.attached(target), torch.no_grad():
        ref = drafter(ids, target_hidden=feats, return_logits=True)
        cache = drafter.new_cache()
        hidden, start = [], 0
        for size in (5, 1, 3, 1, 6):
            logits, h = drafter.draft_step(ids[:, start : start + size], previous[:, start : start + size], cache)
            hidden.append(h)
            start += size
            assert_close(logits, ref.logits[:, start - 1])
        assert_close(torch.cat(hidden, dim=1), ref.hidden_states)
        assert cache.get_seq_length() == 16
        cache.crop(-6)  # transformers' convention: drop 6
        assert cache.get_seq_length() == 10 and cache.tokens.shape[1] == 10
        logits, h = drafter.draft_step(ids[:, 10:], previous[:, 10:], cache)
        assert_close(h, ref.hidden_states[:, 10:])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_drafter_greedy_equality(family):
    target = make_target(family)
    drafter = _drafter(target)
    rng = random.Random(family)
    with drafter.attached(target):
        for trial in range(4):
            ids = torch.tensor([[rng.randrange(3, 128) for _ in range(rng.randrange(1, 15))]])
            new = rng.randrange(1, 30)
            drafter.generation_config.num_assistant_tokens = rng.choice([1, 3, 6])
            ref = target.generate(ids, max_new_tokens=new, do_sample=False)
            out = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=drafter)
            stats = drafter.speculation_stats
            assert torch.equal(out, ref), (family, trial)
            assert stats.generated_tokens == new and len(stats.accepted_lengths) == stats.target_calls
    assert _hooks(target) == 0


def test_trained_drafter_greedy_equality_and_acceptance(trained):
    target, drafter = trained
    rng = random.Random(1)
    means, lengths = [], set()
    with drafter.attached(target):
        for trial in range(6):
            ids = torch.tensor([[rng.randrange(3, 128) for _ in range(rng.randrange(2, 12))]])
            new = rng.randrange(10, 40)
            drafter.generation_config.num_assistant_tokens = rng.choice([4, 6])
            drafter.generation_config.assistant_confidence_threshold = rng.choice([0.0, 0.05])
            ref = target.generate(ids, max_new_tokens=new, do_sample=False)
            out = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=drafter)
            stats = drafter.speculation_stats
            assert torch.equal(out, ref), trial
            assert stats.generated_tokens == new and stats.drafted_tokens > 0
            means.append(stats.mean_accepted_length)
            lengths.update(stats.accepted_lengths)
    assert sum(means) / len(means) > 1.5, means  # the drafter really predicts the target
    assert max(lengths) >= 4, lengths


def test_drafts_read_the_verified_features(trained):
    """Every drafting call (once the target has run) drafts exactly what the parallel forward predicts from the
    target's true features: no off-by-one between the hooks, the cache and training."""
    target, drafter = trained
    calls = []
    real_generate = drafter.generate

    def spy(input_ids, **kwargs):
        out = real_generate(input_ids, **kwargs)
        calls.append((input_ids.shape[1], out.scores[0][0].clone(), out.past_key_values.feature_length))
        return out

    drafter.generate = spy  # instance attribute on our own drafter, not on the target
    try:
        with drafter.attached(target):
            out = target.generate(torch.tensor([[9, 33, 71, 5, 20]]), max_new_tokens=30, assistant_model=drafter)
            ref = drafter(out, target_hidden=_features(target, out), return_logits=True).logits[0]
    finally:
        del drafter.generate
    assert calls[0][2] == 0 and len(calls) > 3
    for n, score, num_features in calls[1:]:
        assert num_features == n - 1
        assert_close(score, ref[n - 1])


def test_processors_min_tokens_eos_and_sampling(trained):
    target, drafter = trained
    ids = torch.tensor([[4, 8, 15, 16, 23]])

    def primed():  # a cache given the target's true features of the verified positions (as a client would)
        cache = drafter.new_cache()
        cache.append_features(_features(target, ids)[:, :-1])
        return cache

    with drafter.attached(target):
        processors = LogitsProcessorList([TopKLogitsWarper(5)])
        out = drafter.generate(ids, max_new_tokens=3, logits_processor=processors, past_key_values=primed())
        assert out.sequences.shape == (1, 8) and len(out.scores) == 3
        assert all(int(torch.isfinite(s).sum()) == 5 for s in out.scores)  # processed scores are returned
        # without any target feature yet (the very first cycle) the drafter makes one guess only
        assert drafter.generate(ids, max_new_tokens=3).sequences.shape == (1, 6)
        first = int(out.sequences[0, 5])
        gc = copy.deepcopy(drafter.generation_config)
        gc.eos_token_id = first
        assert (
            drafter.generate(ids, generation_config=gc, max_new_tokens=4, past_key_values=primed()).sequences.shape[1]
            == 6
        )  # eos stops drafting
        out = drafter.generate(ids, generation_config=gc, max_new_tokens=4, min_new_tokens=2, past_key_values=primed())
        assert out.sequences.shape[1] > 7 and first not in out.sequences[0, 5:7].tolist()
        torch.manual_seed(0)
        sampled = target.generate(ids, max_new_tokens=20, do_sample=True, assistant_model=drafter)
        stats = drafter.speculation_stats
        assert sampled.shape == (1, 25) and stats.generated_tokens == 20
        assert len(stats.accepted_lengths) == stats.target_calls


def test_hooks_removed_and_signature_checks():
    target = make_target("llama")
    drafter = _drafter(target)
    drafter.attach(target)
    assert drafter.is_attached and _hooks(target) == 4
    assert drafter.attach(target) is drafter and _hooks(target) == 4  # attaching twice is a no-op
    drafter.detach()
    assert not drafter.is_attached and _hooks(target) == 0
    with pytest.raises(KeyError):
        with drafter.attached(target):
            raise KeyError("boom")
    assert _hooks(target) == 0 and not drafter.is_attached
    with drafter.attached(target):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, assistant_model=drafter)
    assert _hooks(target) == 0
    other = make_target("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="target_num_hidden_layers: drafter 3 != target 2"):
        drafter.attach(other)
    assert _hooks(other) == 0 and not drafter.is_attached
    qwen = make_target("qwen2")  # same signature, another checkpoint name
    with pytest.raises(ValueError, match="allow_other_target=True"):
        drafter.attach(qwen)
    with drafter.attached(qwen, allow_other_target=True):
        assert _hooks(qwen) == 4
    assert _hooks(qwen) == 0


def test_save_load_round_trip_and_remote_code(tmp_path):
    target = make_target("llama")
    drafter = _drafter(target, own_embeddings=True)
    drafter.copy_embeddings_from(target)
    drafter.save_pretrained(tmp_path / "eagle")
    files = set(os.listdir(tmp_path / "eagle"))
    remote_code = {"modeling_eagle.py", "configuration_eagle.py", "modeling_moa.py", "configuration_moa.py"}
    assert remote_code | {"drafting.py", "lookup.py"} <= files  # and the sibling files they import
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_eagle.EagleDrafterConfig",
        "AutoModel": "modeling_eagle.EagleDrafterModel",
    }
    loaded = EagleDrafterModel.from_pretrained(tmp_path / "eagle").eval()
    saved_config = {k: v for k, v in loaded.config.to_dict().items() if k != "_name_or_path"}
    assert saved_config == {k: v for k, v in drafter.config.to_dict().items() if k != "_name_or_path"}
    assert loaded.generation_config.num_assistant_tokens == 5
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    # own embeddings: runs without a target
    ids = torch.randint(3, 128, (1, 6))
    feats = _features(target, ids)
    assert torch.equal(loaded(ids, target_hidden=feats).hidden_states, drafter(ids, target_hidden=feats).hidden_states)
    # remote code, in a fresh process without moa_hf on the import path
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModel
        m = AutoModel.from_pretrained({str(tmp_path / "eagle")!r}, trust_remote_code=True)
        assert type(m).__name__ == "EagleDrafterModel" and "moa_hf" not in type(m).__module__
        ids = torch.tensor([[5, 6, 7]])
        print(m(ids, target_hidden=torch.zeros(1, 3, 64)).hidden_states.shape)
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch.Size([1, 3, 64])" in result.stdout


def test_legacy_lookup_keys_are_dropped_on_load(tmp_path):
    """Older drafters saved the MoA drafter's prompt lookup keys in every generation config; EAGLE has no lookup."""
    drafter = _drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    gc_file = tmp_path / "generation_config.json"
    legacy = {"max_matching_ngram_size": 3, "prompt_lookup_min_ngram": 1, "prompt_lookup_halve_per_ngram": False}
    gc_file.write_text(json.dumps({**json.loads(gc_file.read_text()), **legacy}))
    loaded = EagleDrafterModel.from_pretrained(tmp_path)
    gc = loaded.generation_config
    assert gc.max_matching_ngram_size is None and not hasattr(gc, "prompt_lookup_min_ngram")
    assert loaded.lookup_settings is None and not hasattr(loaded.config, "lookup_num_tokens")
    assert gc.num_assistant_tokens == drafter.generation_config.num_assistant_tokens


def test_cache_crop_semantics():
    cache = EagleDrafterCache(num_layers=2)
    k = torch.zeros(1, 2, 5, 4)
    for layer in cache.layers:
        layer.append_self(k, k)
    cache.tokens = torch.arange(5)[None]
    cache.append_features(torch.zeros(1, 4, 8))
    cache.true_length = 5
    assert cache.common_prefix(torch.tensor([[0, 1, 2, 9, 4, 5]])) == 3
    cache.crop(-0)  # transformers after a fully accepted draft: drop nothing
    assert (cache.get_seq_length(), cache.feature_length, cache.true_length) == (5, 4, 5)
    cache.crop(-2)
    assert (cache.get_seq_length(), cache.feature_length, cache.true_length) == (3, 3, 3)
    assert all(layer.keys.shape[2] == 3 for layer in cache.layers)
    cache.crop(1)
    assert (cache.get_seq_length(), cache.feature_length, cache.true_length, cache.tokens.shape[1]) == (1, 1, 1, 1)
    cache.truncate(0)
    assert (cache.get_seq_length(), cache.feature_length, cache.true_length) == (0, 0, 0)
