"""stackwise for Flax linen: ``stackwise.flax.Stack`` repeats an ``nn.Module`` n times.

>>> import jax, jax.numpy as jnp, flax.linen as nn, stackwise.flax
>>> stack = stackwise.flax.Stack(nn.Dense(features=4), n=3)
>>> variables = stack.init(jax.random.key(0), jnp.ones((2, 4)))
>>> variables["params"]["kernel"].shape
(3, 4, 4)
>>> stack.apply(variables, jnp.ones((2, 4))).shape
(2, 4)
"""

try:
    import flax.linen  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without flax
    raise ImportError("`stackwise.flax` needs flax: pip install 'stackwise[flax]'") from None

from stackwise.flax._convert import from_loop as from_loop
from stackwise.flax._convert import from_scan as from_scan
from stackwise.flax._convert import to_loop as to_loop
from stackwise.flax._convert import to_scan as to_scan
from stackwise.flax._correspond import convert as convert
from stackwise.flax._qwix import quantize_params as quantize_params
from stackwise.flax._serving import from_serving as from_serving
from stackwise.flax._serving import to_serving as to_serving
from stackwise.flax._stack import Stack as Stack
from stackwise.flax._stack import layer_index as layer_index

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
