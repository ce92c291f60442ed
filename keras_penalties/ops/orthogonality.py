"""Orthogonality penalty for weight matrices."""

from typing import get_args

from keras import ops

from keras_penalties import _validation as check
from keras_penalties._types import OrthogonalityAxis, OrthogonalityMode, Tensor, TensorLike
from keras_penalties.ops import _dtypes as dtypes
from keras_penalties.ops import _numerics as num

MODES = get_args(OrthogonalityMode)
AXES = get_args(OrthogonalityAxis)


@check.options(mode=check.choice(*MODES), axis=check.choice(*AXES), normalize=check.boolean)
def orthogonality(
    w: TensorLike, *, mode: OrthogonalityMode = "soft", axis: OrthogonalityAxis = "columns", normalize: bool = True
) -> Tensor:
    """Penalises the Gram matrix of a weight's vectors for being far from I.

    `w` is reshaped to [−1, last] (a Conv kernel [h, w, in, out] becomes
    [h·w·in, out]); its vectors are the columns (`axis="columns"`, one per
    output unit) or the rows. G = VᵀV is the Gram matrix of those vectors,
    unit-normalised first if `normalize` (then only their directions count).

    mode:
        - `"soft"`: Σ_{i≠j} G_ij², decorrelation only;
        - `"hard"`: ‖G − I‖²_F, also pulls norms to 1 when not normalised;
        - `"spectral"`: σ_max(G − I), the largest singular value.

    Args:
        w: tensor of rank ≥ 2.
        mode, axis: as above.
        normalize: unit-normalise the vectors first (a zero vector stays zero).

    Returns:
        A scalar in w's float dtype.

    Example:

    >>> from keras_penalties import ops as P
    >>> round(float(P.orthogonality([[1.0, 1.0], [0.0, 1.0]])), 6)  # (cos 45°)², twice
    1.0
    >>> float(P.orthogonality([[1.0, 0.0], [0.0, 1.0]], mode="spectral"))
    0.0
    """
    (w,), dtype = dtypes.to_compute(w)
    if len(w.shape) < 2:
        raise ValueError(f"`w` must have rank >= 2 (a matrix or a kernel); got shape {tuple(w.shape)}.")
    rows: int | None = 1
    for d in w.shape[:-1]:
        rows = None if rows is None or d is None else rows * d
    if w.shape[-1] == 0 or rows == 0:
        raise ValueError(f"`w` reshaped to [-1, last] has no vectors or empty ones; got shape {tuple(w.shape)}.")
    v = ops.reshape(w, (-1, w.shape[-1]))
    if axis == "rows":
        v = ops.transpose(v)
    if normalize:
        norms = num.safe_norm(v, axis=0, keepdims=True)
        v = v / ops.where(norms > 0, norms, ops.ones_like(norms))
    gram = ops.einsum("ik,il->kl", v, v)
    eye = ops.eye(gram.shape[0], dtype=gram.dtype)
    if mode == "soft":
        value = ops.sum(ops.square(gram * (1.0 - eye)))
    elif mode == "hard":
        value = ops.sum(ops.square(gram - eye))
    else:
        value = ops.max(ops.svd(gram - eye, compute_uv=False))
    return dtypes.from_compute(value, dtype)
