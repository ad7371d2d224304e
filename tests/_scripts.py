"""The project's scripts that are not in a package (examples, benchmarks), imported by path,
and the example's package, ``examples/lm``."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from types import ModuleType

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_script(path: pathlib.Path, name: str | None = None) -> ModuleType:
    """The script at ``path``, run as a module named ``name`` (its file's stem by default)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example() -> ModuleType:
    """The example's package ``lm`` (``examples/lm``, put on ``sys.path``), its modules
    imported: ``lm.cli``, ``lm.run``, ``lm.checkpoints``, ``lm.model``, ..."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    importlib.import_module("lm.run")  # (and so every module it runs)
    return sys.modules["lm"]
