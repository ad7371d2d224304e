"""stackwise for Flax NNX: ``stackwise.nnx.Stack`` repeats an ``nnx.Module`` n times.

>>> import jax.numpy as jnp, stackwise.nnx
>>> from flax import nnx
>>> blocks = stackwise.nnx.Stack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), n=3, rngs=nnx.Rngs(0))
>>> blocks.layers.kernel.shape
(3, 4, 4)
>>> blocks(jnp.ones((2, 4))).shape
(2, 4)
"""

try:
    import flax.nnx  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without flax
    raise ImportError("`stackwise.nnx` needs flax: pip install 'stackwise[flax]'") from None

from stackwise.nnx._convert import from_loop as from_loop
from stackwise.nnx._convert import from_scan as from_scan
from stackwise.nnx._convert import to_loop as to_loop
from stackwise.nnx._convert import to_scan as to_scan
from stackwise.nnx._correspond import convert as convert
from stackwise.nnx._qwix import quantize_params as quantize_params
from stackwise.nnx._serving import from_serving as from_serving
from stackwise.nnx._serving import to_serving as to_serving
from stackwise.nnx._stack import Stack as Stack
from stackwise.nnx._stack import layer_index as layer_index

__all__ = [
    "Stack",
    "convert",
    "from_loop",
    "from_scan",
    "from_serving",
    "layer_index",
    "quantize_params",
    "to_loop",
    "to_scan",
    "to_serving",
]
