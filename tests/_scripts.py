"""The project's scripts that are not in a package (examples, benchmarks), imported by path."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType


def load_script(path: pathlib.Path, name: str | None = None) -> ModuleType:
    """The script at ``path``, run as a module named ``name`` (its file's stem by default)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
