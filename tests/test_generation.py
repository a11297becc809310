"""Generation: the drafter as a lossless drop-in for `target.generate(assistant_model=drafter)`."""

import copy
import random

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.streamers import BaseStreamer

import moa_hf
from moa_hf import MoADrafterModel
from moa_hf.bench import acceptance_length, count_forward_calls
from moa_hf.modeling import CacheReader, TargetStates, gather_target_kv

from factory import OracleDrafter, make_target
from tolerance import assert_close


def _oracle(target, reference, p_right, seed=0, **overrides):
    drafter = moa_hf.build_drafter(target, **overrides).eval()
    oracle = OracleDrafter(drafter.config).eval()
    oracle.load_state_dict(drafter.state_dict())
    oracle.reference, oracle.p_right, oracle.rng = reference, p_right, random.Random(seed)
    return oracle


@pytest.mark.parametrize("p_right", [0.0, 0.6, 0.9])
def test_greedy_equality_many_prompts(family, p_right):
    target = make_target(family)
    rng = random.Random(f"{family}-{p_right}")  # deterministic (str hashing is salted per process)
    lengths = set()
    for trial in range(5):
        ids = torch.tensor([[rng.randrange(3, 128) for _ in range(rng.randrange(1, 20))]])
        new = rng.randrange(1, 40)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        drafter = _oracle(target, ref[0].tolist(), p_right, seed=trial, target_layer_inference=trial % 2)
        drafter.generation_config.num_assistant_tokens = rng.choice([1, 4, 6, 8])
        drafter.generation_config.assistant_confidence_threshold = 0.0
        with moa_hf.attached(drafter, target), count_forward_calls(target) as calls:
            out = target.generate(ids, max_new_tokens=new, do_sample=False, assistant_model=drafter)
            stats = drafter.speculation_stats
        assert torch.equal(out, ref), (family, trial)
        assert stats.generated_tokens == new and len(stats.accepted_lengths) == stats.target_calls
        # the drafter's own count is the one definition of acceptance length (bench's, tune's), prefill included
        assert stats.target_calls == calls.calls
        assert stats.mean_accepted_length == pytest.approx(acceptance_length(new, calls.calls))
        lengths.update(stats.accepted_lengths)
    if p_right == 0.0:
        assert lengths == {1}
    if p_right == 0.9:
        assert len(lengths) >= 4, lengths  # many acceptance lengths exercised


def test_random_drafter_equality_and_fresh_sessions():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0
    with moa_hf.attached(drafter, target):
        for seed in range(3):
            torch.manual_seed(seed)
            ids = torch.randint(3, 128, (1, 5 + seed * 7))
            ref = target.generate(ids, max_new_tokens=25, do_sample=False)
            out = target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=drafter)
            assert torch.equal(out, ref)
            stats = drafter.speculation_stats
            assert stats.generated_tokens == 25  # counted for this call only: a new session per generate call
            assert stats.draft_time_s > 0 and stats.verify_time_s > 0


def _spy_on_sync(drafter) -> list:
    """Record (cache, num_verified) of every `_sync` call (an attribute of our own drafter, not of the target)."""
    calls, real_sync = [], drafter._sync

    def spy(cache, num_verified):
        calls.append((cache, num_verified))
        return real_sync(cache, num_verified)

    drafter._sync = spy
    return calls


def test_hooks_read_exactly_the_verified_positions():
    target = make_target("llama")
    ref = target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, ref[0].tolist(), 0.7)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    with moa_hf.attached(drafter, target):
        calls = _spy_on_sync(drafter)
        out = target.generate(ref[:, :4], max_new_tokens=30, do_sample=False, assistant_model=drafter)
        reads = drafter._session.context_reads
    assert torch.equal(out, ref)
    # one read per cycle after the first, contiguous, ending at the last verified token that has target state
    assert reads[0][0] == 0 and all(a[1] == b[0] for a, b in zip(reads, reads[1:]))
    assert [end for _, end in reads] == [n - 1 for _, n in calls[1:]]
    # and the context the drafter accumulated equals the one computed from the final verified sequence
    full = target(out[:, :-1], use_cache=True, past_key_values=DynamicCache(config=target.config)).past_key_values
    with torch.no_grad():
        expect = drafter.compute_context(TargetStates(gather_target_kv(full, 0, reads[-1][1])))
        cache = moa_hf.MoADrafterCache()
        drafter.extend_context(cache, expect)
    accumulated = calls[-1][0]  # the drafter's cache as generation left it
    assert all(cache_of_call is accumulated for cache_of_call, _ in calls)  # one cache for the whole generation
    assert accumulated.context_length == reads[-1][1] <= out.shape[1] - 2  # the last token came after a cycle
    assert_close(accumulated.ca_keys, cache.ca_keys)
    assert_close(accumulated.ca_values, cache.ca_values)


