"""Loss pieces of MoA drafter training: chunked soft cross-entropy through a vocabulary-sized head, feature loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "batch_loss",
    "chunked_soft_cross_entropy",
    "depth_weighted",
    "exits_weighted",
    "feature_loss",
    "hard_cross_entropy",
    "position_losses",
]

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


def _soft_ce_and_grad(teacher_logits: torch.Tensor, logits: torch.Tensor, grad_dtype: torch.dtype):
    """(soft CE per row [n], its gradient wrt the student's logits [n, V] in `grad_dtype`) from both logits [n, V]:
    -sum_v p_t(v) log p_s(v) and p_s - p_t. Softmaxes upcast inside their kernels; the rest in place."""
    teacher = teacher_logits.softmax(-1, dtype=torch.float32)  # [n, V]
    log_student = logits.log_softmax(-1, dtype=torch.float32)  # [n, V]
    loss = -torch.linalg.vecdot(teacher, log_student)  # [n]
    return loss, log_student.exp_().sub_(teacher).to(grad_dtype)


class _ChunkedSoftCEWithHead(torch.autograd.Function):
    """Per-row soft CE through a trainable head, chunk by chunk, keeping d loss / d logits = softmax(student) -
    p_teacher ([N, V], the forward's dtype of logits) for the backward instead of recomputing the forward there.

    The backward re-runs the student head once per chunk to pass that gradient through it (its parameters get their
    gradients, the hidden states theirs); the teacher's head and both softmaxes run once. Used when N x V fits
    `STORED_GRAD_ELEMENTS`; the checkpointed path (recompute everything) otherwise.
    """

    @staticmethod
    def forward(ctx, student_hidden, teacher_hidden, student_head, teacher_head, chunk):  # noqa: D102
        losses, grads = [], []
        device = student_hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        store = torch.get_autocast_dtype(device) if autocast else torch.float32  # bf16 under bf16 autocast
        with torch.no_grad():
            for start in range(0, student_hidden.shape[0], chunk):
                teacher = teacher_head(teacher_hidden[start : start + chunk])  # [n, V]
                logits = student_head(student_hidden[start : start + chunk].detach())  # [n, V]
                loss, grad = _soft_ce_and_grad(teacher, logits, store)  # [n], d loss_r / d logits_r [n, V]
                losses.append(loss)
                grads.append(grad)
        ctx.save_for_backward(student_hidden, *grads)
        ctx.head, ctx.chunk, ctx.autocast = student_head, chunk, (device, autocast, store)
        return torch.cat(losses) if losses else student_hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        hidden, *grads = ctx.saved_tensors
        device, autocast, dtype = ctx.autocast
        out = []
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=autocast):
            for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk)):
                h = hidden[start : start + ctx.chunk].detach().requires_grad_(True)  # [n, d]
                logits = ctx.head(h)  # [n, V]: the head's parameters get their gradients from this pass
                upstream = grad_output[start : start + ctx.chunk, None] * grads[i].float()  # [n, V]
                torch.autograd.backward(logits, upstream.to(logits.dtype))
                out.append(h.grad)
        return (torch.cat(out) if out else torch.zeros_like(hidden)), None, None, None, None


STORED_GRAD_ELEMENTS = 1 << 27  # most N x V logit gradients kept for the backward (512 MB in float32)


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
            chunk, gradients computed on the fly. Otherwise the logits' gradients are kept for the backward, which
            runs the student head once more per chunk (`_ChunkedSoftCEWithHead`), or, when N x V exceeds
            `STORED_GRAD_ELEMENTS`, each chunk is recomputed whole in the backward (checkpointing).
    Returns: [N] float32 losses.
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"student rows ({student_hidden.shape[0]}) != teacher rows ({teacher_hidden.shape[0]})")
    if head_frozen is None:
        head_frozen = _head_is_frozen(student_head)
    if head_frozen:
        return _FusedChunkedSoftCE.apply(student_hidden, teacher_hidden, student_head, teacher_head, chunk_size)
    if student_hidden.shape[0] * _num_logits(student_head, student_hidden) <= STORED_GRAD_ELEMENTS:
        return _ChunkedSoftCEWithHead.apply(student_hidden, teacher_hidden, student_head, teacher_head, chunk_size)

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


def _num_logits(head: Head, hidden: torch.Tensor) -> int:
    """V: the number of logits `head` gives per row (one row through it, without gradients)."""
    with torch.no_grad():
        return int(head(hidden[:1].detach()).shape[-1])


def feature_loss(predicted: torch.Tensor, target: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """SmoothL1 (beta) per row, averaged over the hidden dimension: [N, d], [N, d] -> [N] float32."""
    return F.smooth_l1_loss(predicted.float(), target.float(), beta=beta, reduction="none").mean(-1)


def hard_cross_entropy(
    head: Head,
    draft_ids: torch.Tensor | None,
    vocab_size: int,
    student: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """[N] float32 cross-entropy of the drafter's `head` on `student` [N, d] to the target's own next tokens `labels`
    [N] (full-vocabulary ids); with `draft_ids` (the head's columns, a draft vocabulary), 0 where the label is outside
    it. `chunk` rows of logits at a time."""
    target = labels
    if draft_ids is not None:
        column = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
        column[draft_ids.to(labels.device)] = torch.arange(len(draft_ids), device=labels.device)
        target = column[labels]  # [N]: the label's column of the draft head, -1 outside it
    parts = [
        F.cross_entropy(head(student[i : i + chunk]).float(), target[i : i + chunk].clamp(min=0), reduction="none")
        for i in range(0, student.shape[0], chunk)
    ]
    ce = torch.cat(parts) if parts else student.new_zeros(0, dtype=torch.float32)
    return ce * (target >= 0)


def position_losses(
    args,
    drafter: nn.Module,
    student_head: tuple[Head, torch.Tensor | None],
    teacher_weight: torch.Tensor,
    student: torch.Tensor,
    feature: torch.Tensor | None,
    states,
    counted: torch.Tensor,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, soft CE, feature) loss per counted position, each [N] float32, N = counted.sum(), under the weights of
    `args` (`MoATrainingArguments`): soft_ce_weight x soft CE to the teacher + hard_ce_weight x CE to the label +
    feature_weight x SmoothL1 to the target's feature.

    student_head: (head, column ids) of the drafter (its adapter's `student_head`); teacher_weight: [V, d] the target's
    LM head; student: [B, T, d] the hidden states the drafter's head reads; feature: [B, T, d] the drafter's predicted
    target feature (None: no feature loss, e.g. an independent LM, trained by soft CE only); states: the batch's
    `TargetStates`; labels: [B, T] the next tokens, for the hard CE and `mask_outside_draft_vocab` (soft CE 0 where the
    label is outside the draft vocabulary)."""
    n = int(counted.sum())
    head, draft_ids = student_head
    feat = torch.zeros(n, device=student.device)
    if args.feature_weight > 0 and feature is not None:
        feat = feature_loss(feature[counted], states.feature[counted])
    ce = torch.zeros(n, device=student.device)
    if args.soft_ce_weight > 0 or feature is None:
        weight = teacher_weight
        if draft_ids is not None:
            weight = weight[draft_ids.to(weight.device)]  # [V', d]: the teacher over the draft vocab
            head_frozen = False
        else:  # the (borrowed or own) full-vocabulary output embedding
            head_frozen = not any(p.requires_grad for p in drafter.get_output_embeddings().parameters())

        def teacher_head(h: torch.Tensor) -> torch.Tensor:
            return F.linear(h.to(weight.dtype), weight).float()

        ce = chunked_soft_cross_entropy(
            student[counted],
            states.final_hidden[counted],
            lambda h: head(h).float(),
            teacher_head,
            chunk_size=args.vocab_chunk_size,
            head_frozen=head_frozen,
        )
        if args.mask_outside_draft_vocab and draft_ids is not None and labels is not None:
            ce = ce * torch.isin(labels[counted], draft_ids.to(labels.device))  # [N]: 0 where it cannot be right
    ce_weight = args.soft_ce_weight if feature is not None else 1.0  # an independent LM: soft CE only
    total = ce_weight * ce + args.feature_weight * feat
    if args.hard_ce_weight > 0 and labels is not None:
        vocab = drafter.config.vocab_size
        total = total + args.hard_ce_weight * hard_cross_entropy(
            head, draft_ids, vocab, student[counted], labels[counted], args.vocab_chunk_size
        )
    return total, ce, feat


def exits_weighted(
    exit_weights: list[float], per_exit: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, soft CE, feature) [N] of a drafter with several exits: each exit's `position_losses` weighted by
    `exit_weights` (exits of weight 0 left out)."""
    weighted = [(w, part) for w, part in zip(exit_weights, per_exit) if w > 0]
    total, ce, feat = (sum(w * part[i] for w, part in weighted) for i in range(3))
    return total, ce, feat


def depth_weighted(
    total: torch.Tensor, counted: torch.Tensor, cycle_starts: torch.Tensor | None, depth_decay: float
) -> torch.Tensor:
    """`total` [N] (per counted position of `counted` [B, T]) times `depth_decay ** depth`, the position's depth in its
    simulated cycle (`cycle_starts` [B, T]; 0 for a cycle's first draft); unchanged without decay or cycles."""
    if depth_decay >= 1.0 or cycle_starts is None:
        return total
    pos = torch.arange(counted.shape[1], device=counted.device)
    depth = (pos[None, :] - cycle_starts)[counted]  # [N]
    return total * depth_decay ** depth.to(total.dtype)


def batch_loss(total: torch.Tensor, counted: torch.Tensor, num_items_in_batch, args) -> torch.Tensor:
    """The loss of a micro-batch: the sum of `total` [N] over `num_items_in_batch` (the counted positions of the whole
    accumulated batch on all devices; None: this batch's `counted` ones), so that gradient accumulation and DDP match
    one large batch. `args`: `MoATrainingArguments`."""
    if num_items_in_batch is None:
        return total.sum() / counted.sum().clamp(min=1)
    loss = total.sum() / torch.as_tensor(num_items_in_batch, device=total.device).clamp(min=1)
    if args.average_tokens_across_devices and args.world_size > 1:
        loss = loss * args.world_size  # DDP averages gradients over processes; undo it
    return loss
