"""Misuses of the install: the `stackwise/` source folder imported where the adapters and the
benchmark cannot follow it, and the message that tells the two cases apart.

(a) A checkout that is not installed at all: the fix is `pip install -e .` in its root.
(b) An installed stackwise shadowed by a checkout's `stackwise/` folder earlier on `sys.path`
(the README's trap before it said `pip install -e`: a non-editable install, then a script run
in the clone's root): the message names the folder that shadows it, where the installed one
is, and the two fixes.

Each row runs in a subprocess under `python -S` (no site-packages, so no editable finder and no
JAX: `import stackwise` needs neither), with an installed distribution made as pip lays one
out: a `stackwise-<version>.dist-info` whose RECORD lists `stackwise/__init__.py` (a wheel), or
whose `direct_url.json` points to another checkout (an editable install).
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import subprocess
import sys

import pytest
from _misuse import assert_refused, case

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHILD = (
    "import json, sys\n"
    "try:\n"
    "    exec(sys.argv[1])\n"
    "except Exception as e:\n"
    "    print(json.dumps([type(e).__name__, str(e)]))\n"
)


def _dist_info(site: pathlib.Path, record: str = "", direct_url: dict | None = None) -> None:
    info = site / "stackwise-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stackwise\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(record + f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def _package(folder: pathlib.Path) -> None:
    (folder / "stackwise").mkdir(parents=True)
    source = (ROOT / "stackwise" / "__init__.py").read_text()
    (folder / "stackwise" / "__init__.py").write_text(source)


def _no_install(tmp: pathlib.Path) -> None:
    del tmp  # (nothing installed)


def _wheel(tmp: pathlib.Path) -> None:
    _package(tmp / "site")
    _dist_info(tmp / "site", record="stackwise/__init__.py,,\n")


def _editable_elsewhere(tmp: pathlib.Path) -> None:
    _package(tmp / "other")
    url = {"url": (tmp / "other").as_uri(), "dir_info": {"editable": True}}
    _dist_info(tmp / "site", direct_url=url)


def _in_child(install, code: str, cwd: str, tmp: pathlib.Path) -> None:
    """Run ``code`` in a fresh ``python -S`` from ``cwd`` ({root}: the checkout, {tmp}: another
    folder) with ``install`` done, and raise the exception it raised, with its message."""
    install(tmp)
    env = dict(os.environ, PYTHONPATH=str(tmp / "site"))
    folder = cwd.format(root=ROOT, tmp=tmp)
    out = subprocess.run(
        [sys.executable, "-S", "-c", CHILD, code.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        check=True,
        cwd=folder,
        env=env,
    ).stdout
    if out:
        name, message = json.loads(out)
        raise getattr(builtins, name)(message)


#: (row, the install, the code, the folder it runs in, words: {root}, {tmp} filled in).
SCRIPT = "sys.path.insert(0, {root!r}); import stackwise.bench"  # (as for a script in it)
ROWS = [
    case(
        "checkout not installed: import stackwise.haiku",
        (_no_install, "import stackwise.haiku", "{root}"),
        ModuleNotFoundError,
        "No module named 'stackwise.haiku'",
        "{root}/stackwise, a source checkout that is not installed",
        "`pip install -e .`",
        "`pip install -e '.[haiku]'`",
    ),
    case(
        "checkout not installed: stackwise.nnx as an attribute",
        (_no_install, "import stackwise; stackwise.nnx", "{root}"),
        ModuleNotFoundError,
        "No module named 'stackwise.nnx'",
        "a source checkout that is not installed",
        "`pip install -e '.[flax]'`",
    ),
    case(
        "a wheel install shadowed by the checkout, run in its root (the README's old trap)",
        (_wheel, "import stackwise.haiku", "{root}"),
        ModuleNotFoundError,
        "imported from the source folder {root}/stackwise, which shadows the installed "
        "stackwise in {tmp}/site/stackwise",
        "its folder {root}, the current directory, comes earlier on sys.path (run from "
        "another folder)",
        "`pip install -e .`",
    ),
    case(
        "an editable install of another checkout, shadowed by this one",
        (_editable_elsewhere, "import stackwise; stackwise.equinox", "{root}"),
        ModuleNotFoundError,
        "shadows the installed stackwise in {tmp}/other/stackwise",
        "`pip install -e '.[equinox]'`",
    ),
    case(
        "a wheel install shadowed by the checkout first on sys.path, run from elsewhere",
        (_wheel, SCRIPT, "{tmp}"),
        ModuleNotFoundError,
        "shadows the installed stackwise in {tmp}/site/stackwise",
        "its folder {root} comes earlier on sys.path (a script there, or an entry of PYTHONPATH",
        "`pip install -e '.[all]'`",
    ),
]


@pytest.mark.every_case  # (each a subprocess of 0.1 s, without JAX)
@pytest.mark.parametrize(("call", "error", "words"), ROWS)
def test_the_source_folder_without_an_install_says_which_case_and_the_fix(
    call, error, words, tmp_path
):
    tmp = tmp_path.resolve()
    install, code, cwd = call
    filled = [w.format(root=ROOT, tmp=tmp) for w in words]
    assert_refused(lambda: _in_child(install, code, cwd, tmp), error, filled)
