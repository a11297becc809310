"""The reference verify page (moa_hf.speculative): greedy prefixes, speculative sampling's exact distribution."""

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from moa_hf.speculative import (
    MIN_TEMPERATURE,
    greedy_accept,
    sampling_warpers,
    speculative_accept,
    target_probs,
    verify,
)

# 0.999 quantiles of the chi-square distribution by degrees of freedom (a fixed seed makes the test deterministic;
# the bound says the sampled counts are the expected ones up to sampling noise)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def logits_with_argmax(preds: list[int], vocab: int = 8) -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randn(len(preds), vocab)  # [k+1, V]
    logits[torch.arange(len(preds)), torch.tensor(preds)] = 10.0
    return logits


@pytest.mark.parametrize(
    "drafts, preds, expected",
    [
        ([], [3], (0, 3)),  # nothing drafted: the target's own token
        ([3, 5, 1], [3, 5, 1, 7], (3, 7)),  # all accepted: the bonus token
        ([4, 5, 1], [3, 5, 1, 7], (0, 3)),  # the first is wrong: the target's correction
        ([3, 5, 2], [3, 5, 1, 7], (2, 1)),  # the last is wrong
        ([3, 6, 1], [3, 5, 1, 7], (1, 5)),  # later matches after a mismatch do not count
    ],
)
def test_greedy_accepts_the_longest_matching_prefix(drafts, preds, expected):
    logits = logits_with_argmax(preds)
    drafts = torch.tensor(drafts, dtype=torch.long)
    assert greedy_accept(logits, drafts) == expected
    assert verify(logits, drafts) == expected  # no warpers: greedy


def test_warpers_are_applied_to_the_target_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 10)  # [k+1, V]
    torch.testing.assert_close(target_probs(logits, sampling_warpers(0.5)), (logits / 0.5).softmax(-1))
    assert len(sampling_warpers()) == 0  # temperature 1, no top-k, no top-p: nothing to apply
    top2 = target_probs(logits, sampling_warpers(top_k=2))
    assert ((top2 > 0).sum(-1) == 2).all()
    kept = logits.topk(2).indices  # [k+1, 2]
    torch.testing.assert_close(top2.gather(-1, kept), logits.gather(-1, kept).softmax(-1))
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    nucleus = target_probs(probs.log(), sampling_warpers(top_p=0.7))  # the smallest set reaching 0.7: 0.5 + 0.3
    torch.testing.assert_close(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_processors_see_the_verified_tokens_and_the_drafts_before_each_position():
    """With input_ids, row i is processed after the verified tokens and the first i drafts (as in `generate`)."""
    logits = torch.ones(3, 6)  # [k+1, V]: uniform before the penalty
    input_ids = torch.tensor([0, 3, 4])  # verified [0], drafts [3, 4]
    probs = target_probs(logits, LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)]), input_ids)
    penalised = probs < probs.max(-1, keepdim=True).values  # [k+1, V]
    assert penalised.nonzero().tolist() == [[0, 0], [1, 0], [1, 3], [2, 0], [2, 3], [2, 4]]


def test_tiny_temperature_is_greedy_and_zero_is_refused():
    logits = logits_with_argmax([3, 5, 1])
    logits[1, 2] = 9.999  # nearly tied: any sampling at a tiny temperature still takes the argmax
    drafts = torch.tensor([3, 2])
    for temperature in (1e-40, MIN_TEMPERATURE / 2):
        assert sampling_warpers(temperature) is None
        assert verify(logits, drafts, sampling_warpers(temperature, top_k=2, top_p=0.5)) == (1, 5)
    p = target_probs(logits, sampling_warpers(MIN_TEMPERATURE))  # the smallest sampling temperature: finite
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))
    for temperature in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            sampling_warpers(temperature)


def _chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the counts of `tokens` against probabilities `p` [V]; tokens that p
    gives no probability must never appear."""
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    expected = p.double() * tokens.shape[0]
    assert counts[p == 0].sum() == 0, "sampled a token the processed target distribution excludes"
    support = p > 0
    return float(((counts - expected)[support] ** 2 / expected[support]).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("q_kind", ["dense", "sparse", "one-hot"])
def test_sampled_tokens_follow_the_processed_target_distribution(q_kind):
    """Every emitted position follows the target's processed p, whatever the drafter's q (Leviathan et al. 2023)."""
    vocab, k, trials = 6, 3, 10_000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=g)  # [k+1, V]
    p = target_probs(logits, sampling_warpers(temperature=0.8, top_k=5, top_p=0.95))  # [k+1, V]
    assert ((p == 0).sum(-1) >= 1).all()  # the top-k/top-p filters remove tokens: p is the processed one
    q = (logits[:k] + 0.7 * torch.randn(k, vocab, generator=g)).softmax(-1)  # [k, V]: near p, also where p is 0
    if q_kind == "sparse":
        q = q * (q >= q.topk(3).values[:, -1:])  # [k, V]: its top-3 tokens only
        q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=g) for i in range(k)], 1)
    # one-hot: each trial's drafts are deterministic (e.g. prompt lookup), whatever chose them
    q_arg = {"dense": q, "sparse": q.to_sparse(), "one-hot": None}[q_kind]
    emitted = torch.full((trials, k + 1), -1)  # [trials, k+1]: the tokens of each trial, -1 past its end
    for t in range(trials):
        accepted, token = speculative_accept(p, drafts[t], q_arg, g)
        emitted[t, :accepted] = drafts[t, :accepted]
        emitted[t, accepted] = token
    tested = 0
    for j in range(k + 1):
        tokens = emitted[emitted[:, j] >= 0, j]
        if tokens.shape[0] < 1000:
            continue
        stat, df = _chi_square(tokens, p[j])
        assert stat < CHI2_999[df], (q_kind, j, stat, df)
        tested += 1
    assert tested >= 3  # the first position and later ones, reached through accepted drafts


def test_speculative_accept_with_q_equal_to_p_accepts_everything():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(4, 7, generator=g).softmax(-1)  # [k+1, V]
    for _ in range(200):
        drafts = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(3)])  # [k]
        assert speculative_accept(p, drafts, p[:3], g)[0] == 3
