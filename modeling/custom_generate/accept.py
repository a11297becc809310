"""The acceptance rules of speculative decoding, chains and trees, greedy and sampling: one home.

Chains (k drafted tokens, the target's logits [k+1, V] at them and one more, the bonus position):
- Greedy (`greedy_accept`): the longest prefix of the drafts equal to the target's argmax; the next token is the
  target's argmax right after it (a correction, or the bonus token when every draft is accepted).
- Sampling (`speculative_accept`; Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding", Algorithm 1): accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
  sample the next token from norm(max(0, p_i - q_i)); when every draft is accepted, sample the bonus token from
  p_{k+1}. Whatever q is, the emitted tokens follow p exactly. q: the drafter's distributions [k, V] (dense or a
  torch sparse tensor), or None for deterministic drafts (q one-hot, e.g. prompt lookup).

Trees (N drafted nodes per row, parents first; logits [B, 1+N, V] at the root and every node):
- Greedy (`greedy_accept_tree`): node i is accepted iff every ancestor-or-self j holds the target's argmax after
  j's parent: accepted = not any(A[i, j] and not match[j]) with A the tree's ancestor matrix. The accepted nodes
  form one path (siblings hold distinct tokens); the deepest is its end. No per-node Python walk.
- Sampling (`accept_path`; SpecInfer / Miao et al. 2024, multi-candidate speculative sampling with deterministic
  drafts): at each node visit the distinct children in order; accept child x with probability p(x) / (mass of p
  not yet removed); on a rejection remove x from p; when every child was rejected, sample from what is left. Each
  emitted token follows the target's p exactly (see docs/design.md).
p is the softmax of the target's logits after transformers' logits processors (`sampling_warpers`: temperature,
top-k, top-p, as `generate(do_sample=True)` builds them).

Temperatures below `MIN_TEMPERATURE` sample greedily (the limit of temperature -> 0; dividing logits by such a
temperature overflows to inf and NaN probabilities), as vLLM does; temperatures <= 0 are refused.

This file ships inside every published drafter repo (custom_generate/): it imports only torch and transformers.
"""

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

__all__ = [
    "MIN_TEMPERATURE",
    "accept_path",
    "greedy_accept",
    "greedy_accept_tree",
    "sampling_warpers",
    "speculative_accept",
    "target_probs",
    "verify",
]

MIN_TEMPERATURE = 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# Chains
# ---------------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------------------------------
def greedy_accept_tree(tokens, parents, depth, real, anc, argmax, max_depth: int):
    """Greedy acceptance over a verified tree, every row at once.

    tokens/parents/depth/real [B, N] (the tree), anc [B, N, N] ancestors-or-self, argmax [B, 1+N] the target's
    argmax at the root and at each node, max_depth >= depth.max(). Returns length [B] (accepted drafts), path
    [B, max_depth] (the accepted nodes in order, -1 after the row's end) and next [B] (the target's token after it).
    """
    B, N = tokens.shape
    after_parent = argmax.gather(1, parents + 1)  # [B, N] the target's token after each node's parent
    match = real & (tokens == after_parent)  # [B, N]
    accepted = ~(anc & ~match[:, None, :]).any(-1)  # [B, N]: every ancestor-or-self matches
    length, end = torch.where(accepted, depth, 0).max(-1)  # [B]: the deepest accepted node and its depth
    on_path = anc[torch.arange(B, device=tokens.device), end] & (length > 0)[:, None]  # [B, N]
    slot = torch.where(on_path, depth - 1, max_depth)  # [B, N]: a path node's place on the path; others: dropped
    path = torch.full((B, max_depth + 1), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, torch.arange(N, device=tokens.device).expand(B, N))
    nxt = argmax.gather(1, torch.where(length > 0, end + 1, 0)[:, None])[:, 0]  # [B]
    return length, path[:, :max_depth], nxt


def accept_path(tokens: list, parents: list, real: list, scores_at, do_sample: bool, generator=None):
    """One row's accepted path through a verified tree and the target's next token: (node indices, token), for
    sampling and for logits processors that read the sequence.

    `scores_at(node, path)`: the target's processed scores [V] after the node (-1: the root) given the accepted
    path's nodes. Greedy: follow the child equal to the argmax while there is one. Sampling with deterministic drafts
    (each child's draft probability is one): visit the distinct children in order; accept child x with probability
    p(x) / (mass not yet removed); on a rejection remove x from p; when every child was rejected, sample from what
    is left."""
    children: dict[int, list[int]] = {}
    for i, (p, r) in enumerate(zip(parents, real)):
        if r:
            children.setdefault(p, []).append(i)
    node, path = -1, []
    while True:
        scores = scores_at(node, path)  # [V]
        kids = children.get(node, ())
        if not do_sample:
            best = int(scores.argmax())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = scores.float().softmax(-1)
            nxt = None
            for c in kids:
                x = tokens[c]
                mass, px = float(p.sum()), float(p[x])
                if px > 0 and float(torch.rand((), generator=generator, device=p.device)) * mass < px:
                    nxt = c
                    break
                p[x] = 0.0
            if nxt is None:
                if not float(p.sum()) > 0:  # rounding left no mass: the target's own distribution
                    p = scores.float().softmax(-1)
                return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(nxt)
        node = nxt
