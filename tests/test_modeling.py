"""Foundation: shapes, cache consistency, no leakage, TLI, save/load round trips, clear errors."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModel, DynamicCache, GenerationConfig

import moa_hf
from moa_hf import MoADrafterCache, MoADrafterConfig, MoADrafterModel
from moa_hf.modeling import CACHE_NAME, TargetStates, gather_target_kv
from moa_hf.modeling.drafting import TargetTap

from factory import make_target
from tolerance import assert_close


def _target_kv(target, ids):
    out = target(ids, use_cache=True, past_key_values=DynamicCache(config=target.config))
    return gather_target_kv(out.past_key_values, 0, ids.shape[1]), out.past_key_values


def _tli_kv(drafter, cache):
    c = drafter.config
    first = c.target_num_hidden_layers - c.target_layer_inference
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(first, c.target_num_hidden_layers)]


def _random_starts(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    restart = torch.rand(1, T, generator=g) < 0.3
    restart[:, 0] = True
    return moa_hf.modeling.cycle_starts_from_restarts(restart)


def test_shapes_and_dtypes(family):
    target = make_target(family)
    drafter = moa_hf.build_drafter(target).eval()
    ids = torch.randint(3, 128, (2, 11))
    target_kv, _ = _target_kv(target, ids)
    c = drafter.config
    assert target_kv.shape == (2, 11, c.target_num_hidden_layers, c.target_kv_width)
    with drafter.attached(target):
        out = drafter(ids, target_kv=target_kv, cycle_starts=_random_starts(11).expand(2, -1))
        assert out.logits.shape == (2, 11, c.vocab_size) and out.logits.dtype == torch.float32
        assert out.hidden_states.shape == (2, 11, c.hidden_size)
        assert drafter.compute_context(TargetStates(target_kv)).shape == (2, 11, c.hidden_size)
        drafter_bf16 = moa_hf.build_drafter(target.to(torch.bfloat16)).to(torch.bfloat16).attach(target)
        out = drafter_bf16(ids, target_kv=target_kv.to(torch.bfloat16))
        assert out.hidden_states.dtype == torch.bfloat16 and out.logits.dtype == torch.float32
        assert torch.isfinite(out.logits).all()
    # one SA and one CA layer at the target's width (the paper's defaults)
    assert c.hidden_size == target.config.hidden_size
    assert c.num_hidden_layers == 1


@pytest.mark.parametrize("tli,latest", [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_incremental_equals_parallel(tli, latest):
    """Caches + incremental drafting give the logits of a from-scratch parallel pass with the same cycles (fp32);
    latest: the CA's input adds the newest verified context (`ca_latest_context`)."""
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target, target_layer_inference=tli, ca_latest_context=latest).eval().attach(target)
    if latest:
        with torch.no_grad():
            drafter.cross_attention.latest_proj.weight.normal_(0.0, 0.5)  # large enough to matter
    T = 24
    ids = torch.randint(3, 128, (1, T))
    starts = _random_starts(T, seed=tli)
    target_kv, tcache = _target_kv(target, ids)
    with torch.no_grad():
        ref = drafter(ids, target_kv=target_kv, cycle_starts=starts, target_tli_kv=_tli_kv(drafter, tcache)).logits
        context = drafter.compute_context(TargetStates(target_kv))
        cache = MoADrafterCache()
        for i in range(T):
            s = int(starts[0, i])
            if i == s:  # a new cycle: roll back to the verified length and read the newly verified context
                cache.crop(s)
                a, layers = cache.context_length, tcache.layers  # TLI: the target's own keys/values there
                tli_kv = {i: (layers[i].keys[:, :, a:s], layers[i].values[:, :, a:s]) for i in drafter.tli_layer_ids}
                drafter.extend_context(cache, context[:, a:s], tli_kv=tli_kv or None)
            logits = drafter.draft_step(ids[:, cache.get_seq_length() : i + 1], cache)
            assert_close(logits, ref[:, i])


@pytest.mark.parametrize("tli,cache_name", [(0, "past_key_values"), (1, "cache")])
def test_generate_uses_verified_context_only(tli, cache_name):
    """The drafting call of assisted generation sees exactly the target's state of verified tokens 0..n-2; the
    drafter's cache comes back under the installed transformers' name, whichever name it was passed under (5.24
    renamed `past_key_values` to `cache`), and the hook reads the target's cache under the installed name."""
    target = make_target("qwen2")
    drafter = moa_hf.build_drafter(target, target_layer_inference=tli).eval().attach(target)
    n, k = 9, 4
    ids = torch.randint(3, 128, (1, n))
    target(ids[:, :-1], use_cache=True, **{CACHE_NAME: DynamicCache(config=target.config)})  # hook captures it
    gc = GenerationConfig(do_sample=False, assistant_confidence_threshold=0.0)
    cache = MoADrafterCache()
    out = drafter.generate(ids, generation_config=gc, max_new_tokens=k, **{cache_name: cache})
    assert getattr(out, CACHE_NAME) is cache and cache.get_seq_length() > 0
    full = out.sequences
    assert full.shape[1] == n + k
    target_kv, tcache = _target_kv(target, full)
    starts = torch.arange(n + k).clamp(max=n - 1)[None]  # drafted positions: cycle starts at the bonus token
    ref = drafter(full, target_kv=target_kv, cycle_starts=starts, target_tli_kv=_tli_kv(drafter, tcache)).logits
    assert_close(torch.stack(out.scores, 1), ref[:, n - 1 : n - 1 + k])


