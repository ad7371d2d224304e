"""``stackwise.nnx.Stack``: an ``nnx.Module`` built n times, held as one stacked block.

The adapter only turns a block into a pure ``(init, apply)`` pair with
``nnx.split`` / ``nnx.merge`` and hands it to :func:`stackwise.stack`; the
scan, remat, unroll and reverse all live in the core.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import stackwise

__all__ = ["Stack", "layer_index"]

_LAYER_INDEX: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "stackwise_nnx_layer_index", default=None
)


def layer_index() -> jax.Array:
    """The index of the layer being run, from inside a block's ``__call__``.

    A traced int32 (the layers run inside one scan), so use it in jnp
    arithmetic, not in Python control flow. Inside nested stacks it is the
    index within the innermost one.

    >>> import jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class AddIndex(nnx.Module):
    ...     def __init__(self, rngs):
    ...         pass
    ...     def __call__(self, x):
    ...         return x * 10 + stackwise.nnx.layer_index()
    >>> blocks = stackwise.nnx.Stack(AddIndex, n=3, rngs=nnx.Rngs(0))
    >>> blocks(jnp.int32(0))  # ((0 * 10 + 0) * 10 + 1) * 10 + 2
    Array(12, dtype=int32)

    Returns:
      The layer's index, ``0`` for the first layer (also with ``reverse=True``,
      where the last layer, index ``n - 1``, runs first).

    Raises:
      RuntimeError: called outside a block run by :class:`Stack`.
    """
    index = _LAYER_INDEX.get()
    if index is None:
        raise RuntimeError(
            "stackwise.nnx.layer_index() was called outside a stacked block: it "
            "only has a value inside the `__call__` of a block run by "
            "`stackwise.nnx.Stack`. Outside a Stack, pass the index as an argument."
        )
    return index


@contextlib.contextmanager
def _at_layer(index: Any):
    token = _LAYER_INDEX.set(index)
    try:
        yield
    finally:
        _LAYER_INDEX.reset(token)


# --------------------------------------------------------------------------
# Sharding metadata: the layer axis is prepended to every variable's
# `out_sharding` (the metadata `nnx.with_partitioning` sets) outside the
# layers, and removed inside them, where each variable holds one layer.


def _variables(tree: Any) -> list[tuple[Any, nnx.Variable]]:
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    return [
        (path, v)
        for path, v in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_var)
        if is_var(v)
    ]


def _add_layer_axis(state: Any, axis_name: str | None) -> None:
    for _, v in _variables(state):
        sharding = v.get_metadata("out_sharding", None)
        if sharding:
            v.set_metadata(out_sharding=(axis_name, *sharding))


def _remove_layer_axis(state: Any) -> None:
    for _, v in _variables(state):
        sharding = v.get_metadata("out_sharding", None)
        if sharding:
            v.set_metadata(out_sharding=tuple(sharding)[1:])


def _shard_eagerly(state: Any) -> Any:
    """Recreates variables with sharding metadata, so ``nnx.use_eager_sharding``
    places the stacked values by their stacked spec (as block creation does)."""

    def recreate(v):
        if isinstance(v, nnx.Variable) and v.get_metadata("out_sharding", None):
            if v.get_metadata("eager_sharding", False):
                return type(v)(v.get_raw_value(), **v.get_metadata())
        return v

    return jax.tree.map(recreate, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _path(path) -> str:
    """``(DictKey('lin'), DictKey('kernel'), GetAttrKey('value'))`` -> ``lin.kernel``."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value" or not isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(name))
    return ".".join(parts) or "<root>"


# --------------------------------------------------------------------------
# RNG streams: an `nnx.Rngs` argument becomes n independent ones, one per layer.