def test_read_context_in_padded_chunks_equals_one_lsa_call():
    """The LSA reads each token on its own: chunked, zero-padded reads give the same context vectors."""
    from moa_hf.modeling.modeling_moa import CONTEXT_CHUNK

    torch.manual_seed(0)
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    ids = torch.randint(3, target.config.vocab_size, (2, 2 * CONTEXT_CHUNK + 7))
    cache = target(ids, use_cache=True, past_key_values=DynamicCache(config=target.config)).past_key_values
    with torch.no_grad():
        for start, end in [(0, 1), (0, CONTEXT_CHUNK), (3, CONTEXT_CHUNK + 4), (0, ids.shape[1]), (10, 10)]:
            got = drafter.read_context(CacheReader(cache), start, end)
            assert got.shape == (2, end - start, drafter.config.hidden_size)
            want = drafter.compute_context(TargetStates(gather_target_kv(cache, start, end))) if end > start else got
            assert_close(got, want)


def test_hooks_removed_after_detach_and_exception():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target)
    assert not target._forward_pre_hooks and not target._forward_hooks
    drafter.attach(target)
    assert len(target._forward_pre_hooks) == 1 and len(target._forward_hooks) == 1
    drafter.detach()
    assert not target._forward_pre_hooks and not target._forward_hooks
    with pytest.raises(KeyError):
        with moa_hf.attached(drafter, target):
            target.generate(torch.tensor([[3, 4]]), max_new_tokens=3, assistant_model=drafter)
            raise KeyError("boom")
    assert not target._forward_pre_hooks and not target._forward_hooks and not drafter.is_attached
    state = {k: v.clone() for k, v in target.state_dict().items()}
    with moa_hf.attached(drafter, target):
        target.generate(torch.tensor([[3, 4]]), max_new_tokens=5, assistant_model=drafter)
    assert not target._forward_pre_hooks and not target._forward_hooks
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in state.items())  # target untouched


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_generate_options_keep_working():
    target = make_target("qwen2")
    ids = torch.randint(3, 128, (1, 9))
    ref_plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, ref_plain[0].tolist(), 0.8)
    eos = int(ref_plain[0, 9 + 12])  # a token the target really produces, used as EOS
    cases = [
        dict(max_new_tokens=17),
        dict(max_new_tokens=30, eos_token_id=eos),
        dict(max_new_tokens=30, eos_token_id=eos, min_new_tokens=20),
        dict(max_new_tokens=25, repetition_penalty=1.3),
        dict(max_new_tokens=20, attention_mask=torch.ones_like(ids)),
        dict(max_new_tokens=20, no_repeat_ngram_size=2),
    ]
    with moa_hf.attached(drafter, target):
        for kwargs in cases:
            ref = target.generate(ids, do_sample=False, **kwargs)
            out = target.generate(ids, do_sample=False, assistant_model=drafter, **kwargs)
            assert torch.equal(out, ref), kwargs
        # streamer receives exactly the generated tokens (the prompt first, as transformers does)
        streamer = _Collect()
        out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter, streamer=streamer)
        assert streamer.tokens == out[0].tolist() and streamer.ended
        # return_dict_in_generate with scores
        ref = target.generate(
            ids, do_sample=False, max_new_tokens=15, return_dict_in_generate=True, output_scores=True
        )
        out = target.generate(
            ids,
            do_sample=False,
            max_new_tokens=15,
            return_dict_in_generate=True,
            output_scores=True,
            assistant_model=drafter,
        )
        assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(ref.scores) == 15
        for a, b in zip(out.scores, ref.scores):
            assert_close(a, b)
        stats = drafter.speculation_stats  # the oracle's drafts were verified and some accepted (not plain decoding)
        assert stats.drafted_tokens > 0 and stats.mean_accepted_length > 1.0


