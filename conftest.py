"""pytest configuration for tests/ and the doctests in keras_penalties/.

The suite runs once per backend, chosen by KERAS_BACKEND."""

# torch must be imported before tensorflow: the other order crashes the
# process in this environment (Keras' own conftest does the same).
try:
    import torch  # noqa: F401
except ImportError:
    pass

import keras
import pytest
from hypothesis import HealthCheck, settings

# Derandomized so a CI failure reproduces; no deadline because the first call
# of an op on a backend includes its tracing/compilation.
settings.register_profile(
    "keras_penalties",
    deadline=None,
    derandomize=True,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("keras_penalties")


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture
def policy(request):
    """A global dtype policy for one test (parametrize with indirect=True),
    reset to float32 afterwards."""
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")
