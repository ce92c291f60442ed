"""The TensorFlow backend: `tf.GradientTape` and a `tf.function` probe
(`autodiff`); TF's fused label cross-entropy and an exp of the log-softmax
(`kernels`); the chunk loops as while loops with a custom gradient
(`chunks`), a chunk's loss in blocks of rows where XLA compiles it and
the kernel's gradient summed a block of its rows at a time (`blocks`), and
what they ask of a trace (`tracing`); `tf.distribute` (`distribution`)."""
