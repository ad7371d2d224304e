"""``stackwise.haiku.Stack``: an ordinary ``hk.Module`` repeated n times, scanned.

The adapter only turns the block into per-layer ``init``/``apply`` functions
with :func:`haiku.transform_with_state`, stacks them with
:func:`stackwise.stack` (which owns scan, remat, unroll and reverse) and lifts
the stacked params and state into the enclosing Haiku transform.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import stackwise

__all__ = ["Stack", "layer_index"]

# Reserved keywords carrying the adapter's own per-layer values through
# `stackwise.stack`; user keywords reach the block unchanged.
_KEY, _RNG, _INDEX = "_stackwise_haiku_key", "_stackwise_haiku_rng", "_stackwise_haiku_index"

_indices = threading.local()


def layer_index() -> jax.Array:
    """The index of the layer being run, inside a block run by :class:`Stack`.

    A traced int32 scalar: layer i of the stack gets ``i`` (also with
    ``reverse=True``, where layer ``n - 1`` runs first). Inside nested Stacks
    it is the index within the innermost one.

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> def block(x):
    ...     return x * 10 + stackwise.haiku.layer_index()
    >>> f = hk.transform(lambda x: stackwise.haiku.Stack(block, n=3)(x))
    >>> f.apply(f.init(None, 0), None, 0)
    Array(12, dtype=int32)

    Raises:
      ValueError: when called outside a block run by :class:`Stack`.
    """
    stack = getattr(_indices, "stack", None)
    if not stack:
        raise ValueError(
            "stackwise.haiku.layer_index() was called outside a block run by "
            "`stackwise.haiku.Stack`; call it inside the block's `__call__`."
        )
    return stack[-1]


@contextlib.contextmanager
def _at_layer(index: jax.Array) -> Iterator[None]:
    if not hasattr(_indices, "stack"):
        _indices.stack = []
    _indices.stack.append(index)
    try:
        yield
    finally:
        _indices.stack.pop()


def _block_name(block: Any) -> str:
    if isinstance(block, functools.partial):
        return f"partial({_block_name(block.func)}, ...)"
    return getattr(block, "__name__", None) or type(block).__name__


def _block_kind(block: Any, what: str) -> str:
    """``"factory"`` (called with no arguments, returns a module) or ``"function"``."""
    usage = (
        "`block` must be an `hk.Module` subclass, a `functools.partial` of one, a "
        "zero-argument callable returning a module (e.g. `lambda: Block(d=8)`), or a "
        "function `f(x, *args, **kwargs)` that uses Haiku modules"
    )
    if isinstance(block, hk.Module):
        raise TypeError(
            f"{what}: {usage}; got the module instance {block!r}. Every layer needs its "
            f"own module: pass `{type(block).__name__}` (or `lambda: "
            f"{type(block).__name__}(...)`) instead of `{type(block).__name__}(...)`."
        )
    if not callable(block):
        raise TypeError(f"{what}: {usage}; got {type(block).__name__} {block!r}.")
    target = block.func if isinstance(block, functools.partial) else block
    if isinstance(target, type) and not issubclass(target, hk.Module):
        raise TypeError(f"{what}: {usage}; got the class {target.__qualname__}.")
    try:
        inspect.signature(block).bind()
    except TypeError:
        if isinstance(target, type):
            raise TypeError(
                f"{what}: the module class needs constructor arguments "
                f"{inspect.signature(block)}; pass them with "
                f"`functools.partial({target.__qualname__}, ...)` or "
                f"`lambda: {target.__qualname__}(...)`."
            ) from None
        return "function"
    except ValueError:  # no signature (some builtins): treat as a function of x
        return "function"
    return "factory"


class Stack(hk.Module):
    """An ordinary Haiku block repeated ``n`` times: stacked params, one scanned call.

    The loop it replaces, with its own module (and params) per layer:

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> class Block(hk.Module):
    ...     def __call__(self, x, *, is_training):
    ...         y = jax.nn.gelu(hk.Linear(x.shape[-1])(x))
    ...         if is_training:
    ...             y = hk.dropout(hk.next_rng_key(), 0.1, y)
    ...         return x + y
    >>> def loop(x, is_training):
    ...     for _ in range(4):
    ...         x = Block()(x, is_training=is_training)
    ...     return x
    >>> loop = hk.transform(loop)
    >>> sorted(loop.init(jax.random.key(0), jnp.ones((2, 8)), True))
    ['block/linear', 'block_1/linear', 'block_2/linear', 'block_3/linear']

    The same model, stacked: the block is traced once whatever ``n``, and
    every param gains a leading axis ``n``:

    >>> def forward(x, is_training):
    ...     return stackwise.haiku.Stack(Block, n=4, remat=True)(x, is_training=is_training)
    >>> forward = hk.transform(forward)
    >>> params = forward.init(jax.random.key(0), jnp.ones((2, 8)), True)
    >>> jax.tree.map(jnp.shape, params)
    {'stack/block/linear': {'b': (4, 8), 'w': (4, 8, 8)}}
    >>> apply = jax.jit(forward.apply, static_argnums=3)
    >>> y = apply(params, jax.random.key(1), jnp.ones((2, 8)), True)
    >>> y.shape
    (2, 8)

    The two layouts convert into each other exactly, so checkpoints of the loop
    load (see :func:`stackwise.haiku.from_loop`):

    >>> loop_params = stackwise.haiku.to_loop(params, "stack/block", "block")
    >>> y_loop = loop.apply(loop_params, None, jnp.ones((2, 8)), False)
    >>> y_stack = forward.apply(params, None, jnp.ones((2, 8)), False)
    >>> bool(jnp.allclose(y_loop, y_stack, atol=1e-5))
    True

    Names: the Stack is a module (named ``stack``, ``stack_1``, ... unless
    ``name`` is given) and the block's own names follow it, so a block
    ``Block`` with an ``hk.Linear`` keeps its params under
    ``"<scope>/stack/block/linear"``, e.g. ``"model/~/stack/block/linear"``
    for a Stack built in the constructor of a module ``Model``. A function
    block has no module of its own: its ``hk.Linear`` is
    ``"<scope>/stack/linear"``. State (``hk.get_state``) is named the same way
    and also stacked per layer.

    Calling: ``Stack(...)(x, *args, **kwargs)`` runs ``block(x, *args,
    **kwargs)`` once per layer, each layer getting the previous layer's output
    as ``x`` (any pytree; every layer must return it with the same structure,
    shapes and dtypes). ``*args`` and ``**kwargs`` reach every layer as they
    are (Python values such as ``is_training=True`` stay static), except
    per-layer markers: ``stackwise.per_layer(xs)`` gives layer i ``xs[i]``,
    ``stackwise.per_layer_keys(key)`` gives it the i-th of n split keys and
    ``stackwise.layer_index()`` its index (see also :func:`layer_index`,
    callable inside the block).

    Init runs layer by layer, as the loop does: layer i is initialised on
    the output of layer i - 1 and then run on it. Its init key is the i-th of
    ``jax.random.split(hk.next_rng_key(), n)`` (as in :func:`stackwise.stack`),
    so the params equal those of ``n`` separately transformed blocks
    initialised with those keys, and its initial state (``hk.get_state``,
    including state a block sets from its input, like ``hk.BatchNorm``'s
    averages) equals the loop's: ``transform_with_state(...).init`` returns the
    initial state, not the state after the first call.

    RNG at apply: if the transform has a key, ``hk.next_rng_key()`` inside
    layer i draws from the i-th of n keys split from one
    ``hk.maybe_next_rng_key()``: independent per layer and deterministic.
    State is stacked per layer and updated on every apply.

    Per-layer outputs: with ``has_aux=True`` the block returns ``(x, aux)``
    and the Stack returns ``(x, aux)`` with every aux leaf stacked along a
    leading ``n`` axis:

    >>> def block(x, scale):
    ...     y = x * scale
    ...     return y, jnp.sum(y)
    >>> f = hk.transform(lambda x, s: stackwise.haiku.Stack(block, n=3, has_aux=True)(
    ...     x, stackwise.per_layer(s)))
    >>> f.apply({}, None, jnp.ones(2), jnp.array([1.0, 2.0, 3.0]))
    (Array([6., 6.], dtype=float32), Array([ 2.,  4., 12.], dtype=float32))

    Args:
      block: what one layer is: an ``hk.Module`` subclass (built with no
        arguments), a ``functools.partial`` of one or any zero-argument
        callable returning a module (``lambda: Block(d=8)``); or a function
        ``f(x, *args, **kwargs)`` that uses Haiku modules.
      n: the number of layers, a positive int.
      remat: rematerialise each layer in the backward pass: ``False``,
        ``True`` or a :mod:`jax.checkpoint_policies` policy; see
        :func:`stackwise.stack` (no params pass optimisation barriers). The
        default, ``stackwise.DEFAULT_REMAT``, saves matmul outputs only.
      nested: also checkpoint groups of layers (``True``: about ``sqrt(n)``
        per group; an int: the group size); see :func:`stackwise.stack`.
      unroll: an int for :func:`jax.lax.scan`, or ``True`` for a Python loop.
      reverse: run the last layer first.
      has_aux: the block returns ``(x, aux)``; see above.
      name: the module name; by default ``stack``, ``stack_1``, ...

    Raises:
      TypeError: ``block`` is not a module class, factory or function; ``n``
        is not an int; an argument the block does not accept; a block that
        changes the carry's structure, shape or dtype.
      ValueError: ``n < 1``; params, state or ``per_layer`` inputs whose
        leading axis is not ``n``.
    """

    def __init__(
        self,
        block: type[hk.Module] | Callable[..., Any],
        n: int,
        *,
        remat: bool | Callable[..., bool] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        name: str | None = None,
    ):
        super().__init__(name=name)
        self._what = f"stackwise.haiku.Stack({_block_name(block)}, n={n!r})"
        self._n = n
        self._layers = _Layers(
            block,
            self._what,
            n,
            remat=remat,
            nested=nested,
            unroll=unroll,
            reverse=reverse,
            has_aux=has_aux,
        )

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the ``n`` layers: ``block(x, *args, **kwargs)`` each, in order.

        Returns:
          The last layer's ``x``; with ``has_aux=True``, ``(x, aux)`` with aux
          stacked along a leading ``n`` axis.
        """
        for reserved in (_KEY, _RNG, _INDEX):
            if reserved in kwargs:
                raise TypeError(f"{self._what}: the keyword `{reserved}` is reserved.")
        layers, prefix = self._layers, f"{self.module_name}/"
        init_key = hk.maybe_next_rng_key() if hk.running_init() else None
        rng = hk.maybe_next_rng_key()
        per_layer = {
            _KEY: None if init_key is None else stackwise.per_layer_keys(init_key),
            _RNG: None if rng is None else stackwise.per_layer_keys(rng),
            _INDEX: stackwise.layer_index(),
        }
        # A Stack called twice (shared weights, as for any Haiku module) reuses
        # the params, initial state and current state of its first call.
        reused = (
            (_under(hk.get_params(), prefix), _under(hk.get_initial_state(), prefix))
            if hk.running_init()
            else ({}, {})
        )
        current = _under(hk.get_current_state(), prefix) if any(reused) else None
        forward = {}  # what the layer-by-layer init computed on its way

        def init():
            if any(reused):
                return reused
            out, (aux, params, state, forward["state"]) = layers.initialize.apply(
                None, x, *args, **kwargs, **per_layer
            )
            forward["out"] = (out, aux) if layers.has_aux else out
            return params, state

        lifted, updater = hk.experimental.transparent_lift_with_state(init, allow_reuse=any(reused))
        params, state = lifted()
        if forward:  # init: the layers already ran, each right after its init
            out, state = forward["out"], forward["state"]
        else:
            state = state if current is None else current
            self._check_depth(params, "params")
            self._check_depth(state, "state")
            out, state = layers.forward.apply(params, state, x, *args, **kwargs, **per_layer)
        updater.update(state)
        return out

    def _check_depth(self, tree: Any, what: str) -> None:
        bad = [
            f"  {self.module_name}/{jax.tree_util.keystr(path, simple=True, separator='/')}: "
            f"shape {jnp.shape(leaf)}"
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != self._n
        ]
        if bad:
            raise ValueError(
                f"{self._what}: every leaf of the stacked {what} needs a leading layer "
                f"axis of length n={self._n}, but these do not:\n" + "\n".join(bad) + "\n"
                "Stacked params and state come from this model's `init`; convert those of "
                "a Python loop of blocks with `stackwise.haiku.from_loop`, of "
                "`hk.layer_stack` with `stackwise.haiku.from_layer_stack`, and take the "
                "first k layers with `stackwise.slice_layers`."
            )


