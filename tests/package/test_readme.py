"""The README's examples run as written: each ```python block is a whole program (a fresh
namespace, so every name it uses is imported in it), with the shapes its comments state.
Its references to a section of another page name a heading that page has."""

import pathlib
import re

import jax.numpy as jnp
import pytest
from _tolerance import assert_close, reassociation_bound

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
#: What each block must leave behind, in the README's order: the framework of each.
EXPECTED = ["jax", "haiku", "flax", "nnx", "equinox", "optax"]
FRAMEWORKS = EXPECTED[1:5]


def run_block(i: int) -> dict:
    namespace: dict = {"__name__": "__main__"}
    exec(compile(BLOCKS[i], f"{README} (python block {i + 1})", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_blocks_are_the_ones_these_tests_check():
    assert len(BLOCKS) == len(EXPECTED)
    for block, framework in zip(BLOCKS[1:5], FRAMEWORKS):
        assert f"stackwise.{framework}.Stack" in block and block.startswith("import ")
    assert "stackwise.optax.layerwise" in BLOCKS[5] and BLOCKS[5].startswith("import ")


def test_readme_example_runs():
    namespace = run_block(0)
    assert namespace["y"].shape == (8, 256)
    assert namespace["params"]["w"].shape == (24, 256, 256)
    assert bool(jnp.isfinite(namespace["grads"]["w"]).all())


@pytest.mark.parametrize("framework", FRAMEWORKS)  # (the fast tier runs the first)
def test_readme_framework_example_runs(framework):
    pytest.importorskip({"haiku": "haiku", "nnx": "flax"}.get(framework, framework))
    namespace = run_block(EXPECTED.index(framework))
    linear = {
        "haiku": lambda ns: ns["params"]["stack/block/linear"]["w"],
        "flax": lambda ns: ns["variables"]["params"]["Stack_0"]["Dense_0"]["kernel"],
        "nnx": lambda ns: ns["blocks"].layers.linear.kernel,
        "equinox": lambda ns: ns["blocks"].layers.linear.weight,
    }[framework](namespace)
    assert linear.shape == (24, 64, 64)  # as the block's comment says
    assert namespace["y"].shape == ((64,) if framework == "equinox" else (8, 64))
    assert bool(jnp.isfinite(namespace["y"]).all())


def test_readme_optimizer_example_runs():
    pytest.importorskip("optax")
    import optax

    namespace = run_block(EXPECTED.index("optax"))
    params, grads = namespace["params"], namespace["grads"]
    # Each layer of blocks/w gets the update LAMB gives that layer alone, as in the loop.
    # LAMB's trust ratio divides two norms, each a sum over the layer's 8 x 8 entries, taken in
    # another order batched: 6 * (2 * sqrt(64) + 1) = 102 eps of the update (tests/_tolerance.py).
    bound = reassociation_bound(depth=1, width=8 * 8)
    for i in range(4):
        layer = {"w": params["blocks"]["w"][i]}
        tx = optax.lamb(1e-3)
        want, _ = tx.update({"w": grads["blocks"]["w"][i]}, tx.init(layer), layer)
        assert_close(namespace["updates"]["blocks"]["w"][i], want["w"], bound, what=f"layer {i}")
    plain, _ = optax.lamb(1e-3).update(grads, optax.lamb(1e-3).init(params), params)
    assert not jnp.allclose(plain["blocks"]["w"], namespace["updates"]["blocks"]["w"])


def test_section_references_name_existing_headings():
    # `page.md`, "Heading": the page has that heading (at any level).
    text = " ".join(README.read_text().split())
    references = re.findall(r"`([\w/.-]+\.md)`, \"([^\"]+)\"", text)
    assert references, "the README names no section any more: drop this test"
    for page, heading in references:
        headings = re.findall(r"(?m)^#+ (.+)$", (ROOT / page).read_text())
        assert heading in headings, f"{page} has no heading {heading!r}: {headings}"


def test_the_example_run_time_is_one_figure_everywhere():
    # The README, the example's --help (its docstring) and the tuning page: the same seconds.
    pattern = r"(\d+) s on 2 idle CPU cores"
    pages = [README, ROOT / "examples" / "transformer_lm.py", ROOT / "docs" / "example-tuning.md"]
    figures = {page.name: re.findall(pattern, " ".join(page.read_text().split())) for page in pages}
    assert all(len(found) == 1 for found in figures.values()), figures
    assert len({found[0] for found in figures.values()}) == 1, figures
