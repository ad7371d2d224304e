"""stackwise: repeat one layer n times as a single scanned, stacked layer in JAX."""

from typing import TYPE_CHECKING

#: Each public name and the private module it lives in. A name loads its module on first use
#: (PEP 562), so ``import stackwise`` imports neither JAX nor a framework, and a command line
#: of ``stackwise.bench`` answers ``--help`` at once; ``stackwise.stack`` then costs JAX's import.
_PUBLIC = {
    "autostack": "stackwise._autostack.api",
    "Autostacked": "stackwise._autostack.api",
    "CARRY_NAME": "stackwise._core.stack",
    "Checkpoint": "stackwise._checkpoint.read",
    "CheckpointLayout": "stackwise._checkpoint.inspect",
    "DEFAULT_REMAT": "stackwise._core.stack",
    "from_serving": "stackwise._core.serving",
    "fsdp_specs": "stackwise._sharding.fsdp",
    "inspect_checkpoint": "stackwise._checkpoint.inspect",
    "layer_index": "stackwise._core.markers",
    "load_checkpoint": "stackwise._checkpoint.load",
    "logical_specs": "stackwise._sharding.logical",
    "open_checkpoint": "stackwise._checkpoint.read",
    "per_example": "stackwise._core.markers",
    "per_layer": "stackwise._core.markers",
    "per_layer_keys": "stackwise._core.markers",
    "pipeline": "stackwise._pipeline.api",
    "save_orbax": "stackwise._checkpoint.save",
    "save_safetensors": "stackwise._checkpoint.save",
    "Serving": "stackwise._core.serving",
    "shard_stacked": "stackwise._sharding.fsdp",
    "slice_layers": "stackwise._core.layout",
    "stack": "stackwise._core.stack",
    "stack_layers": "stackwise._core.layout",
    "Stacked": "stackwise._core.stacked",
    "stacked_shardings": "stackwise._sharding.specs",
    "stacked_spec": "stackwise._sharding.specs",
    "Tensor": "stackwise._checkpoint.names",
    "to_serving": "stackwise._core.serving",
    "unstack_layers": "stackwise._core.layout",
}

if TYPE_CHECKING:  # (what type checkers and IDEs read)
    from stackwise._autostack.api import Autostacked as Autostacked
    from stackwise._autostack.api import autostack as autostack
    from stackwise._checkpoint.inspect import CheckpointLayout as CheckpointLayout
    from stackwise._checkpoint.inspect import inspect_checkpoint as inspect_checkpoint
    from stackwise._checkpoint.load import load_checkpoint as load_checkpoint
    from stackwise._checkpoint.names import Tensor as Tensor
    from stackwise._checkpoint.read import Checkpoint as Checkpoint
    from stackwise._checkpoint.read import open_checkpoint as open_checkpoint
    from stackwise._checkpoint.save import save_orbax as save_orbax
    from stackwise._checkpoint.save import save_safetensors as save_safetensors
    from stackwise._core.layout import slice_layers as slice_layers
    from stackwise._core.layout import stack_layers as stack_layers
    from stackwise._core.layout import unstack_layers as unstack_layers
    from stackwise._core.markers import layer_index as layer_index
    from stackwise._core.markers import per_example as per_example
    from stackwise._core.markers import per_layer as per_layer
    from stackwise._core.markers import per_layer_keys as per_layer_keys
    from stackwise._core.serving import Serving as Serving
    from stackwise._core.serving import from_serving as from_serving
    from stackwise._core.serving import to_serving as to_serving
    from stackwise._core.stack import CARRY_NAME as CARRY_NAME
    from stackwise._core.stack import DEFAULT_REMAT as DEFAULT_REMAT
    from stackwise._core.stack import stack as stack
    from stackwise._core.stacked import Stacked as Stacked
    from stackwise._pipeline.api import pipeline as pipeline
    from stackwise._sharding.fsdp import fsdp_specs as fsdp_specs
    from stackwise._sharding.fsdp import shard_stacked as shard_stacked
    from stackwise._sharding.logical import logical_specs as logical_specs
    from stackwise._sharding.specs import stacked_shardings as stacked_shardings
    from stackwise._sharding.specs import stacked_spec as stacked_spec

#: The optional submodules: each loads on first use of ``stackwise.<name>`` (PEP 562, as scipy
#: does), so ``import stackwise`` imports no framework and ``stackwise.haiku.Stack`` needs no
#: ``import stackwise.haiku``. A new optional submodule adds its name here.
_LAZY_SUBMODULES = ("lora", "quant", "haiku", "flax", "nnx", "equinox", "optax", "bench")


