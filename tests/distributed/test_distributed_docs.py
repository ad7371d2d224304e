"""The worked examples of docs/distributed.md run, on 8 simulated CPU devices.

Every ```python block whose first line is ``# example: <name>`` is one example; each
runs in its own namespace in one subprocess (see ``_CASES``) and checks its own
results with ``assert``.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from _multidevice import result, run_cases, run_module

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


def _examples() -> dict[str, str]:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return {
        m.group(1): block
        for block in blocks
        if (m := re.match(r"# example: (\w+)\n", block))
    }


def _run(source: str, name: str):
    def case():
        exec(compile(source, f"docs/distributed.md: example {name}", "exec"), {})
        return {}

    return case


_CASES = {name: _run(source, name) for name, source in _examples().items()}


@pytest.fixture(scope="module")
def multi_device():
    pytest.importorskip("haiku")
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    return run_module(__file__, timeout=600)


def test_one_example_per_framework_and_a_pipeline():
    assert sorted(_examples()) == [
        "haiku", "linen", "nnx", "pipeline", "pipeline_1f1b", "pipeline_decode", "pipeline_fsdp"
    ]


@pytest.mark.parametrize("name", sorted(_examples()))
def test_example_runs(multi_device, name):
    result(multi_device, name)


if __name__ == "__main__":
    run_cases(_CASES)
