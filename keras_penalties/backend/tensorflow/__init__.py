"""The TensorFlow backend: `tf.GradientTape` and a `tf.function` probe
(`autodiff`); TF's fused label cross-entropy and an exp of the log-softmax
(`kernels`); the chunk loops as while loops with a custom gradient
(`chunks`), in blocks under XLA (`blocks`), and what they ask of a trace
(`tracing`); `tf.distribute` (`distribution`)."""
