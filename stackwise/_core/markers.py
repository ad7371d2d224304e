"""Per-layer arguments: markers that ``Stacked.init`` / ``Stacked.apply`` resolve per layer.

``per_layer(xs)`` gives layer i ``xs[i]``, ``per_layer_keys(key)`` the i-th of n
split keys and ``layer_index()`` the index i itself; every other argument
reaches every layer unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from stackwise._core import checks, trees
from stackwise._core.checks import check_depth

__all__ = ["layer_index", "per_example", "per_layer", "per_layer_keys"]


@jax.tree_util.register_pytree_node_class
class PerLayer:
    """An argument that differs per layer; see :func:`per_layer`.

    A pytree node, so a marked argument passes through ``jax.jit`` and other
    transformations on its way to ``Stacked.apply``.
    """

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any = None):
        self.kind = kind  # "slices" | "keys" | "index"
        self.value = value

    def __repr__(self) -> str:
        return f"stackwise.{_MARKER_NAMES[self.kind]}(...)"

    def tree_flatten(self):
        return (self.value,), self.kind

    @classmethod
    def tree_unflatten(cls, kind, children):
        return cls(kind, *children)

    def stacked(self, n: int, where: str) -> Any:
        """The value with a leading axis ``n``: layer i receives ``[i]``."""
        if self.kind == "index":
            return jnp.arange(n, dtype=jnp.int32)
        if self.kind == "keys":
            return jax.random.split(self.value, n)
        check_depth(
            trees.named_leaves(self.value),
            n,
            where,
            "stackwise.per_layer(...) value",
            fix="Layer i receives slice i, so give one entry per layer (`jnp.stack` "
            "them), or pass the value without `per_layer` to give every layer all of it.",
        )
        return self.value


_MARKER_NAMES = {"slices": "per_layer", "keys": "per_layer_keys", "index": "layer_index"}


def per_layer(xs: Any) -> Any:
    """Marks an argument whose leading axis is the layer axis: layer i gets ``xs[i]``.

    Works for positional and keyword arguments of ``Stacked.init`` and
    ``Stacked.apply`` and for any pytree (every leaf sliced).

    >>> import jax.numpy as jnp, stackwise
    >>> layers = stackwise.stack(None, lambda p, x, s: x * s, n=3)
    >>> layers.apply(None, 1.0, stackwise.per_layer(jnp.array([2.0, 3.0, 4.0])))
    Array(24., dtype=float32)
    """
    return PerLayer("slices", xs)


def per_layer_keys(key: jax.Array) -> Any:
    """Marks a PRNG key to be split into n independent keys, one per layer.

    Layer i receives ``jax.random.split(key, n)[i]``.

    >>> import jax, stackwise
    >>> layers = stackwise.stack(None, lambda p, x, k: x + jax.random.uniform(k), n=4)
    >>> y = layers.apply(None, 0.0, stackwise.per_layer_keys(jax.random.key(0)))
    >>> bool(0.0 < y < 4.0)
    True

    Raises:
      TypeError: ``key`` is not a PRNG key (e.g. an int seed).
    """
    return PerLayer("keys", checks.prng_key(key, "stackwise.per_layer_keys"))


def layer_index() -> Any:
    """Marks an argument that receives the layer's own index, a traced int32.

    >>> import stackwise
    >>> layers = stackwise.stack(None, lambda p, x, i: x * 10 + i, n=3)
    >>> layers.apply(None, 0, stackwise.layer_index())
    Array(12, dtype=int32)
    """
    return PerLayer("index")


# --------------------------------------------------------------------------
# Per-example arguments.


@jax.tree_util.register_pytree_node_class
class PerExample:
    """An argument with the batch axis first, split into microbatches with ``x``."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return "stackwise.per_example(...)"

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def per_example(value: Any) -> Any:
    """Marks an argument whose leading axis is the batch (a mask, positions, segment ids).

    :func:`stackwise.pipeline` splits it into microbatches as it splits ``x``:
    the layers running microbatch m get rows ``m*b:(m+1)*b`` of every leaf. The
    argument is not carried from stage to stage: every stage holds it whole
    (per data shard) and takes its microbatch's rows. ``Stacked.apply`` (no
    pipeline) gives every layer the whole value, so one model runs either way.

    >>> import jax.numpy as jnp, numpy as np, jax, stackwise
    >>> from jax.sharding import Mesh
    >>> apply = lambda p, x, mask: x + p["w"] * mask
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
    >>> pp = stackwise.pipeline(None, apply, 2, mesh, microbatches=2)
    >>> mask = jnp.array([1.0, 0.0, 1.0, 0.0])
    >>> pp.apply({"w": jnp.ones(2)}, jnp.zeros(4), stackwise.per_example(mask))
    Array([2., 0., 2., 0.], dtype=float32)
    >>> stackwise.stack(None, apply, 2).apply({"w": jnp.ones(2)}, jnp.zeros(4),
    ...                                       stackwise.per_example(mask))
    Array([2., 0., 2., 0.], dtype=float32)
    """
    return PerExample(value)


