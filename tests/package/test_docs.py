"""The docs' examples run as written, as each page says it reads.

A page whose top says it is **one session** runs its ```python blocks in order, in one
namespace; on every other page each block is a whole program, run in a fresh namespace.
A block whose info string is ``python fragment`` is an excerpt (or changes the whole process)
and says so in its first line: it is not run. Two pages are run elsewhere: the ``>>>`` blocks of
``conversion.md`` as a doctest (tests/adapters/test_convert_docs.py) and the ``# example:``
blocks of ``distributed.md`` on 8 simulated devices (tests/distributed/test_distributed_docs.py);
here, every block of theirs is checked to be one of those or a fragment.
"""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
#: What a page says near its top to be run as one session.
SESSION = "**One session:**"
#: The pages whose blocks other tests run: what each block must start with, and the test.
RUN_ELSEWHERE = {"conversion.md": ">>> ", "distributed.md": "# example: "}
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name not in RUN_ELSEWHERE)


def blocks(page: str, info: str = "python") -> list[str]:
    """The code of the page's ```<info> blocks (fenced at the start of a line), in order."""
    return re.findall(rf"^```{info}\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


def is_session(page: str) -> bool:
    return SESSION in "\n".join((DOCS / page).read_text().splitlines()[:12])


def test_every_fence_opens_at_the_start_of_a_line():
    # An indented block (inside a list item) reads as a fragment of the item and does not
    # parse when copied; a fence is python, python fragment, or another language.
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        assert not re.search(r"^[ \t]+```", text, re.M), f"{page.name}: an indented block"
        infos = re.findall(r"^```(\S*(?: fragment)?)\n", text, re.M)
        assert all(
            not i.startswith("python") or i in ("python", "python fragment") for i in infos
        ), (page.name, infos)


def test_fragments_say_so():
    for page in sorted(DOCS.glob("*.md")):
        for fragment in blocks(page.name, "python fragment"):
            first = fragment.splitlines()[0]
            assert first.startswith("#") and re.search(r"fragment|not run", first, re.I), (
                f"{page.name}: a fragment whose first line does not say so: {first!r}"
            )


@pytest.mark.parametrize("page", sorted(RUN_ELSEWHERE))
def test_pages_run_elsewhere_hold_only_what_those_tests_run(page):
    found = blocks(page)
    assert found and all(block.startswith(RUN_ELSEWHERE[page]) for block in found), page


def test_section_references_name_existing_headings():
    # `page.md`, "Heading" in the README or a docs page: that page has that heading.
    root = DOCS.parent
    pages = [root / "README.md", *sorted(DOCS.glob("*.md"))]
    references = [
        ref
        for page in pages
        for ref in re.findall(r"`([\w/.-]+\.md)`, \"([^\"]+)\"", " ".join(page.read_text().split()))
    ]
    assert references, "no page names a section any more: drop this test"
    for page, heading in references:
        headings = re.findall(r"(?m)^#+ (.+)$", (root / page).read_text())
        assert heading in headings, f"{page} has no heading {heading!r}: {headings}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_page_runs(page):
    """A session page: its blocks in one namespace; any other page: each block alone."""
    namespace: dict = {"__name__": "__main__"}
    for i, block in enumerate(blocks(page)):
        if not is_session(page):
            namespace = {"__name__": "__main__"}
        exec(compile(block, f"{DOCS / page} (example {i + 1})", "exec"), namespace)  # noqa: S102