def test_left_padded_single_prompt():
    target = make_target("llama")
    ids = torch.tensor([[0, 0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    drafter = moa_hf.build_drafter(target).eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0  # a random drafter: draft every step
    with moa_hf.attached(drafter, target):
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, assistant_model=drafter)
        assert drafter.speculation_stats.drafted_tokens > 0  # it drafted (the stats go with the attachment)
    assert torch.equal(out, ref)


def test_batch_above_one_is_refused_clearly():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    with moa_hf.attached(drafter, target):
        with pytest.raises(ValueError, match="batch_size = 1"):
            target.generate(torch.randint(3, 128, (2, 5)), max_new_tokens=4, assistant_model=drafter)
        with pytest.raises(ValueError, match="one sequence at a time"):
            drafter.generate(torch.randint(3, 128, (2, 5)), max_new_tokens=4)


class NoisyCopyDrafter(MoADrafterModel):
    """Proposes from the target's logits pushed towards its third choice: q far from p, often rejected."""

    # `oracle`: an unhooked copy of the target, set by the test

    def draft_step(self, new_ids, cache):
        super().draft_step(new_ids, cache)
        with torch.no_grad():
            logits = self.oracle(cache.tokens).logits[:, -1].float()
        third = logits.topk(3, dim=-1).indices[0, 2]  # strongly prefer the target's third choice: q far from p
        logits[0, third] += 6.0
        return logits


def _exact_pair_distribution(target, ids, processors):
    """P(t1, t2) under the target with the given logits processors."""
    with torch.no_grad():
        l1 = processors(ids, target(ids).logits[:, -1].float())
        p1 = l1.softmax(-1)[0]
        joint = {}
        for t1 in torch.nonzero(p1 > 0).flatten().tolist():
            ids2 = torch.cat([ids, torch.tensor([[t1]])], 1)
            p2 = processors(ids2, target(ids2).logits[:, -1].float()).softmax(-1)[0]
            for t2 in torch.nonzero(p2 > 0).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def peaky_pair_distribution():
    """A target with peaky next-token distributions, a prompt, and the exact P(t1, t2) of its next two tokens under
    temperature 0.9 and top-k 3 (what `_sampled_pairs_p_value` samples with)."""
    target = make_target("llama", seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaky distributions: a few likely tokens
    ids = torch.tensor([[7, 21, 40]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(3)])
    return target, ids, _exact_pair_distribution(target, ids, processors)


def _sampled_pairs_p_value(target, drafter, ids, joint, n=600, each=None) -> tuple[float, int]:
    """Sample the next two tokens n times with the drafter; chi-square p-value against the exact `joint`, and how
    many samples accepted a drafted token. `each()` runs after every sample (extra checks)."""
    kw = dict(do_sample=True, top_k=3, temperature=0.9, max_new_tokens=2)
    counts, accepted, start = {}, 0, ids.shape[1]
    torch.manual_seed(0)
    with moa_hf.attached(drafter, target):
        for _ in range(n):
            key = tuple(target.generate(ids, assistant_model=drafter, **kw)[0, start : start + 2].tolist())
            counts[key] = counts.get(key, 0) + 1
            accepted += drafter.speculation_stats.accepted_lengths[0] > 1
            if each is not None:
                each()
    assert set(counts) <= set(joint), "sampled a pair the target gives zero probability"
    keys = [k for k in joint if joint[k] * n >= 5]
    rest = 1.0 - sum(joint[k] for k in keys)
    chi2 = sum((counts.get(k, 0) - n * joint[k]) ** 2 / (n * joint[k]) for k in keys)
    df = len(keys) - 1
    if rest * n >= 5:
        observed_rest = n - sum(counts.get(k, 0) for k in keys)
        chi2 += (observed_rest - n * rest) ** 2 / (n * rest)
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(chi2 / 2.0))), accepted


@pytest.mark.slow
def test_sampling_follows_target_distribution():
    """Speculative sampling with the drafter's processed scores keeps the target's distribution (chi-square test)."""
    target, ids, joint = peaky_pair_distribution()
    drafter = NoisyCopyDrafter(moa_hf.build_drafter(target).config).eval()  # close to, not equal to, the target
    drafter.oracle = copy.deepcopy(target)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    drafter.generation_config.num_assistant_tokens = 2
    p_value, accepted = _sampled_pairs_p_value(target, drafter, ids, joint)
    assert p_value > 1e-3, p_value
    assert accepted > 0  # drafts were really accepted, so speculative sampling was exercised


# ---------------------------------------------------------------------------------------------------------------------
# Prompt lookup inside the drafter (its config's `lookup_num_tokens`)
# ---------------------------------------------------------------------------------------------------------------------
def test_lookup_continuation_picks_longest_recent_match():
    from moa_hf.modeling.lookup import lookup_continuation

    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 3, 5, 6, 7])
    assert lookup_continuation(ids, 3, 4).tolist() == [3, 5, 6, 7]  # most recent "5 6 7" with 4 tokens after it
    assert lookup_continuation(ids, 3, 2).tolist() == [3, 5]
    assert lookup_continuation(ids, 3, 10).tolist() == [8, 9, 5, 6, 7, 3, 5, 6, 7]  # none has 10: the earliest
    assert lookup_continuation(torch.tensor([1, 2, 1, 2, 1, 2]), 2, 4).tolist() == [1, 2, 1, 2]
    assert lookup_continuation(torch.tensor([1, 2, 3, 2]), 3, 4).tolist() == [3, 2]  # falls back to a 1-gram
    assert lookup_continuation(torch.tensor([1, 2, 3, 2]), 3, 4, min_ngram=2).numel() == 0
    assert lookup_continuation(torch.tensor([4]), 3, 4).numel() == 0