def _under(tree: Any, prefix: str) -> dict:
    """The entries of a Haiku params/state dict under ``prefix``, with it cut off."""
    return {k[len(prefix) :]: dict(v) for k, v in tree.items() if k.startswith(prefix)}


class _Layers:
    """The block as per-layer functions, stacked with :func:`stackwise.stack`.

    ``forward``: ``out, state = forward.apply(params, state, x, ...)``, the
    scanned apply. ``initialize``: layer by layer as in a Python loop, layer i
    is initialised on the output of layer i - 1 and then run, so that state
    set from data (``hk.BatchNorm``'s averages) starts as in the loop:
    ``x, (aux, params, initial_state, state) = initialize.apply(None, x, ...)``.
    Layer i gets the i-th of the keys split from the init key (as
    ``Stacked.init`` would split them) and of the apply key.

    A plain class, not an ``hk.Module``: Haiku would run a module's methods
    inside its name scope.
    """

    def __init__(self, block: Any, what: str, n: int, **options: Any):
        self.kind = _block_kind(block, what)
        self.block, self.what, self.has_aux = block, what, options["has_aux"]
        self.transformed = hk.transform_with_state(self.one_layer)
        unused_init = lambda key: None  # noqa: E731 - params come from `initialize`
        name = what  # the core's errors about the layers then name this Stack
        try:  # only validates the options: no user code runs here
            self.forward = stackwise.stack(
                unused_init, self.apply, n, with_state=True, name=name, **options
            )
            self.initialize = stackwise.stack(
                unused_init,
                self.init_then_apply,
                n,
                unroll=options["unroll"],
                reverse=options["reverse"],
                has_aux=True,
                name=name,
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}: {e}") from None

    def one_layer(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """One layer as a Haiku function: builds the block and calls it."""
        module = self.block() if self.kind == "factory" else self.block
        if not callable(module):
            raise TypeError(
                f"{self.what}: `block()` must return a callable module, got "
                f"{type(module).__name__} {module!r}."
            )
        try:
            signature = inspect.signature(module)
        except (TypeError, ValueError):  # no signature to check against
            signature = None
        if signature is not None:
            try:
                signature.bind(x, *args, **kwargs)
            except TypeError as e:
                passed = ", ".join(["x", *("<arg>" for _ in args), *(f"{k}=..." for k in kwargs)])
                raise TypeError(
                    f"{self.what}: the block cannot take the Stack's arguments: {e}. "
                    f"Every layer is called as `block({passed})` with the arguments of "
                    f"the Stack's call, but the block's signature is {signature}."
                ) from None
        return module(x, *args, **kwargs)

    def apply(self, params, state, x, *args, **kwargs):
        rng, index = kwargs.pop(_RNG), kwargs.pop(_INDEX)
        del kwargs[_KEY]
        with _at_layer(index):
            return self.transformed.apply(params, state, rng, x, *args, **kwargs)

    def init_then_apply(self, _, x, *args, **kwargs):
        key, rng, index = kwargs.pop(_KEY), kwargs.pop(_RNG), kwargs.pop(_INDEX)
        with _at_layer(index):
            params, initial = self.transformed.init(key, x, *args, **kwargs)
            out, state = self.transformed.apply(params, initial, rng, x, *args, **kwargs)
        x, aux = out if self.has_aux else (out, None)
        return x, (aux, params, initial, state)
