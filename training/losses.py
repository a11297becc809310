"""Loss pieces of MoA drafter training: chunked soft cross-entropy through a vocabulary-sized head, feature loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_soft_cross_entropy", "feature_loss"]

Head = Callable[[torch.Tensor], torch.Tensor]


def _soft_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """-sum_v p_teacher(v) log p_student(v) per row: [n, V], [n, V] -> [n] (float32)."""
    teacher = teacher_logits.float().softmax(-1)
    return -(teacher * student_logits.float().log_softmax(-1)).sum(-1)


class _FusedChunkedSoftCE(torch.autograd.Function):
    """Per-row soft CE through a frozen head, chunk by chunk; each row's gradient is computed in the forward.

    Only the [N, d] gradient is kept for the backward, never [N, V] logits or probabilities. Valid because the head
    has no trainable parameters (its only input that needs a gradient is the hidden state).
    """

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, student_head, teacher_head, chunk):  # noqa: D102
        losses, grads = [], []
        for start in range(0, student_hidden.shape[0], chunk):
            h = student_hidden[start : start + chunk].detach().requires_grad_(True)  # [n, d]
            with torch.no_grad():
                teacher_logits = teacher_head(teacher_hidden[start : start + chunk])  # [n, V]
            with torch.enable_grad():
                loss = _soft_ce(student_head(h), teacher_logits)  # [n]
                (grad,) = torch.autograd.grad(loss.sum(), h)  # row r's loss depends on h[r] only
            losses.append(loss.detach())
            grads.append(grad)
        ctx.save_for_backward(torch.cat(grads) if grads else student_hidden.new_zeros(student_hidden.shape))
        return torch.cat(losses) if losses else student_hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        (grads,) = ctx.saved_tensors
        return grad_output[:, None].to(grads.dtype) * grads, None, None, None, None


def _head_is_frozen(head: Head) -> bool:
    owner = getattr(head, "__self__", None)  # a bound method such as drafter.head
    modules = [m for m in (head, owner) if isinstance(m, nn.Module)]
    if isinstance(owner, nn.Module) and hasattr(owner, "get_output_embeddings"):
        out = owner.get_output_embeddings()
        modules = [out] if isinstance(out, nn.Module) else modules
    return all(not p.requires_grad for m in modules for p in m.parameters())


def chunked_soft_cross_entropy(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: Head,
    teacher_head: Head,
    chunk_size: int = 1024,
    head_frozen: bool | None = None,
) -> torch.Tensor:
    """Soft cross-entropy per row between teacher and student next-token distributions, never holding more than
    `chunk_size` x V logits at a time (forward and backward).

    Args:
        student_hidden: [N, d] hidden states the `student_head` turns into logits (gradients flow into them).
        teacher_hidden: [N, d_t] hidden states the `teacher_head` turns into the target distribution (no gradient).
        student_head, teacher_head: callables hidden -> logits [n, V].
        head_frozen: whether `student_head` has no trainable parameters (guessed when None). Frozen: one head pass per
            chunk, gradients computed on the fly. Otherwise each chunk is recomputed in the backward (checkpointing)
            so the head's parameters get their gradients too.
    Returns: [N] float32 losses.
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"student rows ({student_hidden.shape[0]}) != teacher rows ({teacher_hidden.shape[0]})")
    if head_frozen is None:
        head_frozen = _head_is_frozen(student_head)
    if head_frozen:
        return _FusedChunkedSoftCE.apply(student_hidden, teacher_hidden, student_head, teacher_head, chunk_size)

    def one_chunk(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher_head(t)
        return _soft_ce(student_head(h), teacher_logits)

    parts = [
        checkpoint(
            one_chunk, student_hidden[s : s + chunk_size], teacher_hidden[s : s + chunk_size], use_reentrant=False
        )
        for s in range(0, student_hidden.shape[0], chunk_size)
    ]
    return torch.cat(parts) if parts else student_hidden.new_zeros(0, dtype=torch.float32)


def feature_loss(predicted: torch.Tensor, target: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """SmoothL1 (beta) per row, averaged over the hidden dimension: [N, d], [N, d] -> [N] float32."""
    return F.smooth_l1_loss(predicted.float(), target.float(), beta=beta, reduction="none").mean(-1)
