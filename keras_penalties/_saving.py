"""A hint in every saved config for loading without `import keras_penalties`.

Keras looks a config's class up among its registered objects, then among its
own classes of the same name: a `.keras` file saved with this package's `L2`
loads, in a process that has not imported the package, Keras' own `L2` with
our options, and fails with "unexpected keyword argument 'factor'" deep in a
traceback. Each config therefore opens with a key that no Keras class takes
and that says what to do, so that error names it; `from_config` drops it.
"""

HINT = "import_keras_penalties_before_loading"


def with_hint(config):
    return {HINT: True, **config}


def without_hint(config):
    config = dict(config)
    config.pop(HINT, None)
    return config
