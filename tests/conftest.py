"""Hypothesis' settings for the property tests (tests/test_ops_properties.py).

50 examples per property rather than hypothesis' default 100: on JAX every new
input shape compiles afresh, and those tests were 70 s of the JAX run; 50
still draw every shape class the strategies allow many times over. No
deadline: a first call that compiles is not a slow example.
`HYPOTHESIS_PROFILE=thorough` runs 500.
"""

import os

from hypothesis import settings

settings.register_profile("suite", max_examples=50, deadline=None)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))
