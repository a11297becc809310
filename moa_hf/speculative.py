"""The verify page of speculative decoding: how many drafted tokens the target accepts, and its next token.

Inputs: the target's logits [k+1, V] at the k drafted positions and one more (the bonus position), the drafts [k].
- Greedy: accept the longest prefix of the drafts equal to the target's argmax; the next token is the target's
  argmax right after it (a correction, or the bonus token when every draft is accepted).
- Sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1):
  accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the next token from
  norm(max(0, p_i - q_i)); when every draft is accepted, sample the bonus token from p_{k+1}. Whatever q is, the
  emitted tokens follow p exactly. q: the drafter's distributions [k, V] (dense or a torch sparse tensor), or None
  for deterministic drafts (q one-hot, e.g. prompt lookup).
p is the softmax of the target's logits after transformers' logits processors (`sampling_warpers`: temperature,
top-k, top-p, as `generate(do_sample=True)` builds them).

Temperatures below `MIN_TEMPERATURE` sample greedily (the limit of temperature -> 0; dividing logits by such a
temperature overflows to inf and NaN probabilities), as vLLM does; temperatures <= 0 are refused.
"""

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

__all__ = ["MIN_TEMPERATURE", "greedy_accept", "sampling_warpers", "speculative_accept", "target_probs", "verify"]

MIN_TEMPERATURE = 1e-5


def sampling_warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> LogitsProcessorList | None:
    """transformers' warpers of `generate(do_sample=True, temperature=, top_k=, top_p=)`, in its order (top_k=0 and
    top_p=1 filter nothing). None for a temperature below MIN_TEMPERATURE: sample greedily."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; for greedy decoding use do_sample=False.")
    if temperature < MIN_TEMPERATURE:
        return None
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    return warpers


def target_probs(logits: torch.Tensor, processors: LogitsProcessorList, input_ids: torch.Tensor | None = None):
    """p [k+1, V]: softmax of the logits [k+1, V] after `processors`. With `input_ids` [n+k] (verified tokens, then
    the drafts) row i is processed after input_ids[:n+i], as transformers' assisted decoding does (for processors
    that read the sequence, e.g. a repetition penalty); None: all rows at once (warpers ignore input_ids)."""
    if input_ids is None:
        return processors(None, logits).softmax(-1)  # [k+1, V]
    n = input_ids.shape[-1] - logits.shape[0] + 1
    rows = [processors(input_ids[None, : n + i], logits[i : i + 1]) for i in range(logits.shape[0])]  # [1, V] each
    return torch.cat(rows).softmax(-1)  # [k+1, V]


def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """(accepted, next token): the longest prefix of `drafts` [k] equal to the argmax of `logits` [k+1, V]."""
    preds = logits.argmax(-1)  # [k+1]
    accepted = int((preds[:-1] == drafts).int().cumprod(0).sum())
    return accepted, int(preds[accepted])


def speculative_accept(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None = None, generator=None):
    """(accepted, next token) by speculative sampling: p [k+1, V] the target's probabilities, q [k, V] the drafter's
    (None: one-hot drafts). The random numbers come from `generator` (one uniform per draft, then one sample)."""
    k = drafts.shape[0]
    if q is not None and q.is_sparse:
        q = q.to_dense()  # [k, V]
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, drafts]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q[rows, drafts]  # [k]
    u = torch.rand(k, generator=generator, device=p.device)  # [k]
    accepted = int((u * q_x <= p_x).int().cumprod(0).sum())  # u <= p/q: accept with probability min(1, p/q)
    if accepted == k:
        return k, int(torch.multinomial(p[k], 1, generator=generator))
    q_i = torch.nn.functional.one_hot(drafts[accepted], p.shape[-1]).to(p.dtype) if q is None else q[accepted]  # [V]
    residual = (p[accepted] - q_i).clamp_min(0.0)  # [V]
    if not residual.sum() > 0:  # p == q up to rounding: a rejection had probability ~0
        residual = p[accepted]
    return accepted, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def verify(logits, drafts, warpers=None, q=None, generator=None, input_ids=None) -> tuple[int, int]:
    """(accepted, next token): greedy when `warpers` is None, else speculative sampling of the warped logits."""
    if warpers is None:
        return greedy_accept(logits, drafts)
    return speculative_accept(target_probs(logits, warpers, input_ids), drafts, q, generator)
