"""Hypothesis' settings for the property tests (tests/test_ops_properties.py).

20 examples per property rather than hypothesis' default 100: on JAX every new
input shape compiles afresh, and at 50 those tests were 79 s of the JAX run
(make test measured 36.9 min from a clean clone, over its 35); 20 still draw
every shape class the strategies allow. No
deadline: a first call that compiles is not a slow example.
`HYPOTHESIS_PROFILE=thorough` runs 500.
"""

import os

from hypothesis import settings

settings.register_profile("suite", max_examples=20, deadline=None)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))