def test_no_leakage_from_unverified_positions():
    target = make_target("mistral")
    drafter = moa_hf.build_drafter(target, target_layer_inference=1).eval().attach(target)
    T = 20
    ids = torch.randint(3, 128, (1, T))
    starts = _random_starts(T, seed=3)
    target_kv, tcache = _target_kv(target, ids)
    tli_kv = _tli_kv(drafter, tcache)
    with torch.no_grad():
        base = drafter(ids, target_kv=target_kv, cycle_starts=starts, target_tli_kv=tli_kv).logits
        for p in range(T):
            kv2 = target_kv.clone()
            kv2[:, p] += 5.0 * torch.randn_like(kv2[:, p])
            tli2 = [(k.clone(), v.clone()) for k, v in tli_kv]
            for k, v in tli2:
                k[:, :, p] += 3.0
                v[:, :, p] -= 3.0
            out = drafter(ids, target_kv=kv2, cycle_starts=starts, target_tli_kv=tli2).logits
            unaffected = starts[0] <= p  # positions whose cycle starts at or before p must not see p's state
            assert_close(out[:, unaffected], base[:, unaffected])
            assert not torch.allclose(out[:, ~unaffected], base[:, ~unaffected]) or not (~unaffected).any()


def test_save_and_load_native(tmp_path):
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    drafter.save_pretrained(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors" in files and "configuration_moa.py" in files and "modeling_moa.py" in files
    assert "drafting.py" in files and "lookup.py" in files  # the sibling files modeling_moa.py imports
    assert "generation_config.json" in files
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MoADrafterModel)
    assert loaded.config.auto_map["AutoModel"] == "modeling_moa.MoADrafterModel"
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    # the target's embedding/head are borrowed, not saved
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert loaded.generation_config.num_assistant_tokens == drafter.generation_config.num_assistant_tokens


def test_own_embeddings_saved_and_standalone(tmp_path):
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target, own_embeddings=True).eval()
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    cache = MoADrafterCache()
    logits = loaded.draft_step(torch.tensor([[5, 6, 7]]), cache)  # no target attached
    assert logits.shape == (1, 128) and cache.get_seq_length() == 3


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "moa_hf" or name.startswith("moa_hf."):
                raise ImportError("moa_hf is blocked in this test")
    sys.meta_path.insert(0, Block())
    try:
        import moa_hf  # noqa
        raise SystemExit("moa_hf should not be importable here")
    except ImportError:
        pass
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    assert drafter.lookup_settings.num_tokens == 4
    drafter.attach(target)
    ids = torch.tensor([[5, 9, 17, 33, 2 + 60]])
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert torch.equal(ref, out), (ref, out)
    assert drafter.speculation_stats.target_calls > 0
    drafter.detach()
    assert not target._forward_pre_hooks and not target._forward_hooks
    print("REMOTE-OK", drafter.speculation_stats.mean_accepted_length)
    """
)


def test_remote_code_without_moa_hf(tmp_path):
    target = make_target("llama")
    target.generation_config.eos_token_id = None
    drafter = moa_hf.build_drafter(target).eval()
    drafter.config.lookup_num_tokens = 4  # prompt lookup (lookup.py) runs from the remote code too
    drafter.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "tiny-random-llama")  # the name the drafter was built for
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "drafter"), str(tmp_path / "tiny-random-llama")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REMOTE-OK" in proc.stdout


# ---------------------------------------------------------------------------------------------- unsupported targets
def test_sliding_window_target_is_refused_for_target_layer_inference():
    """Sliding-window targets are served (tests/test_sliding.py), but not with TLI over a sliding layer."""
    target = make_target("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        MoADrafterConfig.from_target_config(target.config, target_layer_inference=1)


def test_hybrid_target_is_refused():
    """A linear-attention hybrid (sliding/full hybrids such as Gemma 2 are served: tests/test_sliding.py)."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    with pytest.raises(ValueError, match="linear_attention"):
        MoADrafterConfig.from_target_config(cfg)


def test_signature_and_vocab_mismatch_are_refused():
    drafter = moa_hf.build_drafter(make_target("llama"))
    with pytest.raises(ValueError, match="vocab_size: drafter 128 != target 256"):
        drafter.attach(make_target("llama", vocab_size=256))
    with pytest.raises(ValueError, match="target_num_hidden_layers"):
        drafter.attach(make_target("llama", num_hidden_layers=4))
    assert not drafter.is_attached


