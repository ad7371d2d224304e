"""stackwise: repeat one layer n times as a single scanned, stacked layer in JAX."""

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

__version__ = "0.1.0"

__all__ = [
    "CARRY_NAME",
    "DEFAULT_REMAT",
    "Stacked",
    "fsdp_specs",
    "layer_index",
    "logical_specs",
    "per_example",
    "per_layer",
    "per_layer_keys",
    "pipeline",
    "shard_stacked",
    "slice_layers",
    "stack",
    "stack_layers",
    "stacked_shardings",
    "stacked_spec",
    "unstack_layers",
]

import os as _os  # noqa: E402

# The adapters (`stackwise.haiku`, `.flax`, `.nnx`, ...) live in `adapters/<framework>/` of the
# source tree and are installed as `stackwise/<framework>/`. Imported from a source checkout
# (e.g. the repository root is the working directory), find them where they are, so that the
# source tree and an installed package offer the same modules.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "adapters")
):
    __path__.append(_os.path.join(_root, "adapters"))  # noqa: F821 (a package's own __path__)
del _root
