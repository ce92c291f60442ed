"""The JAX backend: `jax.grad` and a jitted probe (`autodiff`); a gather
whose gradient XLA fuses (`kernels`); the chunk loops as `custom_vjp` scans
(`chunks`), the kernel's gradient summed a block at a time on CPU
(`blocks`); a `DataParallel`/`ModelParallel` batch is one global sharded
array, whose rows the chunk loops split over its devices
(`distribution`). Everything else is `common`'s: XLA fuses Keras' own ops."""