def test_lookup_halving_gives_shorter_matches_fewer_tokens():
    from moa_hf.modeling.lookup import lookup_continuation

    three = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])  # the suffix 3-gram "1 2 3" recurs
    two = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])  # only the 2-gram "1 2"
    one = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1])  # only the 1-gram "1"
    for ids in (three, two, one):  # without halving every match proposes 8 tokens
        assert len(lookup_continuation(ids, 3, 8)) == 8
    assert lookup_continuation(three, 3, 8, halve_per_ngram=True).tolist() == [4, 5, 6, 7, 8, 9, 1, 2]
    assert lookup_continuation(two, 3, 8, halve_per_ngram=True).tolist() == [3, 4, 5, 6]  # 8 // 2
    assert lookup_continuation(one, 3, 8, halve_per_ngram=True).tolist() == [2, 3]  # 8 // 4
    assert lookup_continuation(one, 3, 1, halve_per_ngram=True).tolist() == [2]  # at least one token
    assert lookup_continuation(two, 2, 8, halve_per_ngram=True).tolist() == [3, 4, 5, 6, 7, 8, 9, 10]  # 2 is longest


def test_lookup_index_grown_piecewise_matches_the_scan():
    """`LookupIndex` (the engine's per-row index, extended as the row grows) proposes what a scan of the whole text
    (`lookup_continuation`) does, at every length, for every n-gram range, cap and halving; and `propose` takes it."""
    from moa_hf.modeling.lookup import LookupIndex, LookupSettings, lookup_continuation

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = 2 + trial % 5  # small vocabularies: many repeats
        text = torch.randint(vocab, (60,), generator=g)
        max_ngram, min_ngram = 1 + trial % 3, 1 + (trial // 3) % 2
        index, T = LookupIndex(max_ngram, min_ngram), 0
        while T < len(text):
            step = int(torch.randint(1, 6, (), generator=g))
            index.extend(text[T : T + step].tolist())
            T = min(len(text), T + step)
            for k, halve in [(1, False), (4, False), (8, True), (30, False)]:
                want = lookup_continuation(text[:T], max_ngram, k, min_ngram, halve) if max_ngram >= min_ngram else []
                assert index.continuation(k, halve) == list(want), (trial, T, k, halve)
    settings = LookupSettings(num_tokens=5)
    index = settings.index()
    index.extend([5, 6, 2, 9, 9, 5, 6])  # "5 6" was followed by eos (2)
    assert settings.propose(index, 5, 0, torch.tensor([2])).tolist() == [2]
    assert settings.propose(index, 5, 1, torch.tensor([2])) is None


def test_lookup_proposal_halving_from_config_and_capped():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    config = drafter.config
    assert config.lookup_halve_per_ngram is False  # off unless a drafter's settings turn it on
    config.lookup_num_tokens = 8
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]])  # "1 2" recurs: a 2-gram match, 8 tokens after it
    none = torch.tensor([], dtype=torch.long)
    assert drafter.lookup_proposal(ids, 8, 0, none).tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    config.lookup_halve_per_ngram = True
    assert drafter.lookup_proposal(ids, 8, 0, none).tolist() == [3, 4, 5, 6]  # 2-gram, longest 3: half of 8
    assert drafter.lookup_proposal(ids, 3, 0, none).tolist() == [3, 4, 5]  # then transformers' cap


def test_lookup_stops_at_eos_and_respects_min_new_tokens():
    target = make_target("llama")
    drafter = moa_hf.build_drafter(target).eval()
    drafter.config.lookup_num_tokens = 5
    ids = torch.tensor([[5, 6, 2, 9, 9, 5, 6]])  # "5 6" was followed by eos (2)
    eos = torch.tensor([2])
    assert drafter.lookup_proposal(ids, 5, 0, eos).tolist() == [2]
    assert drafter.lookup_proposal(ids, 5, 1, eos) is None  # eos banned for now: nothing left to propose
    drafter.config.lookup_num_tokens = 0
    assert drafter.lookup_proposal(ids, 5, 0, eos) is None


