"""The docs' examples run as written, as each page says it reads.

A page whose top says it is **one session** runs its ```python blocks in order, in one
namespace; on every other page each block is a whole program, run in a fresh namespace. On a
session page, the first block of each section either runs alone or says in its first line that
it continues the page, and in its opening comment which names it takes from above (a reader
who jumps to a section sees at once whether its block is whole).
A block whose info string is ``python fragment`` is an excerpt (or changes the whole process)
and says so in its first line: it is not run. Two pages are run elsewhere: the ``>>>`` blocks of
``conversion.md`` as a doctest (tests/adapters/test_convert_docs.py) and the ``# example:``
blocks of ``distributed.md`` on 8 simulated devices (tests/distributed/test_distributed_docs.py);
here, every block of theirs is checked to be one of those or a fragment.
"""

import ast
import builtins
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


#: What the first line of a section's first block says when the block needs names from above.
CONTINUES = "# Continues the page"


def section_openers(page: str) -> list[tuple[str, str, set[str]]]:
    """The first ```python block of each section (under a heading, or at the page's top) of the
    page: its heading, its code, and the names earlier blocks imported."""
    parts = re.split(r"(^```[^\n]*\n.*?^```)", (DOCS / page).read_text(), flags=re.S | re.M)
    heading, opened, imported, found = "(top)", False, set(), []
    for part in parts:
        if part.startswith("```python\n"):
            code = part.split("\n", 1)[1].rsplit("```", 1)[0]
            if not opened:
                found.append((heading, code, set(imported)))
            opened = True
            imported |= {
                (a.asname or a.name).split(".")[0]
                for node in ast.walk(ast.parse(code))
                if isinstance(node, ast.Import | ast.ImportFrom)
                for a in node.names
            }
        elif not part.startswith("```"):
            for line in part.splitlines():
                if re.match(r"#+ ", line):
                    heading, opened = line, False
    return found


#: Nodes whose bodies run later (a function's) or bind in a scope of their own.
DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
OWN_SCOPE = (*DEFERRED, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _nodes(node: ast.AST, inside: tuple = ()):
    """Each node under ``node`` with the scoped nodes (:data:`OWN_SCOPE`) it lies inside."""
    for child in ast.iter_child_nodes(node):
        yield child, inside
        yield from _nodes(child, (*inside, child) if isinstance(child, OWN_SCOPE) else inside)


def _bound(node: ast.AST, anywhere: bool) -> set[str]:
    """The names ``node`` binds: in any scope, or (``anywhere=False``) the module's only."""
    names = set()
    for child, inside in _nodes(ast.Module(body=[node], type_ignores=[])):
        if inside and not anywhere:
            continue
        if isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
            names.add(child.id)
        elif isinstance(child, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in child.names}
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(child.name)
        elif isinstance(child, ast.arg) and anywhere:
            names.add(child.arg)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
    return names


def free_names(code: str) -> set[str]:
    """The names the code reads before it binds them (builtins aside): what it needs from above.

    Statement by statement: a name read at once must be bound by an earlier statement, one read
    in a function's body by any statement of the block (the body runs later). A name the same
    statement binds in any of its scopes counts as bound there (``x = x + 1`` is missed: the
    check errs towards passing)."""
    statements = ast.parse(code).body
    everywhere = set().union(*(_bound(s, anywhere=False) for s in statements))
    before, needs = set(dir(builtins)), set()
    for statement in statements:
        own = _bound(statement, anywhere=True)
        for node, inside in _nodes(ast.Module(body=[statement], type_ignores=[])):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                later = any(isinstance(scope, DEFERRED) for scope in inside)
                if node.id not in own | before | (everywhere if later else set()):
                    needs.add(node.id)
        before |= _bound(statement, anywhere=False)
    return needs


def test_free_names_finds_what_a_block_needs_from_above():
    code = (
        "import jax.numpy as jnp\nfrom a import b as c\ndef f(x):\n    return jnp.sin(x) + y + K\n"
        "try:\n    z = [w for w in q]\nexcept ValueError as e:\n    print(e, c, jax)\n"
        "K = 2\nprint(f(1), x, v)\nv = 3\n"
    )
    # y: read in f, bound nowhere; x: bound only as f's argument; v: bound after it is read
    assert free_names(code) == {"y", "q", "jax", "x", "v"}


@pytest.mark.every_case  # (static: no block runs)
@pytest.mark.parametrize("page", [p for p in PAGES if is_session(p)])
def test_each_section_opens_with_a_whole_block_or_says_it_continues(page):
    for heading, code, imported in section_openers(page):
        needs = free_names(code)
        if not needs:
            continue
        first = code.splitlines()[0]
        said = " ".join(re.match(r"(?:#.*\n)*", code).group(0).split())  # (its opening comment)
        assert first.startswith(CONTINUES), (
            f"{page}, {heading!r}: its first block needs {sorted(needs)} from above; make it run "
            f"alone, or begin it with {CONTINUES!r} and the names it takes"
        )
        unnamed = [n for n in needs - imported if not re.search(rf"\b{re.escape(n)}\b", said)]
        assert not unnamed, f"{page}, {heading!r}: {said!r} does not name {unnamed}"


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
    # `page.md`, "Heading" in the README, a docs page or a test's comment (or the older form, a
    # quoted heading, then "in" and the page): that page has that heading.
    root = DOCS.parent
    # (not this file: its comments show the forms)
    tests = [t for t in sorted(root.glob("tests/**/*.py")) if t.name != "test_docs.py"]
    pages = [root / "README.md", *sorted(DOCS.glob("*.md")), *tests]
    references = [
        ref
        for page in pages
        for text in [" ".join(page.read_text().split())]
        for ref in [
            *re.findall(r"`([\w/.-]+\.md)`, \"([^\"]+)\"", text),
            *[(p, h) for h, p in re.findall(r"\"([^\"]+)\" in ([\w/.-]+\.md)\b", text)],
        ]
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
