"""stackwise for Equinox: ``stackwise.equinox.Stack`` repeats an ``eqx.Module`` n times.

>>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
>>> from functools import partial
>>> blocks = stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), n=3, key=jax.random.key(0))
>>> blocks.layers.weight.shape
(3, 4, 4)
>>> blocks(jnp.ones(4)).shape
(4,)
"""

try:
    import equinox  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without equinox
    raise ImportError(
        "`stackwise.equinox` needs equinox: pip install 'stackwise[equinox]'"
    ) from None

from stackwise.equinox._quax import quaxify as quaxify
from stackwise.equinox._serving import from_serving as from_serving
from stackwise.equinox._serving import to_serving as to_serving
from stackwise.equinox._stack import Stack as Stack
from stackwise.equinox._stack import layer_index as layer_index

__all__ = [
    "Stack",
    "from_serving",
    "layer_index",
    "quaxify",
    "to_serving",
]
