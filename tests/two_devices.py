"""Two CPU devices for the distributed runs (tests/distributed_run.py,
tests/distributed_optimizers_run.py): device counts are fixed when the
framework starts, so each run calls `before_keras()` before it imports
Keras, and `split_tensorflow_cpu()` before TensorFlow runs anything.

Only a run's own process may call them: pytest imports these modules
(`--doctest-modules`) in the process that runs the rest of the suite. The
tests start each run with `report_of`.
"""

import json
import os
import subprocess
import sys


BACKEND = os.environ.get("KERAS_BACKEND", "jax")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 8  # the runs' global batch: 4 samples per replica


def regression_data(rng, targets):
    """32 samples of 6 normal features and `targets` normal targets, float32."""
    return rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, targets)).astype("float32")


def before_keras(devices=2):
    """JAX: `devices` virtual host devices (`XLA_FLAGS`, read when JAX
    starts). Every backend: torch imported before TensorFlow (the other
    order crashes here)."""
    if BACKEND == "jax":
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def split_tensorflow_cpu():
    """Makes TensorFlow's CPU two logical devices ("/cpu:0", "/cpu:1")."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def distributed(mode):
    """The scope of two devices: JAX's `DataParallel`, or `ModelParallel`
    sharding the kernels of the layers named dense_a and dense_b; TF's
    `MirroredStrategy` on the two logical CPUs."""
    import keras

    if BACKEND == "jax":
        devices = keras.distribution.list_devices("cpu")
        assert len(devices) == 2, devices
        if mode == "data_parallel":
            return keras.distribution.DataParallel(devices=devices).scope()
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["dense_a/kernel"] = (None, "model")
        layout_map["dense_b/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope()
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope()


def report_of(module, *args, backend=BACKEND, timeout=600):
    """Runs `python -m module *args` on `backend` in a fresh process (the
    tests' side: device counts are fixed when the framework starts) and
    returns the JSON its last line prints; its stderr's tail if it fails."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
