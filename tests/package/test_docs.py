"""The docs' examples run as written: every ```python block of a page, in order, in one
namespace (a page reads as one session), with its own asserts."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.slow  # see "Fast tests" in README.md

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = ["patterns.md", "checkpoints.md", "optimizers.md", "finetune.md"]


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page):
    text = (DOCS / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, f"{page} has no python examples"
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOCS / page} (example {i + 1})", "exec"), namespace)  # noqa: S102