def test_wrong_target_for_saved_drafter_needs_opt_in():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target)
    assert drafter.config.target_name_or_path == "tiny-random-llama"
    other = make_target("llama", seed=1)
    other.config.name_or_path = "someone/another-model"
    with pytest.raises(ValueError, match="allow_other_target=True"):
        drafter.attach(other)
    assert not other._forward_pre_hooks
    drafter.attach(other, allow_other_target=True).detach()


def test_drafter_without_target_says_attach():
    drafter = moa_hf.build_drafter(make_target("llama"))
    with pytest.raises(RuntimeError, match="attach"):
        drafter.draft_step(torch.tensor([[3, 4]]), MoADrafterCache())


def test_speculation_settings_survive_save_and_load(tmp_path):
    """Every speculation setting, the drafter's own prompt lookup (`lookup_min_ngram` included), comes back."""
    drafter = moa_hf.build_drafter(make_target("llama"))
    drafter.generation_config.num_assistant_tokens = 7
    drafter.config.lookup_num_tokens, drafter.config.lookup_min_ngram = 9, 1
    drafter.save_pretrained(tmp_path)
    loaded = MoADrafterModel.from_pretrained(tmp_path)
    assert (loaded.generation_config.num_assistant_tokens, loaded.config.lookup_num_tokens) == (7, 9)
    assert (loaded.config.lookup_min_ngram, loaded.config.lookup_max_ngram) == (1, 3)
    assert loaded.lookup_settings == moa_hf.modeling.LookupSettings(num_tokens=9, max_ngram=3, min_ngram=1)
    gc = json.loads((tmp_path / "generation_config.json").read_text())
    assert not any("lookup" in key or "ngram" in key for key in gc)  # only keys transformers knows


def test_legacy_lookup_keys_move_from_generation_config_into_config(tmp_path):
    """Older drafters kept prompt lookup in their generation config: loading moves it into the config."""
    drafter = moa_hf.build_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    legacy = {
        "prompt_lookup_num_tokens": 24,
        "max_matching_ngram_size": 3,
        "prompt_lookup_min_ngram": 2,
        "prompt_lookup_halve_per_ngram": True,
    }
    gc_file = tmp_path / "generation_config.json"
    gc_file.write_text(json.dumps({**json.loads(gc_file.read_text()), **legacy}))
    loaded = MoADrafterModel.from_pretrained(tmp_path)
    assert loaded.lookup_settings == moa_hf.modeling.LookupSettings(24, 3, 2, True)
    gc = loaded.generation_config
    assert gc.prompt_lookup_num_tokens is None and gc.max_matching_ngram_size is None  # transformers' own: unset
    assert not hasattr(gc, "prompt_lookup_min_ngram") and not hasattr(gc, "prompt_lookup_halve_per_ngram")
    loaded.save_pretrained(tmp_path / "resaved")
    assert "lookup" not in (tmp_path / "resaved" / "generation_config.json").read_text()
    assert MoADrafterModel.from_pretrained(tmp_path / "resaved").lookup_settings == loaded.lookup_settings
    shipped = moa_hf.load_default_drafter()  # the shipped default drafter: lookup in its config.json
    assert shipped.lookup_settings == moa_hf.modeling.LookupSettings(24, 3, 1, True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lookup_num_tokens": -1}, "lookup_num_tokens must be >= 0"),
        ({"lookup_min_ngram": 0}, "lookup_min_ngram must be >= 1"),
        ({"lookup_min_ngram": 4, "lookup_max_ngram": 3}, r"lookup_max_ngram \(3\) must be >= lookup_min_ngram \(4\)"),
        ({"lookup_num_tokens": 2.5}, "lookup_num_tokens must be an integer"),
        ({"lookup_halve_per_ngram": "yes"}, "lookup_halve_per_ngram must be True or False"),
    ],
)
def test_invalid_lookup_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MoADrafterConfig(**fields)
    drafter = moa_hf.build_drafter(make_target("llama"))
    for key, value in {"lookup_num_tokens": 4, **fields}.items():  # changed after construction: refused on use
        setattr(drafter.config, key, value)
    with pytest.raises(ValueError, match=message):
        drafter.lookup_proposal(torch.tensor([[5, 6, 5]]), 4, 0, torch.tensor([], dtype=torch.long))


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_target_tap_reads_the_cache_under_either_name(name):
    """transformers up to 5.23 calls the target with `past_key_values=`, 5.24 on with `cache=`: the hook reads both,
    and a call with another cache object starts a new drafting session."""
    sessions = []
    tap = TargetTap(on_new_session=lambda: sessions.append(1))
    first, second = DynamicCache(), DynamicCache()
    tap.pre_hook(None, (), {name: first})
    tap.pre_hook(None, (), {name: first, "use_cache": True})
    assert tap.cache is first and tap.calls == 2 and not sessions
    tap.pre_hook(None, (), {name: second})
    assert tap.cache is second and sessions == [1]
    tap.pre_hook(None, (), {})  # no cache: counted, nothing else changes
    assert tap.cache is second and tap.calls == 4