def is_per_layer(value: Any) -> bool:
    """Whether ``value`` is a per-layer marker (for adapters that pass one through)."""
    return isinstance(value, PerLayer)


_UNCALLED = {per_layer: "per_layer(xs)", per_layer_keys: "per_layer_keys(key)"}


def split_markers(args: tuple, kwargs: dict, n: int, what: str):
    """Separates per-layer markers from the rest of ``(args, kwargs)``.

    Returns ``(xs, rebuild)``: ``xs`` lists each marker's stacked value (leading
    axis ``n``) and ``rebuild(slices)`` gives back ``(args, kwargs)`` with
    every marker replaced by its slice. Every other leaf (arrays and static
    Python values alike) is closed over unchanged, so static values stay static.
    """
    is_marker = lambda v: isinstance(v, (PerLayer, PerExample))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=is_marker)
    for path, leaf in leaves:
        if leaf is layer_index or any(leaf is f for f in _UNCALLED):
            call = "layer_index()" if leaf is layer_index else _UNCALLED[leaf]
            raise TypeError(
                f"{what}{_describe_arg(path)} is the function `stackwise."
                f"{call.split('(')[0]}` itself; call it: `stackwise.{call}`."
            )
    slots = [i for i, (_, leaf) in enumerate(leaves) if isinstance(leaf, PerLayer)]
    xs = [leaves[i][1].stacked(n, f"{what}{_describe_arg(leaves[i][0])}") for i in slots]
    # A per-example argument is only a pipeline's business: every layer sees all of it.
    values = [leaf.value if isinstance(leaf, PerExample) else leaf for _, leaf in leaves]

    def rebuild(slices):
        filled = list(values)
        for i, s in zip(slots, slices):
            filled[i] = s
        return jax.tree_util.tree_unflatten(treedef, filled)

    return xs, rebuild


def _describe_arg(path) -> str:
    """``(args, kwargs)`` path -> ``" argument *args[0]"`` / ``" argument **kwargs['s']"``.

    Under an adapter's :class:`stackwise._core.markers.CallArgs`, the user's own
    arguments are named, not the adapter's call of ``Stacked.apply``.
    """
    path = tuple(path)
    for i in reversed(range(len(path))):
        if path[i] in (CallArgs.ARGS, CallArgs.KWARGS):
            top = jax.tree_util.SequenceKey(0 if path[i] == CallArgs.ARGS else 1)
            path = (top, *path[i + 1 :])
            break
    top, first, *rest = path
    inner = jax.tree_util.keystr(tuple(rest))
    if top.idx == 0:
        return f" argument *args[{first.idx}]{inner}"
    return f" argument **kwargs[{first.key!r}]{inner}"


# --------------------------------------------------------------------------
# The user's arguments of a Stack call, as one argument of `Stacked.apply`.


@jax.tree_util.register_pytree_with_keys_class
class CallArgs:
    """A Stack call's ``(*args, **kwargs)``, passed on to ``Stacked.apply`` whole.

    Adapters call ``layers.apply(params, state, x, extras, CallArgs(args,
    kwargs))``; per-layer markers inside resolve as usual, and the core's
    messages name them as the user wrote them (``argument *args[0]``).
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = tuple(args), dict(kwargs)

    ARGS = jax.tree_util.GetAttrKey("_stackwise_call_args")
    KWARGS = jax.tree_util.GetAttrKey("_stackwise_call_kwargs")

    def tree_flatten_with_keys(self):
        return ((self.ARGS, self.args), (self.KWARGS, self.kwargs)), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

