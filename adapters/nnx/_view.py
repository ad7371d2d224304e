"""One layer of an NNX :class:`Stack` as a module of its own: ``stack.layer(i)``, ``len(stack)``.

A Stack holds one block whose every variable has a leading layer axis, so
a block's properties computed from its variables' shapes (Gemma's
``attn.head_dim`` is ``attn_vec_einsum.w.shape[1]``) and its methods
(``init_cache``) see that axis. :func:`layer` gives layer i as the block it
was built as: the same type, each variable one layer's slice (its
``out_sharding`` without the layer axis). Only that layer is copied; for an
abstract Stack (``nnx.eval_shape``) the result is abstract too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import nnx

from stackwise import _kit
from stackwise.nnx import _axis, _serving

__all__ = ["iter_layers", "layer", "num_layers"]


def num_layers(stack: Any) -> int:
    """The number of layers, ``len(stack)``."""
    return stack.n


def layer(stack: Any, i: int) -> nnx.Module:
    """Layer ``i`` of a Stack as a block of its own (a copy of that one layer).

    >>> import stackwise.nnx
    >>> from stackwise.nnx._view import layer
    >>> from flax import nnx
    >>> class Attention(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.out = nnx.Linear(8, 4, rngs=rngs)
    ...     @property
    ...     def head_dim(self):  # computed from a variable's shape
    ...         return self.out.kernel.shape[0]
    >>> stack = stackwise.nnx.Stack(Attention, 3, rngs=nnx.Rngs(0))
    >>> stack.layers.head_dim  # the stacked block sees the layer axis
    3
    >>> layer(stack, 1).head_dim, layer(stack, -1).out.kernel.shape
    (8, (8, 4))

    Args:
      stack: a :class:`stackwise.nnx.Stack`.
      i: the layer's index, ``-n <= i < n`` (negative counts from the end).

    Returns:
      A module of the block's type holding layer i's variables. Changing it
      leaves the stack as it is.

    Raises:
      TypeError: ``i`` is not an int or a NumPy integer (for layers ``a:b`` as a
        shallower model use ``stackwise.slice_layers`` on the state).
      IndexError: ``i`` out of range.
      ValueError: a variable with another number of layers than ``n`` (named).
    """
    i = _kit.layer_number(i, stack.n, "stackwise.nnx.Stack", "i")
    stack._check_layers()
    blocks = stack._blocks()  # one stacked block per pattern position
    k = len(blocks)
    graphdef, state = nnx.split(blocks[i % k])
    one = _serving.take(state, i // k)  # stacked or served
    _axis.remove(one)
    return nnx.merge(graphdef, one)


def iter_layers(stack: Any) -> Iterator[nnx.Module]:
    """Layers 0, 1, ..., n-1 as blocks of their own (each a copy of one layer)."""
    for i in range(stack.n):
        yield layer(stack, i)