@jax.tree_util.register_pytree_node_class
class _LayerRngs:
    """An ``nnx.Rngs`` argument of ``Stack.__call__``, as per-layer keys per stream."""

    def __init__(self, keys: dict[str, Any]):
        self.keys = keys

    def tree_flatten(self):
        return (self.keys,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _stream_keys(rngs: nnx.Rngs) -> dict[str, jax.Array]:
    """One fresh key per stream of ``rngs`` (each stream's count advances)."""
    return {name: stream() for name, stream in rngs.items()}


def _split_rngs_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replaces each ``nnx.Rngs`` in the arguments by per-layer keys for every stream."""
    is_rngs = lambda v: isinstance(v, nnx.Rngs)  # noqa: E731

    def split(v):
        if not is_rngs(v):
            return v
        return _LayerRngs({k: stackwise.per_layer_keys(key) for k, key in _stream_keys(v).items()})

    return jax.tree.map(split, (args, kwargs), is_leaf=is_rngs)


def _join_rngs_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    is_layer_rngs = lambda v: isinstance(v, _LayerRngs)  # noqa: E731
    return jax.tree.map(
        lambda v: nnx.Rngs(**v.keys) if is_layer_rngs(v) else v,
        (args, kwargs),
        is_leaf=is_layer_rngs,
    )


class _Prebuilt:
    """``make_block`` stand-in for :meth:`Stack.from_layers`: the stacked block."""

    def __init__(self, layers: nnx.Module):
        self.layers = layers


def _name(make_block: Any) -> str:
    return getattr(make_block, "__qualname__", None) or repr(make_block)


# --------------------------------------------------------------------------
# The module.


class Stack(nnx.Module):
    """``n`` copies of an ``nnx.Module`` with stacked variables, run as one scanned layer.

    The loop it replaces, with n separately built blocks:

    >>> import jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, d, rngs):
    ...         self.linear = nnx.Linear(d, d, rngs=rngs)
    ...         self.norm = nnx.BatchNorm(d, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + jax.nn.gelu(self.norm(self.linear(x)))
    >>> blocks = [Block(8, nnx.Rngs(i)) for i in range(4)]
    >>> x = jnp.ones((2, 8))
    >>> y_loop = x
    >>> for block in blocks:
    ...     y_loop = block(y_loop)

    The same as one module: variables gain a leading layer axis, the block is
    traced once whatever ``n``, and BatchNorm statistics (any non-``Param``
    variable) are updated in place, as in the loop:

    >>> stack = stackwise.nnx.Stack.from_layers(
    ...     [Block(8, nnx.Rngs(i)) for i in range(4)])
    >>> stack.layers.linear.kernel.shape
    (4, 8, 8)
    >>> y = stack(x)
    >>> bool(jnp.allclose(y, y_loop, atol=1e-5))
    True
    >>> bool(jnp.allclose(stack.layers.norm.mean[3], blocks[3].norm.mean[...]))
    True

    Usually it is built in a model's ``__init__`` from a function of ``rngs``:

    >>> class Model(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = stackwise.nnx.Stack(
    ...             lambda rngs: Block(8, rngs), n=24, rngs=rngs, remat=True)
    ...     def __call__(self, x):
    ...         return self.blocks(x)
    >>> model = Model(nnx.Rngs(0))
    >>> nnx.jit(lambda m, x: m(x))(model, x).shape
    (2, 8)

    Per-layer inputs and outputs: an argument wrapped in
    :func:`stackwise.per_layer` gives layer i its slice i; values a block
    ``sow`` s under ``nnx.capture`` come back stacked; :func:`stackwise.nnx.layer_index` is the
    running layer's index; with ``has_aux=True`` a block returns ``(x, aux)``:

    >>> class Scale(nnx.Module):
    ...     def __init__(self, rngs):
    ...         pass
    ...     def __call__(self, x, s):
    ...         self.sow(nnx.Intermediate, "seen", x)
    ...         return x * s
    >>> scales = stackwise.nnx.Stack(Scale, n=3, rngs=nnx.Rngs(0))
    >>> forward = nnx.capture(scales, nnx.Intermediate)
    >>> y, sown = forward(jnp.float32(1.0), stackwise.per_layer(jnp.array([2.0, 3.0, 4.0])))
    >>> y
    Array(24., dtype=float32)
    >>> sown["layers"]["seen"][0]  # the x each layer received
    Array([1., 2., 6.], dtype=float32)

    Args:
      make_block: ``block = make_block(rngs)``, returning an ``nnx.Module``
        (a class taking ``rngs`` works). It is called once, under
        :func:`jax.vmap`, with an ``nnx.Rngs`` whose every stream holds layer
        i's key: the stack equals ``[make_block(r) for r in rngs.split(n)]``
        (what ``nnx.split_rngs`` + ``nnx.vmap`` build).
      n: the number of layers, a positive int.
      rngs: the ``nnx.Rngs`` to build the layers from: each stream gives one
        key, split into n.
      remat: rematerialise each layer in the backward pass (``True`` or a
        :mod:`jax.checkpoint_policies` policy); see :func:`stackwise.stack`.
        The default, ``stackwise.DEFAULT_REMAT``, saves matmul outputs only.
      nested: also checkpoint groups of layers (sqrt(n) remat), as in
        :func:`stackwise.stack`.
      unroll: passed to the scan; ``True`` runs a Python loop.
      reverse: run the last layer first.
      has_aux: the block returns ``(x, aux)``; the stack then returns ``(x,
        aux)``, aux stacked along a leading ``n`` axis.
      layer_axis_name: the mesh axis name put first in the ``out_sharding``
        metadata (from ``nnx.with_partitioning``) of every stacked variable:
        ``None`` replicates across layers, a mesh axis name splits them.

    Calling the stack, ``stack(x, *args, **kwargs)``, runs
    ``x = block_i(x, *args, **kwargs)`` for every layer. ``nnx.Param`` s are
    read only inside; every other variable (batch statistics, RNG counters,
    caches) is updated and written back stacked. An
    ``nnx.Rngs`` argument is split per layer, so every layer draws
    independent randomness (and the stream's count advances once).

    Raises:
      TypeError: ``make_block`` not callable or not returning an
        ``nnx.Module``, ``n`` not an int, or a block that changes the shape
        or dtype of ``x``.
      ValueError: ``n < 1``, or stacked variables whose leading axis is not
        ``n`` (the variables are named).
    """

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module],
        n: int,
        *,
        rngs: nnx.Rngs | None,
        remat: bool | Callable[..., bool] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        layer_axis_name: str | None = None,
    ):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(
                f"stackwise.nnx.Stack: `n` must be a Python int (the number of layers), "
                f"got {type(n).__name__} {n!r}."
            )
        if n < 1:
            raise ValueError(
                f"stackwise.nnx.Stack: `n` must be at least 1, got n={n} for "
                f"block {_name(make_block)}."
            )
        self.n = n
        self.remat = remat
        self.nested = nested
        self.unroll = unroll
        self.reverse = reverse
        self.has_aux = has_aux
        self.layer_axis_name = layer_axis_name
        self._stacked()  # validates remat / nested / unroll now, not at the first call
        if isinstance(make_block, _Prebuilt):
            self.layers = make_block.layers
            return
        if isinstance(make_block, nnx.Module):
            raise TypeError(
                f"stackwise.nnx.Stack: `make_block` must be a function of `rngs` that "
                f"builds a block, got a built {type(make_block).__name__} module. Build "
                f"each layer from its own keys: `Stack(lambda rngs: "
                f"{type(make_block).__name__}(..., rngs=rngs), n, rngs=rngs)`, or stack "
                "built blocks with `Stack.from_layers([block_0, ..., block_{n-1}])`."
            )
        if not callable(make_block):
            raise TypeError(
                f"stackwise.nnx.Stack: `make_block` must be a function of `rngs` that "
                f"returns an nnx.Module, got {type(make_block).__name__} {make_block!r}. "
                "E.g. `Stack(lambda rngs: Block(512, rngs=rngs), n=24, rngs=rngs)`."
            )
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"stackwise.nnx.Stack: `rngs` must be an nnx.Rngs (the layers are built "
                f"from its keys), got {type(rngs).__name__} {rngs!r}."
            )
        self.layers = self._build(make_block, rngs)

    def _build(self, make_block: Callable, rngs: nnx.Rngs) -> nnx.Module:
        keys = _stream_keys(rngs)
        names = list(keys)
        graphdefs = []

        def init(key, other_keys):
            layer_rngs = nnx.Rngs(**({names[0]: key} if names else {}), **other_keys)
            block = make_block(layer_rngs)
            if not isinstance(block, nnx.Module):
                raise TypeError(
                    f"stackwise.nnx.Stack: `make_block` ({_name(make_block)}) must return "
                    f"an nnx.Module, but it returned {type(block).__name__}. Pass a "
                    "function that builds one block from `rngs`, e.g. "
                    "`lambda rngs: Block(512, rngs=rngs)`."
                )
            graphdef, params, rest = nnx.split(block, nnx.Param, ...)
            graphdefs.append(graphdef)
            _add_layer_axis((params, rest), self.layer_axis_name)
            return params, rest

        first = keys[names[0]] if names else jax.random.key(0)
        others = {k: stackwise.per_layer_keys(keys[k]) for k in names[1:]}
        layers = stackwise.stack(init, lambda *a: None, self.n, with_state=True)
        params, rest = layers.init(first, others)
        return nnx.merge(graphdefs[0], _shard_eagerly(params), _shard_eagerly(rest))

    def _stacked(
        self, apply: Callable = lambda *a: None, block: str = "block"
    ) -> stackwise.Stacked:
        # The core checks that each layer returns x unchanged in shape and dtype,
        # naming the block in its error.
        return stackwise.stack(
            lambda key: None,
            apply,
            self.n,
            remat=self.remat,
            nested=self.nested,
            unroll=self.unroll,
            reverse=self.reverse,
            has_aux=self.has_aux,
            with_state=True,
            name=f"stackwise.nnx.Stack({block})",
        )

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
        self._check_depth(params)
        self._check_depth(rest)

        def apply(p, s, x, index, *args, **kwargs):
            _remove_layer_axis((p, s))
            block = nnx.merge(graphdef, p, s)
            args, kwargs = _join_rngs_args(args, kwargs)
            with _at_layer(index):
                out = block(x, *args, **kwargs)
            _, _, new_rest = nnx.split(block, nnx.Param, ...)
            _add_layer_axis(new_rest, self.layer_axis_name)
            return out, new_rest

        args, kwargs = _split_rngs_args(args, kwargs)
        out, new_rest = self._stacked(apply, type(self.layers).__name__).apply(
            params, rest, x, stackwise.layer_index(), *args, **kwargs
        )
        nnx.update(self.layers, new_rest)
        return out

    def _check_depth(self, state: Any) -> None:
        is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
        bad = [
            f"  {_path(path)} ({type(v).__name__}): shape {jnp.shape(a)}"
            for path, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_var)
            for sub, a in jax.tree_util.tree_leaves_with_path(v)
            if jnp.ndim(a) == 0 or jnp.shape(a)[0] != self.n
        ]
        if bad:
            raise ValueError(
                f"stackwise.nnx.Stack of {type(self.layers).__name__}: every variable "
                f"needs a leading layer axis of length n={self.n}, but these do not:\n"
                + "\n".join(bad)
                + "\nStacked variables come from building the Stack, or from "
                "`Stack.from_layers([block_0, ..., block_{n-1}])`."
            )

    # ----------------------------------------------------------------------
    # Conversion to and from a list of per-layer blocks.

    def to_layers(self) -> list[nnx.Module]:
        """The n per-layer blocks, each a separate module holding layer i's variables.

        Exact: ``Stack.from_layers(stack.to_layers())`` gives back the same
        variables, bit for bit (and sharding metadata loses the layer axis).

        >>> import jax.numpy as jnp, stackwise.nnx
        >>> from flax import nnx
        >>> stack = stackwise.nnx.Stack(
        ...     lambda rngs: nnx.Linear(2, 2, rngs=rngs), n=3, rngs=nnx.Rngs(0))
        >>> blocks = stack.to_layers()
        >>> bool(jnp.array_equal(blocks[2].kernel[...], stack.layers.kernel[2]))
        True

        Returns:
          A list of ``n`` blocks of the stacked block's type.
        """
        graphdef, state = nnx.split(self.layers)
        blocks = []
        for i in range(self.n):
            layer = jax.tree.map(lambda a, i=i: a[i], state)
            _remove_layer_axis(layer)
            blocks.append(nnx.merge(graphdef, layer))
        return blocks

    @classmethod
    def from_layers(
        cls,
        blocks: Sequence[nnx.Module],
        *,
        remat: bool | Callable[..., bool] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        layer_axis_name: str | None = None,
    ) -> Stack:
        """A :class:`Stack` holding the variables of separately built blocks.

        Layer i is ``blocks[i]``; the blocks must be of one type and
        configuration with variables of equal shapes. The inverse of
        :meth:`to_layers`, exact.

        >>> import stackwise.nnx
        >>> from flax import nnx
        >>> blocks = [nnx.Linear(2, 3, rngs=nnx.Rngs(i)) for i in range(5)]
        >>> stackwise.nnx.Stack.from_layers(blocks).layers.kernel.shape
        (5, 2, 3)

        Args:
          blocks: the per-layer modules, in order.
          remat, nested, unroll, reverse, has_aux, layer_axis_name: as for
            :class:`Stack`.

        Returns:
          The stack; the blocks themselves are left unchanged.

        Raises:
          TypeError: a block is not an ``nnx.Module`` or differs in structure.
          ValueError: no blocks.
        """
        blocks = list(blocks)
        if not blocks:
            raise ValueError("stackwise.nnx.Stack.from_layers: needs at least one block, got none.")
        for i, block in enumerate(blocks):
            if not isinstance(block, nnx.Module):
                raise TypeError(
                    f"stackwise.nnx.Stack.from_layers: block {i} must be an nnx.Module, "
                    f"got {type(block).__name__}."
                )
        graphdef, first = nnx.split(blocks[0])
        states = [first]
        for i, block in enumerate(blocks[1:], 1):
            g, state = nnx.split(block)
            if g != graphdef or jax.tree.structure(state) != jax.tree.structure(first):
                raise TypeError(
                    f"stackwise.nnx.Stack.from_layers: block {i} ({type(block).__name__}) "
                    f"differs in structure or static attributes from block 0 "
                    f"({type(blocks[0]).__name__}); every layer must be built the same way."
                )
            pairs = zip(jax.tree_util.tree_leaves_with_path(first), jax.tree.leaves(state))
            bad = [
                f"  {_path(p)}: {jnp.shape(b)} (block 0: {jnp.shape(a)})"
                for (p, a), b in pairs
                if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b)
            ]
            if bad:
                raise TypeError(
                    f"stackwise.nnx.Stack.from_layers: block {i} has variables of other "
                    "shapes or dtypes than block 0:\n" + "\n".join(bad)
                )
            states.append(state)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
        _add_layer_axis(stacked, layer_axis_name)
        layers = nnx.merge(graphdef, _shard_eagerly(stacked))
        return cls(
            _Prebuilt(layers),
            len(blocks),
            rngs=None,
            remat=remat,
            nested=nested,
            unroll=unroll,
            reverse=reverse,
            has_aux=has_aux,
            layer_axis_name=layer_axis_name,
        )


