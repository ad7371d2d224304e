"""The README's pure-API example runs as written."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    assert namespace["y"].shape == (8, 256)
    assert namespace["params"]["w"].shape == (24, 256, 256)
    assert bool(jnp.isfinite(namespace["grads"]["w"]).all())
