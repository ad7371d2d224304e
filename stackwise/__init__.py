"""stackwise: repeat one layer n times as a single scanned, stacked layer in JAX."""

from stackwise._checkpoint import load_checkpoint as load_checkpoint
from stackwise._checkpoint_inspect import CheckpointLayout as CheckpointLayout
from stackwise._checkpoint_inspect import inspect_checkpoint as inspect_checkpoint
from stackwise._checkpoint_names import Tensor as Tensor
from stackwise._checkpoint_read import Checkpoint as Checkpoint
from stackwise._checkpoint_read import open_checkpoint as open_checkpoint
from stackwise._checkpoint_save import save_orbax as save_orbax
from stackwise._checkpoint_save import save_safetensors as save_safetensors
from stackwise._layout import slice_layers as slice_layers
from stackwise._layout import stack_layers as stack_layers
from stackwise._layout import stacked_shardings as stacked_shardings
from stackwise._layout import stacked_spec as stacked_spec
from stackwise._layout import unstack_layers as unstack_layers
from stackwise._logical import logical_specs as logical_specs
from stackwise._markers import layer_index as layer_index
from stackwise._markers import per_example as per_example
from stackwise._markers import per_layer as per_layer
from stackwise._markers import per_layer_keys as per_layer_keys
from stackwise._pipeline import pipeline as pipeline
from stackwise._sharding import fsdp_specs as fsdp_specs
from stackwise._sharding import shard_stacked as shard_stacked
from stackwise._stack import CARRY_NAME as CARRY_NAME
from stackwise._stack import DEFAULT_REMAT as DEFAULT_REMAT
from stackwise._stack import Stacked as Stacked
from stackwise._stack import stack as stack

#: The optional submodules: each loads on first use of ``stackwise.<name>`` (PEP 562, as scipy
#: does), so ``import stackwise`` imports no framework and ``stackwise.haiku.Stack`` needs no
#: ``import stackwise.haiku``. A new optional submodule adds its name here.
_LAZY_SUBMODULES = ("haiku", "flax", "nnx", "equinox", "optax", "bench")


def __getattr__(name: str):
    """``stackwise.<submodule>``: imports one of :data:`_LAZY_SUBMODULES` on first use.

    A missing framework raises the submodule's ImportError, which says what to install.
    """
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")  # (sets the attribute too)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})


def _source_tree() -> str | None:
    """The checkout's root when stackwise is imported from a source checkout, else None.

    The adapters (`stackwise.haiku`, `.flax`, `.nnx`, ...) live in `adapters/<framework>/` of
    the source tree and the benchmark `stackwise.bench` in `bench/`; they are installed as
    `stackwise/<name>/`. Imported from a checkout (e.g. with the repository root as the working
    directory), stackwise finds them where they are, so that the source tree and an installed
    package offer the same modules. A checkout is recognised by a pyproject.toml naming this
    project next to `stackwise/`, not by an `adapters/` or `bench/` folder alone: a project that
    vendors `stackwise/` next to folders of its own must not get them as `stackwise.<name>`.
    """
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            pyproject = f.read()
    except OSError:  # installed: the folder holding `stackwise/` has no pyproject.toml
        return None
    return root if re.search(r"""(?m)^name\s*=\s*["']stackwise["']""", pyproject) else None


class _SourcePackages:
    """A meta path finder for the checkout's packages that are not in a folder of `__path__`:
    ``stackwise.bench`` from `bench/` (a folder added to `__path__` would make every one of its
    siblings a `stackwise.<name>` too). Installed, setuptools' package-dir puts them in place."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders

    def find_spec(self, fullname: str, path=None, target=None):
        del path, target  # (the folder is known)
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        import importlib.util
        import os

        init = os.path.join(folder, "__init__.py")
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[folder]
        )


def _find_source_packages(root: str) -> None:
    import os
    import sys

    if os.path.isdir(os.path.join(root, "adapters")):
        __path__.append(os.path.join(root, "adapters"))  # noqa: F821 (a package's own __path__)
    bench = os.path.join(root, "bench")
    if os.path.isfile(os.path.join(bench, "__init__.py")):
        # First on sys.meta_path: before an editable install's finder, which maps
        # `stackwise.<name>` into the folder it was installed from, perhaps another checkout.
        ours = [f for f in sys.meta_path if type(f).__name__ == "_SourcePackages"]
        for finder in ours:  # (a reload of stackwise)
            sys.meta_path.remove(finder)
        sys.meta_path.insert(0, _SourcePackages({f"{__name__}.bench": bench}))


_root = _source_tree()
if _root is not None:
    _find_source_packages(_root)
del _find_source_packages, _root, _source_tree

__version__ = "0.1.0"

__all__ = [
    "CARRY_NAME",
    "Checkpoint",
    "CheckpointLayout",
    "DEFAULT_REMAT",
    "Stacked",
    "Tensor",
    "fsdp_specs",
    "inspect_checkpoint",
    "layer_index",
    "load_checkpoint",
    "logical_specs",
    "open_checkpoint",
    "per_example",
    "per_layer",
    "per_layer_keys",
    "pipeline",
    "save_orbax",
    "save_safetensors",
    "shard_stacked",
    "slice_layers",
    "stack",
    "stack_layers",
    "stacked_shardings",
    "stacked_spec",
    "unstack_layers",
]
