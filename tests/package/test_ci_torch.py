""".ci/torch, CI's run of the tests that need torch (the README's test command skips them): it
runs every test file that asks for torch, transformers or peft, under pinned versions, and a
skipped test fails it. Run here with `python3` stubbed (no torch is installed)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "torch"
#: `pytest.importorskip("torch")`, of a submodule (`"peft.utils"`) or with more arguments.
ASKS = re.compile(r"""importorskip\(\s*["'](torch|transformers|peft)(\.[\w.]+)?["']""")


def _listed() -> set[str]:
    text = SCRIPT.read_text()
    files = re.search(r"^files=\((.*?)\)$", text, re.M | re.S)
    assert files, "no files=(...) in .ci/torch"
    return set(files.group(1).split())


def test_it_runs_every_test_file_that_asks_for_torch_transformers_or_peft():
    assert ASKS.search('importorskip("torch", minversion="2")')
    assert ASKS.search("importorskip('peft.tuners.tuners_utils')")
    assert not ASKS.search('importorskip("torchvision")')
    asking = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if ASKS.search(p.read_text()) and p != pathlib.Path(__file__).resolve()}
    assert len(asking) >= 6
    assert _listed() == asking


def test_it_pins_the_three_packages_exactly():
    pins = [line for line in (ROOT / ".ci" / "torch.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert sorted(p.split("==")[0] for p in pins) == ["peft", "torch", "transformers"]
    assert all(re.fullmatch(r"[a-z]+==\d+(\.\d+)+", p) for p in pins), pins


def test_ci_runs_it_after_the_oldest_versions():
    assert (ROOT / ".ci" / "run").read_text().splitlines()[-2:] == [".ci/oldest", ".ci/torch"]


# A stand-in `python3`: `-m venv DIR` makes DIR/bin/python, which passes `-m pip` and, for
# `-m pytest`, prints $PYTEST_OUTPUT and exits with $PYTEST_STATUS.
VENV = """#!/usr/bin/env bash
[ "$1 $2" = "-m venv" ] || exit 97
mkdir -p "$3/bin"
cat > "$3/bin/python" <<'STUB'
#!/usr/bin/env bash
case "$2" in
pip) echo "pip $*" >> "$CALLS" ;;
pytest) echo "pytest $*" >> "$CALLS"; printf '%s\\n' "$PYTEST_OUTPUT"; exit "$PYTEST_STATUS" ;;
*) exit 98 ;;
esac
STUB
chmod +x "$3/bin/python"
"""


def _run(tmp_path, output, status=0):
    (tmp_path / "checkout" / ".ci").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "checkout" / ".ci" / "torch")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(VENV)
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "CALLS": str(tmp_path / "calls"), "PYTEST_OUTPUT": output,
           "PYTEST_STATUS": str(status)}
    done = subprocess.run(["bash", str(tmp_path / "checkout" / ".ci" / "torch")], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, (tmp_path / "calls").read_text().splitlines()


def test_it_installs_under_the_pins_and_runs_the_files(tmp_path):
    done, calls = _run(tmp_path, "77 passed in 18.21s")
    assert done.returncode == 0, done.stderr
    assert calls[0].startswith("pip -m pip install") and "-c .ci/torch.txt" in calls[0]
    assert calls[0].endswith("-e .[test] torch transformers peft")
    assert calls[1].split()[1:] == ["-m", "pytest", "-n", "2", "-rs", *sorted(_listed())]


@pytest.mark.parametrize("output, status", [
    ("SKIPPED [1] tests/finetune/test_peft.py:151: could not import 'torch'\n1 passed, 1 skipped",
     0),
    ("FAILED tests/finetune/test_upstream_peft.py::test_x\n1 failed", 1),
    ("no tests ran", 5),
], ids=["a test skipped", "a test failed", "no test collected"])
def test_it_fails_where_a_test_did_not_pass(tmp_path, output, status):
    done, _ = _run(tmp_path, output, status)
    assert done.returncode != 0
    if status == 0:
        assert "were skipped; each must run here" in done.stderr
