"""JAX's distribution: Keras' `DataParallel`/`ModelParallel` batch is one
global array sharded over the devices, so every step sees the whole batch
(the replica functions are `common`'s, of one replica); a chunked op splits
its rows over the batch axis's devices (`shard_map`), and a variable is laid
out by the distribution in effect when it is made."""

import jax
import keras


def row_shards():
    """As `common.row_shards`: the devices on the batch axis of Keras'
    distribution (`DataParallel`, `ModelParallel`)."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)):
        return 1
    mesh = distribution.device_mesh
    return dict(zip(mesh.axis_names, mesh.shape))[distribution.batch_dim_name]


def data_parallel(chunks):
    """`(mesh, batch axis name)` where Keras' distribution (`DataParallel`,
    or `ModelParallel`) splits the batch over n > 1 devices and the
    `chunks` split evenly among them, else None."""
    devices = row_shards()
    if devices == 1 or not isinstance(chunks, int) or chunks % devices:
        return None
    distribution = keras.distribution.distribution()
    return distribution.device_mesh.backend_mesh, distribution.batch_dim_name


def shard_map(fn, mesh, in_specs, out_specs, axis):
    """`jax.shard_map` (`jax.experimental.shard_map` before 0.7) over the
    mesh axis `axis` alone, without replication checks: `fn` runs no
    collective over it, the cotangents of inputs not split on it (a kernel)
    are summed over its devices by shard_map's transpose, and the other
    axes stay XLA's (a kernel split on its vocabulary axis by
    `ModelParallel` stays split inside)."""
    manual = frozenset({axis})
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual, check_vma=False)
    from jax.experimental.shard_map import shard_map

    auto = frozenset(mesh.axis_names) - manual
    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False, auto=auto)


def variable_home(model=None):
    """The Keras distribution in effect: JAX lays a variable out by the
    distribution in effect when it is made."""
    return keras.distribution.distribution()
