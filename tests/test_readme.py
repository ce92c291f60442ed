"""The README's Python examples run as written on the current backend."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    if "import keras_hub" in BLOCKS[index]:
        pytest.importorskip("keras_hub", reason="keras-hub is an optional extra (Python 3.11+)")
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})


def test_readme_has_examples():
    assert BLOCKS
