"""Distillation over a teacher's top-k ids: the forward KL between the
teacher's and the student's log-probabilities of the same K ids a
position, with one more bin for the rest of the vocabulary."""

from keras import ops

from keras_penalties import _validation as check
from keras_penalties import backend
from keras_penalties._types import Tensor, TensorLike, TokenReduction
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num
from keras_penalties.ops import _reductions as reductions


def _log_rest(logprobs):
    """(1 − Σ_k e^l, its log) over the last axis: the mass outside the K
    ids, −expm1(logsumexp(l)), 0 where they hold all of it; its log formed
    at logsumexp(l) ≤ −1e-7 (finite there, about −16.1)."""
    total = ops.logsumexp(logprobs, axis=-1)
    return num.clamp(-ops.expm1(total), low=0.0), num.log1m_exp(total)


def _plogp_ratio(t, s):
    """Σ_k p_k (t_k − s_k), p = e^t, with 0·log 0 = 0: an id the teacher
    gives probability 0 (t = −inf) adds 0, not NaN, in the value and the
    gradient."""
    p = ops.exp(t)
    return ops.sum(ops.where(p > 0, p * (reductions.fill_masked(t, p > 0) - s), ops.zeros_like(p)), axis=-1)


@check.options(tensors=("mask",), tail=check.boolean, reduction=check.TOKEN_REDUCTION)
def topk_kl(
    teacher_logprobs: TensorLike,
    student_logprobs: TensorLike,
    *,
    tail: bool = True,
    mask: TensorLike | None = None,
    reduction: TokenReduction = "mean",
) -> Tensor:
    """Forward KL over a teacher's top-k ids: Σ_k p_k (log p_k − log q_k).

    `teacher_logprobs` and `student_logprobs` are [..., K]: each model's
    log-probabilities of the same K ids at each position (the teacher's
    top-k, the student's gathered with `token_logprobs` and [..., K]
    labels). With `tail`, one more bin holds the rest of the vocabulary,
    p_rest = 1 − Σ_k p_k (as −expm1(logsumexp(teacher_logprobs)); likewise
    q_rest), as verl's `forward_kl_topk` and TRL's `loss_add_tail`: the
    value is then a KL between two distributions over K + 1 bins, ≥ 0,
    and 0 exactly where p_rest is. Without it the K ids are summed as they
    are, not renormalised, and the value can be negative. The gradient
    reaches the student side only.

    Args:
        teacher_logprobs: [..., K], a constant.
        student_logprobs: [..., K], the same shape.
        tail: add the rest-of-vocabulary bin.
        mask: None, or the positions that count (the shape without K).
        reduction: as `kl_estimate`'s.

    Returns:
        The reduced KL, in the student's dtype (computed in float32 from
        half inputs).

    Raises:
        ValueError: an unknown `reduction`, shapes that differ, a mask of
            another shape, a sequence reduction on positions of a rank
            other than 2.

    Example:

    >>> import math
    >>> from keras_penalties import ops as P
    >>> # p = (½, ¼) and rest ¼ against q = (¼, ¼) and rest ½: ½ ln 2 − ¼ ln 2
    >>> t, s = [math.log(0.5), math.log(0.25)], [math.log(0.25), math.log(0.25)]
    >>> round(float(P.topk_kl(t, s)), 6), round(0.25 * math.log(2), 6)
    (0.173287, 0.173287)
    """
    teacher, student = backend.as_tensor(teacher_logprobs), backend.as_tensor(student_logprobs)
    check.check_same_shape(("teacher_logprobs", "student_logprobs"), teacher, student)
    check.check_rank("student_logprobs", student, 1, "K log-probabilities a position, last")
    rank = len(student.shape) - 1
    check.check_sequence_rank(reduction, rank, "the positions (every axis but K)")
    mask = reductions.sample_mask(mask, student, rank)
    compute, dtype = dtypes.dtype_pair([student])
    # A masked position may hold anything (a row padded with -inf).
    t = ops.stop_gradient(reductions.fill_masked(ops.cast(teacher, compute), mask))
    s = reductions.fill_masked(dtypes.cast_to(student, compute), mask)
    values = _plogp_ratio(t, s)
    if tail:
        p_rest, log_p_rest = _log_rest(t)
        _, log_q_rest = _log_rest(s)
        values = values + p_rest * (log_p_rest - log_q_rest)
    return dtypes.from_compute(reductions.masked_reduce(values, mask, reduction), dtype)
