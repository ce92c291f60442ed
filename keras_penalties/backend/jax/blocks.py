"""JAX's kernel gradient of a chunk of logits formed from hidden states:
one product, or on CPU a block of the kernel's rows at a time (XLA:CPU
fuses no dot with an add). Used by `chunks` only."""

import jax
import keras


def kernel_grad(hidden, dlogits, transpose_kernel):
    """∂/∂kernel of Σ dlogits·(hidden @ kernel): hiddenᵀ·dlogits [H, V], or
    dlogitsᵀ·hidden [V, H] for a transposed (tied) kernel."""
    first, second = (dlogits, hidden) if transpose_kernel else (hidden, dlogits)
    return jax.lax.dot_general(first, second, (((0,), (0,)), ((), ())))


def add_kernel_grad(total, hidden, dlogits, transpose_kernel):
    """total + kernel_grad(hidden, dlogits); on CPU a block at a time (see
    `_add_kernel_grad_in_blocks`). The blocks were measured on CPU only,
    and XLA:GPU's GEMM rewriter can fold the add into the product (cuBLAS's
    beta) where a loop of small products would cost a launch each: on other
    platforms, and where variables may be sharded, it stays the plain sum."""
    if jax.default_backend() != "cpu" or _model_parallel():
        return total + kernel_grad(hidden, dlogits, transpose_kernel)
    return _add_kernel_grad_in_blocks(total, hidden, dlogits, transpose_kernel)


def _model_parallel():
    """Whether Keras' distribution splits variables (a `ModelParallel` mesh
    with a non-batch axis over several devices). A kernel may then be
    sharded on its vocabulary axis, which the blocks of a tied kernel's
    gradient slice: XLA gathered each chunk's [chunk, V] logits gradient
    for them, and left the kernel's gradient replicated."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.ModelParallel):
        return False
    mesh = distribution.device_mesh
    return any(size > 1 for name, size in zip(mesh.axis_names, mesh.shape) if name != distribution.batch_dim_name)


def _add_kernel_grad_in_blocks(total, hidden, dlogits, transpose_kernel):
    """total + kernel_grad(hidden, dlogits), a block of the kernel's rows at
    a time (a loop: each block's product is added, in place, before the
    next is formed), each block about the size of the chunk's logits.

    XLA:CPU fuses no dot with an add: the whole [H, V] product would be a
    temporary beside the sum. A [H, V] kernel's blocks are rows of H (slices of
    the chunk's hidden columns), a [V, H] one's rows of V (slices of the
    logits' gradient columns)."""
    rows, features = hidden.shape
    classes = dlogits.shape[1]
    length = classes if transpose_kernel else features
    block = max(1, rows * classes // features) if transpose_kernel else rows
    if length <= block:
        return total + kernel_grad(hidden, dlogits, transpose_kernel)

    def product(start, size):
        if transpose_kernel:
            return kernel_grad(hidden, jax.lax.dynamic_slice_in_dim(dlogits, start, size, 1), True)
        return kernel_grad(jax.lax.dynamic_slice_in_dim(hidden, start, size, 1), dlogits, False)

    def add(total, start, size):
        so_far = jax.lax.dynamic_slice_in_dim(total, start, size, 0)
        return jax.lax.dynamic_update_slice_in_dim(total, so_far + product(start, size), start, 0)

    total = jax.lax.fori_loop(0, length // block, lambda b, t: add(t, b * block, block), total)
    if length % block:
        total = add(total, length - length % block, length % block)
    return total