@pytest.mark.parametrize("tli", [0, 1])
def test_lookup_hybrid_is_exact_and_reads_context_lazily(tli):
    """Lookup cycles skip the network; the next network cycle reads every verified position it missed, once."""
    target = make_target("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]])
    ref = target.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = _oracle(target, ref[0].tolist(), 0.6, target_layer_inference=tli)
    gc = drafter.generation_config
    drafter.config.lookup_num_tokens, gc.num_assistant_tokens, gc.assistant_confidence_threshold = 6, 6, 0.0
    with moa_hf.attached(drafter, target):
        seen = _spy_on_sync(drafter)
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        stats, reads = drafter.speculation_stats, drafter._session.context_reads
    assert torch.equal(out, ref)
    assert stats.lookup_cycles > 0 and stats.lookup_cycles < len(stats.accepted_lengths)  # both kinds of cycles
    assert stats.lookup_tokens <= stats.drafted_tokens and stats.generated_tokens == 40
    assert reads[0][0] == 0 and all(a[1] == b[0] for a, b in zip(reads, reads[1:]))  # contiguous, no gaps
    # the CA memory built lazily equals the one computed at once from the final target cache
    cache = seen[-1][0]
    full = target(out[:, :-1], use_cache=True, past_key_values=DynamicCache(config=target.config)).past_key_values
    with torch.no_grad():
        eager, M = moa_hf.MoADrafterCache(), cache.context_length
        states = TargetStates(gather_target_kv(full, 0, M))
        tli_kv = {i: (full.layers[i].keys[:, :, :M], full.layers[i].values[:, :, :M]) for i in drafter.tli_layer_ids}
        drafter.extend_context(eager, drafter.compute_context(states), tli_kv=tli_kv or None)
    assert_close(cache.ca_keys, eager.ca_keys)
    assert_close(cache.ca_values, eager.ca_values)
    assert len(cache.tli_layers) == tli
    assert cache.tli_valid is None if not tli else bool(cache.tli_valid.all())
    for lazy, once in zip(cache.tli_layers, eager.tli_layers):  # TLI memory: the target's keys/values as read at once
        assert_close(lazy.keys[:, :, :M], once.keys)
        assert_close(lazy.values[:, :, :M], once.values)


def test_lookup_sampling_follows_target_distribution():
    """One-hot scores of looked-up tokens keep speculative sampling exact (chi-square test on two tokens)."""
    target = make_target("llama", seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(3)])
    with torch.no_grad():  # a prompt "7 21 x 7 21" after which x is the target's likeliest token
        grid = torch.tensor([[7, 21, x, 7, 21] for x in range(128)])
        p_x = target(grid).logits[:, -1].float().softmax(-1)[torch.arange(128), torch.arange(128)]  # [128]
    ids = grid[int(p_x.argmax())][None]  # lookup proposes "x 7" after "7 21"
    joint = _exact_pair_distribution(target, ids, processors)
    assert max(joint.values()) > 0.2  # the looked-up pair is likely enough to be accepted often
    drafter = moa_hf.build_drafter(target).eval()
    drafter.config.lookup_num_tokens = 2
    drafter.generation_config.num_assistant_tokens = 2

    def used_lookup():
        assert drafter.speculation_stats.lookup_cycles >= 1

    p_value, accepted = _sampled_pairs_p_value(target, drafter, ids, joint, n=600, each=used_lookup)
    assert p_value > 1e-3, p_value
    assert accepted > 60  # looked-up drafts were really accepted, so speculative sampling was exercised


@pytest.mark.parametrize("p_right", [1.0, 0.8])
def test_fully_accepted_cycles_keep_the_drafter_cache(p_right):
    """transformers calls `crop(-0)` after a fully accepted draft: nothing may be dropped (no context re-read)."""
    target = make_target("llama")
    ref = target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=30, do_sample=False)
    drafter = _oracle(target, ref[0].tolist(), p_right)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    drafter.generation_config.num_assistant_tokens = 4
    with moa_hf.attached(drafter, target):
        out = target.generate(ref[:, :4], max_new_tokens=30, do_sample=False, assistant_model=drafter)
        reads, stats = drafter._session.context_reads, drafter.speculation_stats
    assert torch.equal(out, ref) and max(stats.accepted_lengths) == 5
    assert all(a[1] == b[0] for a, b in zip(reads, reads[1:])), reads  # every position read once, in order
    cache = moa_hf.MoADrafterCache()
    with moa_hf.attached(drafter, target):
        drafter.draft_step(torch.arange(3, 9)[None], cache)  # six slots
    cache.crop(-0)
    assert cache.get_seq_length() == 6
    cache.crop(-2)
    assert cache.get_seq_length() == 4
    cache.truncate(0)
    assert cache.get_seq_length() == 0
