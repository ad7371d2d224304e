"""Every command line answers ``--help`` and refuses a bad argument before importing JAX.

On a busy machine importing JAX, optax and orbax takes most of a minute; a user who asks for
``--help``, or mistypes a flag, gets the answer in well under a second. Each command runs as
a user runs it, in a subprocess with ``python -X importtime``, which lists every module the
process imported; the test reads that list.

``stackwise-bench`` (and ``benchmarks/core.py``, which runs it) is ``stackwise.bench``: ``import
stackwise`` and ``import stackwise.bench`` load their public names on first use, so its parser
imports nothing heavy either (nor matplotlib).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What no command line may import to answer --help or refuse an argument.
HEAVY = ("jax", "jaxlib", "optax", "orbax", "flax", "haiku", "equinox", "tensorstore")
#: What stackwise-bench's parser may not import either.
BENCH_HEAVY = (*HEAVY, "matplotlib")

#: The commands after ``python``: every example's and benchmark's, and stackwise-bench's.
COMMANDS = [
    ["examples/transformer_lm.py"],
    ["examples/multiprocess.py"],
    *[
        [f"benchmarks/{p.name}"]
        for p in sorted((ROOT / "benchmarks").glob("*.py"))
        if p.name != "core.py" and not p.name.startswith("_")  # (_devices.py: a module)
    ],
]
BENCH = [["-m", "stackwise.bench"], ["benchmarks/core.py"]]


def imported(command: list[str], *argv: str) -> tuple[int, str, set[str]]:
    """Runs ``python -X importtime COMMAND ARGV`` in the repository: its exit status, its
    output, and the top-level names of the modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *command, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)
    assert names, proc.stderr[-2000:]  # (-X importtime lists what it imported)
    return proc.returncode, proc.stdout + proc.stderr, {n.split(".")[0] for n in names}


def check(command: list[str], heavy: tuple[str, ...]) -> None:
    code, out, modules = imported(command, "--help")
    assert code == 0 and "usage:" in out, out[-2000:]
    assert "argparse" in modules  # (the list is read: the parser's module is in it)
    assert not modules & set(heavy), f"--help imported {sorted(modules & set(heavy))}"
    code, out, modules = imported(command, "--no-such-flag")
    assert code == 2 and ": error: " in out, out[-2000:]  # (argparse's refusal)
    assert not modules & set(heavy), f"a bad argument imported {sorted(modules & set(heavy))}"


@pytest.mark.every_case  # (each well under a second)
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_and_a_bad_argument_answer_before_jax_is_imported(command):
    check(command, HEAVY)


@pytest.mark.every_case  # (each well under a second)
@pytest.mark.parametrize("command", BENCH, ids=" ".join)
def test_stackwise_bench_answers_before_jax_is_imported(command):
    check(command, BENCH_HEAVY)


#: The modules of the example's package: none is a command.
EXAMPLE_MODULES = sorted(p.name for p in (ROOT / "examples" / "lm").glob("*.py")
                         if p.name != "__init__.py")


@pytest.mark.every_case  # (each well under a second)
@pytest.mark.parametrize("module", EXAMPLE_MODULES)
def test_a_module_of_the_example_run_by_mistake_names_the_command(module):
    # `python examples/lm/train.py --help` neither pretends to be a command nor imports JAX: it
    # says which command to run.
    code, out, modules = imported([f"examples/lm/{module}"], "--help")
    assert code == 1 and "usage:" not in out, out[-2000:]
    assert "not a command; the command is: python examples/transformer_lm.py" in out, out
    assert not modules & set(HEAVY), f"it imported {sorted(modules & set(HEAVY))}"
