"""stackwise for Haiku: ``stackwise.haiku.Stack`` repeats an ordinary ``hk.Module`` n times.

The block keeps using ``hk.Linear``, ``hk.get_parameter``, ``hk.get_state`` and
``hk.next_rng_key`` as usual; the Stack scans it with :func:`stackwise.stack`
and keeps one set of params (and state) per layer, stacked along axis 0.
For decoding, :func:`to_serving` converts them once into per-layer buffers, which the
same Stack runs as a loop of its layers (:func:`from_serving` converts back).

>>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
>>> class Block(hk.Module):
...     def __call__(self, x):
...         return x + jnp.tanh(hk.Linear(x.shape[-1])(x))
>>> forward = hk.transform(lambda x: stackwise.haiku.Stack(Block, n=6)(x))
>>> params = forward.init(jax.random.key(0), jnp.ones((2, 8)))
>>> params["stack/block/linear"]["w"].shape
(6, 8, 8)
>>> forward.apply(params, None, jnp.ones((2, 8))).shape
(2, 8)
"""

try:
    import haiku  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without dm-haiku
    raise ImportError("`stackwise.haiku` needs dm-haiku: pip install 'stackwise[haiku]'") from None

from stackwise.haiku._convert import from_layer_stack as from_layer_stack
from stackwise.haiku._convert import from_loop as from_loop
from stackwise.haiku._convert import to_layer_stack as to_layer_stack
from stackwise.haiku._convert import to_loop as to_loop
from stackwise.haiku._correspond import convert as convert
from stackwise.haiku._serving import from_serving as from_serving
from stackwise.haiku._serving import to_serving as to_serving
from stackwise.haiku._stack import Stack as Stack
from stackwise.haiku._stack import layer_index as layer_index

__all__ = [
    "Stack",
    "convert",
    "from_layer_stack",
    "from_loop",
    "from_serving",
    "layer_index",
    "to_layer_stack",
    "to_loop",
    "to_serving",
]
