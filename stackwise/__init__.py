"""stackwise: repeat one layer n times as a single scanned, stacked layer in JAX."""

from stackwise._checkpoint import load_checkpoint as load_checkpoint
from stackwise._checkpoint_inspect import CheckpointLayout as CheckpointLayout
from stackwise._checkpoint_inspect import inspect_checkpoint as inspect_checkpoint
from stackwise._checkpoint_names import Tensor as Tensor
from stackwise._checkpoint_read import Checkpoint as Checkpoint
from stackwise._checkpoint_read import open_checkpoint as open_checkpoint
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


def _source_adapters() -> list[str]:
    """``[<checkout>/adapters]`` when imported from a source checkout of stackwise, else ``[]``.

    The adapters (`stackwise.haiku`, `.flax`, `.nnx`, ...) live in `adapters/<framework>/` of
    the source tree and are installed as `stackwise/<framework>/`. Imported from a checkout
    (e.g. with the repository root as the working directory), stackwise finds them where they
    are, so that the source tree and an installed package offer the same modules. A checkout is
    recognised by a pyproject.toml naming this project next to `stackwise/`, not by an
    `adapters/` folder alone: a project that vendors `stackwise/` next to an `adapters/` folder
    of its own must not get that folder's packages as `stackwise.<name>`.
    """
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            pyproject = f.read()
    except OSError:  # installed: the folder holding `stackwise/` has no pyproject.toml
        return []
    adapters = os.path.join(root, "adapters")
    ours = re.search(r"""(?m)^name\s*=\s*["']stackwise["']""", pyproject)
    return [adapters] if ours and os.path.isdir(adapters) else []


__path__.extend(_source_adapters())  # noqa: F821 (a package's own __path__)
del _source_adapters

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
    "save_safetensors",
    "shard_stacked",
    "slice_layers",
    "stack",
    "stack_layers",
    "stacked_shardings",
    "stacked_spec",
    "unstack_layers",
]
