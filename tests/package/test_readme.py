"""The README: its first screen says what stackwise is and why; its examples run as written
(each ```python block is a whole program, in a fresh namespace, with the shapes its comments
state); its two commands use separate environments, and CI finds its test command."""

import pathlib
import re
import subprocess

import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
#: What each block must leave behind, in the README's order: the framework of each.
EXPECTED = ["jax", "haiku", "flax", "nnx", "equinox"]
FRAMEWORKS = EXPECTED[1:5]


def run_block(i: int) -> dict:
    namespace: dict = {"__name__": "__main__"}
    exec(compile(BLOCKS[i], f"{README} (python block {i + 1})", "exec"), namespace)  # noqa: S102
    return namespace


def test_the_blocks_are_the_ones_these_tests_check():
    assert len(BLOCKS) == len(EXPECTED)
    for block, framework in zip(BLOCKS[1:5], FRAMEWORKS):
        assert f"stackwise.{framework}.Stack" in block and block.startswith("import ")


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


def test_the_example_run_time_is_one_figure_everywhere():
    # The README, the example's --help (its package's docstring) and the tuning page: the same
    # seconds.
    pattern = r"(\d+) s on 2 idle CPU cores"
    pages = [README, ROOT / "examples" / "lm" / "__init__.py", ROOT / "docs" / "example-tuning.md"]
    figures = {page.name: re.findall(pattern, " ".join(page.read_text().split())) for page in pages}
    assert all(len(found) == 1 for found in figures.values()), figures
    assert len({found[0] for found in figures.values()}) == 1, figures


def test_the_first_screen_says_what_and_why():
    # The first screen (before the example): what it is, and the tools it is compared with.
    first = README.read_text().split("## In code")[0]
    assert len(first.splitlines()) <= 40
    assert "runs one layer `n` times in JAX as a single `lax.scan`" in " ".join(first.split())
    for tool in ("hk.layer_stack", "nn.scan", "nnx.scan", "hand-written `lax.scan`"):
        assert tool in first, tool
    # Its figures name their machine and the command that measured them.
    assert "Intel Xeon" in first and "stackwise-bench --blocks decode" in first
    # The decode a user gets (stacked), the loop's (the serving layout), on the CPU and the TPU.
    for said in ("the decode you get by default", "`stackwise.to_serving`", "TPU v5e"):
        assert said in " ".join(first.split()), said


def setup_commands() -> list[str]:
    setup = README.read_text().split("## Set up")[1].split("\n## ")[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, re.S)


def test_the_two_commands_use_separate_environments():
    example, tests = setup_commands()
    assert example.startswith("python3 -m venv .venv-example && . .venv-example/bin/activate")
    assert example.endswith("python examples/transformer_lm.py")
    # Editable: a non-editable install is shadowed, in the clone's root, by its `stackwise/`
    # folder, which holds no adapters (tests/misuse/test_misuse_install.py).
    assert "&& pip install -e '.[all]' &&" in example
    assert tests.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    # The first command's description says how long it runs and how to shorten it.
    setup = README.read_text().split("## Set up")[1].split("```bash")[0]
    assert "--steps" in setup and "1,600 steps" in setup


def test_ci_runs_the_readme_test_command():
    # .ci/run's own grep finds exactly one command: the README's second.
    ci = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r"grep -x '([^']+)' README.md", ci).group(1)
    found = subprocess.run(
        ["grep", "-x", pattern, str(README)], capture_output=True, text=True
    ).stdout.splitlines()
    assert found == [setup_commands()[1]]


def test_the_links_to_the_docs_resolve():
    links = re.findall(r"\]\(([^)#]+\.md)\)", README.read_text())
    assert "docs/contributing.md" in links and "docs/features.md" in links
    for link in links:
        assert (ROOT / link).is_file(), link