def __getattr__(name: str):
    """A public name (:data:`_PUBLIC`) or ``stackwise.<submodule>`` (one of
    :data:`_LAZY_SUBMODULES`), imported on first use.

    A missing framework raises the submodule's ImportError, which says what to install.
    """
    import importlib

    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # (asked once)
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # (sets the attribute too)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_LAZY_SUBMODULES})


class _NotInstalled:
    """The last entry of ``sys.meta_path``: asked only after every other finder found nothing,
    and only for ``stackwise.<submodule>``, it turns Python's bare "No module named" into
    the fix. The adapters (``adapters/<framework>/``) and the benchmark (``bench/``) become
    ``stackwise.<name>`` only through an install, so this happens where ``stackwise/`` is
    imported from a source folder: either a checkout that is not installed, or one that shadows
    an installed stackwise (the folder comes earlier on ``sys.path``, as the current directory
    does: a non-editable install run from the clone's root). It finds nothing."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None):
        del path, target  # (it finds nothing)
        package, _, name = fullname.partition(".")
        if package == __name__ and name in _LAZY_SUBMODULES:
            here = __path__[0]
            installed = _installed_elsewhere(here)
            extra = f"`pip install -e '.[{_EXTRAS.get(name, name)}]'`"
            if installed is None:
                why = (
                    f"stackwise was imported from {here}, a source checkout that is not "
                    "installed, so its adapters and benchmark are not on the path. Install it "
                    f"from the checkout's root: `pip install -e .` (or {extra})."
                )
            else:
                why = (
                    f"stackwise was imported from the source folder {here}, which shadows the "
                    f"installed stackwise in {installed}: {_shadowing_entry(here)}, and a "
                    "source folder holds no adapters or benchmark. Or install this checkout "
                    f"editable from its root: `pip install -e .` (or {extra})."
                )
            raise ModuleNotFoundError(f"No module named {fullname!r}: {why}", name=fullname)
        return None


def _installed_elsewhere(here: str) -> str | None:
    """The folder of an installed stackwise other than ``here``, or None: what the
    distributions on ``sys.path`` hold (a wheel's ``stackwise/__init__.py``) or point to (an
    editable install's checkout). Read only when an import has already failed."""
    import json
    import os
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    for dist in metadata.distributions(name=__name__):
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("dir_info", {}).get("editable"):
            folder = os.path.join(unquote(urlparse(url["url"]).path), __name__)
        elif any(f.as_posix() == f"{__name__}/__init__.py" for f in dist.files or ()):
            folder = os.path.dirname(str(dist.locate_file(f"{__name__}/__init__.py")))
        else:
            continue
        if os.path.isfile(os.path.join(folder, "__init__.py")) and not os.path.samefile(
            folder, here
        ):
            return os.path.realpath(folder)
    return None


def _shadowing_entry(here: str) -> str:
    """Which ``sys.path`` entry put ``here`` first, in words, and how to take it away."""
    import os

    parent = os.path.dirname(os.path.realpath(here))
    if parent == os.path.realpath(os.getcwd()):
        return (
            f"its folder {parent}, the current directory, comes earlier on sys.path (run from "
            "another folder)"
        )
    return (
        f"its folder {parent} comes earlier on sys.path (a script there, or an entry of "
        "PYTHONPATH: move the script, or drop the entry)"
    )


_EXTRAS = {"nnx": "flax", "bench": "all"}


def _install_last_resort() -> None:
    import sys

    if not any(isinstance(f, type) and f.__name__ == "_NotInstalled" for f in sys.meta_path):
        sys.meta_path.append(_NotInstalled)


_install_last_resort()
del _install_last_resort

__version__ = "0.1.0"

__all__ = [
    "Autostacked",
    "CARRY_NAME",
    "Checkpoint",
    "CheckpointLayout",
    "DEFAULT_REMAT",
    "Serving",
    "autostack",
    "Stacked",
    "Tensor",
    "from_serving",
    "fsdp_specs",
    "inspect_checkpoint",
    "layer_index",
    "load_checkpoint",
    "logical_specs",
    "lora",
    "open_checkpoint",
    "per_example",
    "per_layer",
    "per_layer_keys",
    "pipeline",
    "quant",
    "save_orbax",
    "save_safetensors",
    "shard_stacked",
    "slice_layers",
    "stack",
    "stack_layers",
    "stacked_shardings",
    "stacked_spec",
    "to_serving",
    "unstack_layers",
]
