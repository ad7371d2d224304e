"""``stackwise.equinox.Stack``: an ``eqx.Module`` built n times, held as one stacked block.

The adapter only turns a block into what :func:`stackwise.stack` takes: the block's arrays
(``eqx.partition(block, eqx.is_array)``), with a leading layer axis, are the params; the
rest (static fields, activation functions, Python numbers) is shared by every layer, and
``eqx.combine`` joins the two into layer i's block inside the scan. Scan, remat, unroll,
reverse and patterns all live in the core.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import stackwise
from stackwise import _adapt
from stackwise._markers import _PerLayer
from stackwise.equinox import _convert

__all__ = ["Stack", "layer_index"]

_FRAMEWORK = "equinox"


# --------------------------------------------------------------------------
# 1. The running layer's index.


def layer_index() -> jax.Array:
    """The index of the layer being run, from inside a block's ``__call__``.

    A traced int32 (the layers run inside one scan), so use it in jnp arithmetic, not in
    Python control flow. Inside nested stacks it is the index within the innermost one.

    >>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
    >>> class AddIndex(eqx.Module):
    ...     def __init__(self, key):
    ...         pass
    ...     def __call__(self, x):
    ...         return x * 10 + stackwise.equinox.layer_index()
    >>> blocks = stackwise.equinox.Stack(AddIndex, n=3, key=jax.random.key(0))
    >>> blocks(jnp.int32(0))  # ((0 * 10 + 0) * 10 + 1) * 10 + 2
    Array(12, dtype=int32)

    Returns:
      The layer's index, ``0`` for the first layer (also with ``reverse=True``, where the
      last layer, index ``n - 1``, runs first).

    Raises:
      RuntimeError: called outside a block run by :class:`Stack`.
    """
    return _adapt.current_layer_index(_FRAMEWORK)


# --------------------------------------------------------------------------
# 2. The block: a function of a key that builds an eqx.Module (a Module class taking
#    `key` works too), or a list of them for a pattern.


class _Prebuilt:
    """``block`` stand-in for :meth:`Stack.from_layers`: the stacked layers, made."""

    def __init__(self, layers: Any, name: str):
        self.layers = layers
        self.__qualname__ = name


def _factories(block: Any, who: str) -> tuple[tuple[Callable, ...], bool]:
    """``(factories, is_pattern)``, checked."""
    pattern = isinstance(block, (list, tuple))
    factories = tuple(block) if pattern else (block,)
    if not factories:
        raise ValueError(
            f"{who}: a pattern needs at least one block factory; got an empty list. "
            "E.g. `Stack([make_local, make_global], n=26, key=key)`."
        )
    for i, f in enumerate(factories):
        where = f"`block[{i}]`" if pattern else "`block`"
        if isinstance(f, eqx.Module):
            name = type(f).__name__
            raise TypeError(
                f"{who}: {where} must be a function of a key that builds a block, got a "
                f"built {name} module. Build each layer from its own key: "
                f"`Stack(lambda key: {name}(..., key=key), n, key=key)`, or stack built "
                "blocks with `Stack.from_layers([block_0, ..., block_{n-1}])`."
            )
        if not callable(f):
            raise TypeError(
                f"{who}: {where} must be a function of a key that returns an eqx.Module, "
                f"got {type(f).__name__} {f!r}. E.g. `Stack(lambda key: Block(512, "
                "key=key), n=24, key=key)`."
            )
    return factories, pattern


def _takes_key_keyword(factory: Callable) -> bool:
    """Whether ``factory`` has a parameter named ``key`` (Equinox passes keys by name)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    param = parameters.get("key")
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def _make(factory: Callable, key: jax.Array, who: str) -> Any:
    block = factory(key=key) if _takes_key_keyword(factory) else factory(key)
    if isinstance(block, tuple) and len(block) == 2 and isinstance(block[1], eqx.nn.State):
        raise TypeError(
            f"{who}: `block` returned `(module, state)`, as `eqx.nn.make_with_state` "
            "does; give the plain factory (e.g. `Block`) and make the state once for the "
            "whole model: `model, state = eqx.nn.make_with_state(Model)(...)`, or "
            "`stack, state = eqx.nn.make_with_state(stackwise.equinox.Stack)(Block, n, "
            "key=key)`."
        )
    if not isinstance(block, eqx.Module):
        got = (
            f"an array {jnp.result_type(block).name}{list(jnp.shape(block))}"
            if eqx.is_array(block)
            else type(block).__name__
        )
        raise TypeError(
            f"{who}: `block` ({_adapt.block_name(factory)}) must return an eqx.Module, but "
            f"it returned {got}. Pass a function that builds one block from a key, e.g. "
            "`lambda key: Block(512, key=key)`."
        )
    return block


def _is_key(key: Any) -> bool:
    dtype = getattr(key, "dtype", None)
    if dtype is None:
        return False
    typed = jnp.issubdtype(dtype, jax.dtypes.prng_key) and jnp.shape(key) == ()
    return typed or (dtype == jnp.uint32 and jnp.shape(key) == (2,))


def _check_key(key: Any, who: str, arg: str = "key") -> None:
    if not _is_key(key):
        raise TypeError(
            f"{who}: `{arg}` must be one PRNG key (it is split into one key per layer), "
            f"got {type(key).__name__} {key!r}. Make one with `jax.random.key(seed)`."
        )


def _unused_apply(*args: Any) -> None:
    """The apply of the stack that only builds the layers (``Stacked.init``)."""
    del args


def _build(factories: tuple, pattern: bool, n: int, key: jax.Array, who: str) -> Any:
    """The stacked block(s): ``eqx.filter_vmap(make_block)(jax.random.split(key, n))``."""
    statics: list[Any] = [None] * len(factories)

    def init_at(p: int, factory: Callable) -> Callable:
        def init(key):
            arrays, statics[p] = eqx.partition(_make(factory, key, who), eqx.is_array)
            return arrays

        return init

    inits = [init_at(p, f) for p, f in enumerate(factories)]
    applies = [_unused_apply] * len(factories)
    made = stackwise.stack(
        inits if pattern else inits[0], applies if pattern else applies[0], n, name=who
    ).init(key)
    layers = [eqx.combine(a, s) for a, s in zip(made if pattern else (made,), statics)]
    return tuple(_convert.distinct_markers(layers)) if pattern else layers[0]


# --------------------------------------------------------------------------
# 3. The module.


class Stack(eqx.nn.StatefulLayer):
    """``n`` copies of an ``eqx.Module`` with stacked arrays, run as one scanned layer.

    The loop it replaces, with n separately built blocks:

    >>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
    >>> from functools import partial
    >>> class Block(eqx.Module):
    ...     linear: eqx.nn.Linear
    ...     def __init__(self, d, *, key):
    ...         self.linear = eqx.nn.Linear(d, d, key=key)
    ...     def __call__(self, x):
    ...         return x + jnp.tanh(self.linear(x))
    >>> blocks = [Block(8, key=k) for k in jax.random.split(jax.random.key(0), 4)]
    >>> x = jnp.ones(8)
    >>> y_loop = x
    >>> for block in blocks:
    ...     y_loop = block(y_loop)

    The same as one module: every array gains a leading layer axis (the blocks above,
    stacked, bit for bit) and the block is traced once whatever ``n``:

    >>> stack = stackwise.equinox.Stack(partial(Block, 8), n=4, key=jax.random.key(0))
    >>> stack.layers.linear.weight.shape
    (4, 8, 8)
    >>> bool(jnp.allclose(stack(x), y_loop, atol=1e-6))
    True

    A Stack is an ``eqx.Module``: it sits in a model and goes through ``eqx.filter_jit``,
    ``eqx.filter_grad`` and optax as it is:

    >>> class Model(eqx.Module):
    ...     blocks: stackwise.equinox.Stack
    ...     def __init__(self, key):
    ...         self.blocks = stackwise.equinox.Stack(partial(Block, 8), n=24, key=key)
    ...     def __call__(self, x):
    ...         return self.blocks(x)
    >>> model = Model(jax.random.key(0))
    >>> loss = lambda model, x: jnp.sum(model(x) ** 2)
    >>> grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
    >>> grads.blocks.layers.linear.weight.shape
    (24, 8, 8)

    State (``eqx.nn.BatchNorm`` and any ``eqx.nn.StateIndex``) is per layer and
    stacked in the model's ``eqx.nn.State``; a stateful stack is called like Equinox's
    own stateful layers, ``x, state = stack(x, state)``:

    >>> class Normed(eqx.Module):
    ...     linear: eqx.nn.Linear
    ...     norm: eqx.nn.BatchNorm
    ...     def __init__(self, key):
    ...         self.linear = eqx.nn.Linear(8, 8, key=key)
    ...         self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")
    ...     def __call__(self, x, state):
    ...         h, state = self.norm(self.linear(x), state)
    ...         return x + jnp.tanh(h), state
    >>> make = eqx.nn.make_with_state(stackwise.equinox.Stack)
    >>> normed, state = make(Normed, n=3, key=jax.random.key(0))
    >>> forward = jax.vmap(normed, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    >>> y, state = forward(jnp.ones((5, 8)), state)
    >>> state.get(normed.layers.norm.ema_state_index)[0].shape  # running means, per layer
    (3, 8)

    Per-layer randomness: a ``key`` given to the stack is split into one key per layer
    (``jax.random.split(key, n)[i]`` for layer i, as ``eqx.nn.Sequential`` does) and
    passed to the block as ``key=``; without one, the block gets no ``key``:

    >>> class Noisy(eqx.Module):
    ...     drop: eqx.nn.Dropout
    ...     def __init__(self, key):
    ...         self.drop = eqx.nn.Dropout(0.5)
    ...     def __call__(self, x, *, key=None):
    ...         return self.drop(x, key=key, inference=key is None)
    >>> noisy = stackwise.equinox.Stack(Noisy, n=2, key=jax.random.key(0))
    >>> noisy(jnp.ones(4), key=jax.random.key(1)).shape
    (4,)

    A pattern: a list of k block factories, layer i built by and run as ``block[i % k]``
    (``n`` need not be a multiple of ``k``); ``layers`` is then a tuple of k stacked
    blocks, position p holding layers p, p + k, ...:

    >>> class Scale(eqx.Module):
    ...     s: jax.Array
    ...     def __init__(self, key):
    ...         self.s = jnp.full(8, 0.5)
    ...     def __call__(self, x):
    ...         return x * self.s
    >>> mixed = stackwise.equinox.Stack(
    ...     [partial(Block, 8), partial(Block, 8), Scale], n=7, key=jax.random.key(0))
    >>> mixed.layers[0].linear.weight.shape, mixed.layers[2].s.shape  # layers 0, 3, 6; 2, 5
    ((3, 8, 8), (2, 8))
    >>> mixed(x).shape
    (8,)

    Args:
      block: ``module = block(key)``: a function of a PRNG key that builds one block, an
        ``eqx.Module`` (a Module class or a ``functools.partial`` of one works: when it
        has a parameter named ``key`` the key is passed by name, as Equinox layers take
        it). It is called once, under :func:`jax.vmap`, and the stack equals
        ``[block(k) for k in jax.random.split(key, n)]`` stacked (what
        ``eqx.filter_vmap(block)(keys)`` builds). A list of k such functions for a
        pattern.
      n: the number of layers, a positive int.
      remat: rematerialise each layer in the backward pass (``True`` or a
        :mod:`jax.checkpoint_policies` policy); see :func:`stackwise.stack`. The default,
        ``stackwise.DEFAULT_REMAT``, saves matmul outputs only.
      nested: also checkpoint groups of layers (sqrt(n) remat), as in
        :func:`stackwise.stack`.
      unroll: passed to the scan; ``True`` runs a Python loop.
      reverse: run the last layer first.
      has_aux: the block returns ``(x, aux)``; the stack then returns ``(x, aux)``, aux
        stacked along a leading ``n`` axis (with state: ``((x, aux), state)``).
      with_state: the blocks take and return an explicit per-layer state that is not an
        ``eqx.nn.State`` (e.g. a KV cache as a plain pytree): see "Calling" below.
        Blocks holding ``eqx.nn.StateIndex`` es are stateful without it.
      key: the PRNG key the layers are built from: split into ``n``, one per layer.

    Calling: ``stack(x, *args, key=None, **kwargs)`` runs ``x = block_i(x, *args,
    **kwargs)`` for every layer (with ``key=`` split per layer when given). Arguments
    reach every layer unchanged, except those wrapped in :func:`stackwise.per_layer`
    (layer i gets slice i) or :func:`stackwise.per_layer_keys`. A stateful stack (blocks
    holding ``eqx.nn.StateIndex`` es, or ``with_state=True``) is called ``x, state =
    stack(x, state, *args, **kwargs)`` (``state=`` by keyword works too, as
    ``eqx.nn.Sequential`` passes it), each block as ``x, s = block_i(x, s, *args,
    **kwargs)``:

    * an ``eqx.nn.State``: block i receives an ``eqx.nn.State`` holding layer i's slice of
      its own entries, and the stack returns the given State updated (which, as in
      Equinox, makes the given one stale); blocks without StateIndexes (in a pattern) are
      called without state;
    * any other pytree (``with_state=True``): every leaf has a leading axis ``n`` (a tuple
      of k such trees for a pattern), block i receives slice i, and the stack returns
      the new stacked pytree. Leaves a block writes with
      :func:`jax.lax.dynamic_update_slice` (a KV cache's new positions) are updated in
      place, so decoding with a donated cache copies nothing per token.

    Raises:
      TypeError: ``block`` not a function building an ``eqx.Module`` (e.g. a built
        module), ``key`` not a PRNG key, a bad option, or a block that changes the shape
        or dtype of ``x``.
      ValueError: ``n < 1``, or stacked arrays whose leading axis is not ``n`` (named).
    """

    layers: Any
    n: int = eqx.field(static=True)
    remat: bool | Callable[..., Any] = eqx.field(static=True)
    nested: bool | int = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)
    reverse: bool = eqx.field(static=True)
    has_aux: bool = eqx.field(static=True)
    with_state: bool = eqx.field(static=True)

    def __init__(
        self,
        block: Callable[..., eqx.Module] | Sequence[Callable[..., eqx.Module]],
        n: int,
        *,
        remat: bool | Callable[..., Any] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        with_state: bool = False,
        key: jax.Array | None,
    ):
        who = _adapt.stack_name(_FRAMEWORK, block, n)
        _adapt.check_options(
            who, n, remat=remat, nested=nested, unroll=unroll, reverse=reverse, has_aux=has_aux
        )
        if not isinstance(with_state, bool):
            raise TypeError(
                f"{who}: `with_state` must be True or False, got {type(with_state).__name__} "
                f"{with_state!r}."
            )
        self.n = n
        self.remat = remat
        self.nested = nested
        self.unroll = unroll
        self.reverse = reverse
        self.has_aux = has_aux
        self.with_state = with_state
        if isinstance(block, _Prebuilt):
            self.layers = block.layers
            return
        factories, pattern = _factories(block, who)
        if pattern and n < len(factories):
            raise ValueError(
                f"{who}: a pattern of {len(factories)} blocks needs n >= "
                f"{len(factories)} layers, got n={n}; for fewer layers, give the first n "
                "positions only."
            )
        _check_key(key, who)
        self.layers = _build(factories, pattern, n, key, who)

    # ----------------------------------------------------------------------
    # Calling.

    def is_stateful(self) -> bool:
        """Whether the stack is called ``x, state = stack(x, state, ...)``.

        True with ``with_state=True`` or when its blocks hold ``eqx.nn.StateIndex`` es
        (``eqx.nn.Sequential`` reads this to pass the state on).
        """
        return self.with_state or _convert.holds_state_index(self.layers)

    def __call__(self, x: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
        """Runs the layers: ``stack(x, *args, key=None, **kwargs)``; see :class:`Stack`."""
        blocks, pattern = self._blocks()
        who = self._name()
        stateful, state = self.is_stateful(), None
        if stateful:
            if "state" in kwargs:
                state = kwargs.pop("state")
            elif args:
                state, args = args[0], args[1:]
            else:
                which = (
                    "the stacked per-layer state (`with_state=True`)"
                    if self.with_state
                    else "the model's eqx.nn.State (its blocks hold eqx.nn.StateIndex es; "
                    "make it with `model, state = eqx.nn.make_with_state(Model)(...)`)"
                )
                raise TypeError(
                    f"{who}: a stateful stack is called with {which} and returns it: "
                    "`x, state = stack(x, state, ...)`."
                )
        parts = [eqx.partition(b, eqx.is_array) for b in blocks]
        params = tuple(p for p, _ in parts)
        self._check_depth(params, pattern, who)
        takes_state = [stateful] * len(blocks)
        eqx_state = stateful and isinstance(state, eqx.nn.State)
        if eqx_state:
            takes_state = [_convert.holds_state_index(b) for b in blocks]
            if not any(takes_state):
                raise TypeError(
                    f"{who}: got an eqx.nn.State, but no block holds an "
                    "eqx.nn.StateIndex: with `with_state=True` the state is the stacked "
                    "per-layer pytree the blocks take (e.g. a KV cache `{'k': (n, ...)}`)."
                )
            layer_states = self._substates(state, blocks, pattern, who)
        elif stateful:
            if _convert.holds_state_index(self.layers):
                raise TypeError(
                    f"{who}: its blocks hold eqx.nn.StateIndex es, so `state` must be the "
                    f"model's eqx.nn.State (from `eqx.nn.make_with_state`), got "
                    f"{type(state).__name__}."
                )
            layer_states = state
        applies = [
            _layer_apply(static, takes, eqx_state, stateful, who)
            for (_, static), takes in zip(parts, takes_state)
        ]
        layers = stackwise.stack(
            None,
            applies if pattern else applies[0],
            self.n,
            remat=self.remat,
            nested=self.nested,
            unroll=self.unroll,
            reverse=self.reverse,
            has_aux=self.has_aux,
            with_state=stateful,
            name=who,
        )
        extras = (stackwise.layer_index(), None if key is None else _layer_keys(key, who))
        params = params if pattern else params[0]
        if not stateful:
            return layers.apply(params, x, extras, args, kwargs)
        out, new_states = layers.apply(params, layer_states, x, extras, args, kwargs)
        if not eqx_state:
            return out, new_states
        for sub in new_states if pattern else (new_states,):
            state = state.update(sub)
        return out, state

    # ----------------------------------------------------------------------
    # Views and conversion to and from a list of per-layer blocks.

    def __getitem__(self, i: int) -> eqx.Module:
        """Layer ``i`` as an ordinary block (its arrays sliced; the rest shared).

        >>> import jax, equinox as eqx, stackwise.equinox
        >>> from functools import partial
        >>> stack = stackwise.equinox.Stack(
        ...     partial(eqx.nn.Linear, 2, 3), n=4, key=jax.random.key(0))
        >>> stack[-1].weight.shape
        (3, 2)
        """
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(
                f"{self._name()}: index a Stack with an int layer number, got "
                f"{type(i).__name__} {i!r}; for several layers use `stack.to_layers()[a:b]`."
            ) from None
        if not -self.n <= i < self.n:
            raise IndexError(f"{self._name()}: layer {i} is out of range for n={self.n}.")
        blocks, _ = self._blocks()
        i %= self.n
        return _convert.layer_of(blocks[i % len(blocks)], i // len(blocks))

    def to_layers(self, state: eqx.nn.State | None = None) -> Any:
        """The n per-layer blocks, each an ordinary module holding layer i's arrays.

        Exact: ``Stack.from_layers(stack.to_layers())`` gives back the same stack, bit for
        bit.

        >>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
        >>> from functools import partial
        >>> stack = stackwise.equinox.Stack(
        ...     partial(eqx.nn.Linear, 2, 2), n=3, key=jax.random.key(0))
        >>> blocks = stack.to_layers()
        >>> bool(jnp.array_equal(blocks[2].weight, stack.layers.weight[2]))
        True

        Args:
          state: the ``eqx.nn.State`` holding the stack's entries, for a stack of blocks
            with ``eqx.nn.StateIndex`` es. (An explicit ``with_state=True`` state is a plain
            stacked pytree: :func:`stackwise.unstack_layers` splits it.)

        Returns:
          A list of ``n`` blocks; with ``state``, ``(blocks, states)``: ``states[i]`` an
          ``eqx.nn.State`` of layer i's values, so that ``blocks[i](x, states[i])`` runs
          layer i as the stack does.
        """
        blocks = [self[i] for i in range(self.n)]
        if state is None:
            return blocks
        stacked, _ = self._blocks()
        k = len(stacked)
        per_position = [
            self._unstacked_state(state, b, len(range(p, self.n, k))) for p, b in enumerate(stacked)
        ]
        return blocks, [per_position[i % k][i // k] for i in range(self.n)]

    @classmethod
    def from_layers(
        cls,
        blocks: Sequence[eqx.Module],
        states: Sequence[eqx.nn.State] | None = None,
        *,
        period: int = 1,
        remat: bool | Callable[..., Any] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        with_state: bool = False,
    ) -> Any:
        """A :class:`Stack` holding the arrays of separately built blocks.

        Layer i is ``blocks[i]``. The blocks (of one pattern position) must agree in
        everything but their array values: type, static fields, functions held in
        fields, and array shapes and dtypes. The inverse of :meth:`to_layers`, exact.

        >>> import jax, equinox as eqx, stackwise.equinox
        >>> keys = jax.random.split(jax.random.key(0), 5)
        >>> blocks = [eqx.nn.Linear(2, 3, key=k) for k in keys]
        >>> stackwise.equinox.Stack.from_layers(blocks).layers.weight.shape
        (5, 3, 2)

        Args:
          blocks: the per-layer modules, in order.
          states: for blocks with ``eqx.nn.StateIndex`` es, one ``eqx.nn.State`` per block
            holding its values (what ``eqx.nn.make_with_state(Block)(...)`` returns with
            each block, or :meth:`to_layers` with ``state``).
          period: the length k of a layer pattern: layer i is then position ``i % k``,
            stacked with the blocks of its position.
          remat, nested, unroll, reverse, has_aux, with_state: as for :class:`Stack`.

        Returns:
          The stack; with ``states``, ``(stack, state)``: one ``eqx.nn.State`` holding
          the stacked values. The blocks themselves are left unchanged.

        Raises:
          TypeError: a block that is not an ``eqx.Module`` or that differs from the
            first block of its position (the first difference is named).
          ValueError: no blocks, a bad ``period``, or blocks whose state lives in an
            ``eqx.nn.State`` but no ``states``.
        """
        blocks = list(blocks)
        who = "stackwise.equinox.Stack.from_layers"
        if not blocks:
            raise ValueError(f"{who}: needs at least one block, got an empty list.")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"{who}: `period` must be a positive int, got {period!r}.")
        if len(blocks) < period:
            raise ValueError(
                f"{who}: a pattern of period {period} needs at least {period} blocks, got "
                f"{len(blocks)}."
            )
        for i, block in enumerate(blocks):
            if not isinstance(block, eqx.Module):
                raise TypeError(
                    f"{who}: block {i} must be an eqx.Module, got {type(block).__name__}."
                )
        if states is not None:
            states = list(states)
            if len(states) != len(blocks):
                raise ValueError(
                    f"{who}: got {len(blocks)} blocks but {len(states)} states; give one "
                    "eqx.nn.State per block."
                )
        else:
            stripped = [
                i
                for i, b in enumerate(blocks)
                if any(
                    isinstance(x.init, eqx.Module) and not jax.tree.leaves(x.init)
                    for x in _convert.state_indices(b)
                )
            ]
            if stripped:
                raise ValueError(
                    f"{who}: block {stripped[0]} holds eqx.nn.StateIndex es whose values "
                    "live in an eqx.nn.State (made by `eqx.nn.make_with_state`); pass them "
                    "too: `stack, state = Stack.from_layers(blocks, states)`."
                )
        numbers = [list(range(p, len(blocks), period)) for p in range(period)]
        stacked = [_convert.stack_blocks([blocks[i] for i in nums], who, nums) for nums in numbers]
        stacked = _convert.distinct_markers(stacked)
        layers = tuple(stacked) if period > 1 else stacked[0]
        stack = cls(
            _Prebuilt(layers, _adapt.block_name(_types(blocks[:period], period > 1))),
            len(blocks),
            remat=remat,
            nested=nested,
            unroll=unroll,
            reverse=reverse,
            has_aux=has_aux,
            with_state=with_state,
            key=None,
        )
        if states is None:
            return stack
        state = _convert.merge_states(
            [
                _convert.stack_states(
                    [blocks[i] for i in nums], [states[i] for i in nums], s, who, nums
                )
                for nums, s in zip(numbers, stacked)
            ]
        )
        return stack, state

    # ----------------------------------------------------------------------
    # 4. Private helpers.

    def _blocks(self) -> tuple[tuple, bool]:
        pattern = isinstance(self.layers, tuple)
        return (self.layers if pattern else (self.layers,)), pattern

    def _name(self) -> str:
        blocks, pattern = self._blocks()
        return _adapt.stack_name(_FRAMEWORK, _types(blocks, pattern), self.n)

    def _counts(self) -> list[int]:
        blocks, _ = self._blocks()
        return [len(range(p, self.n, len(blocks))) for p in range(len(blocks))]

    def _check_depth(self, params: tuple, pattern: bool, who: str) -> None:
        fix = (
            "Stacked layers come from building the Stack or from `Stack.from_layers("
            "[block_0, ..., block_{n-1}])`; a replaced array keeps the layer axis, e.g. "
            "`eqx.tree_at(lambda s: s.layers.linear.weight, stack, new)` with `new` of "
            "shape (n, ...)."
        )
        for p, (sub, count) in enumerate(zip(params, self._counts())):
            where = "layers" + (f"[{p}]" if pattern else "")
            leaves = [
                (where + jax.tree_util.keystr(path), leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(sub)
            ]
            _adapt.check_depth(leaves, count, who, "block's arrays", fix)

    def _substates(self, state: eqx.nn.State, blocks: tuple, pattern: bool, who: str) -> Any:
        subs = []
        for p, (block, count) in enumerate(zip(blocks, self._counts())):
            try:
                sub = state.substate(block)
            except KeyError:
                raise ValueError(
                    f"{who}: the given eqx.nn.State holds no values for the stack's "
                    "eqx.nn.StateIndex es; pass the State made together with the model: "
                    "`model, state = eqx.nn.make_with_state(Model)(...)`."
                ) from None
            values, markers = sub.tree_flatten()
            where = "state" + (f" of layers[{p}]" if pattern else "")
            leaves = [
                (f"{where}[{m!r}]" + jax.tree_util.keystr(path), leaf)
                for m, v in zip(markers, values)
                for path, leaf in jax.tree_util.tree_leaves_with_path(v)
            ]
            _adapt.check_depth(
                leaves,
                count,
                who,
                "state",
                "The State of a Stack comes from `eqx.nn.make_with_state` of a model "
                "holding it (or `Stack.from_layers(blocks, states)`).",
            )
            subs.append(sub)
        return tuple(subs) if pattern else subs[0]

    def _unstacked_state(self, state: eqx.nn.State, block: Any, count: int) -> list:
        if not isinstance(state, eqx.nn.State):
            raise TypeError(
                f"{self._name()}.to_layers: `state` must be an eqx.nn.State, got "
                f"{type(state).__name__}."
            )
        return _convert.unstack_state(state, block, count)


def _types(blocks: Sequence[Any], pattern: bool) -> Any:
    """What messages name the block by: its type (a list of types for a pattern)."""
    types = [type(b) for b in blocks]
    return types if pattern else types[0]


def _layer_keys(key: Any, who: str) -> Any:
    """A key given to the stack: one per layer (a per-layer marker is kept as given)."""
    if isinstance(key, _PerLayer):
        return key
    _check_key(key, who)
    return stackwise.per_layer_keys(key)


def _layer_apply(
    static: Any, takes_state: bool, eqx_state: bool, with_state: bool, who: str
) -> Callable:
    """Position p's per-layer apply for :func:`stackwise.stack`."""

    def run(params, state, x, extras, args, kwargs):
        index, key = extras
        block = eqx.combine(params, static)
        if key is not None:
            kwargs = {**kwargs, "key": key}
        with _adapt.at_layer(index):
            if not takes_state:
                return block(x, *args, **kwargs), state
            out = block(x, state, *args, **kwargs)
        if eqx_state and not (
            isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)
        ):
            got = type(out[1] if isinstance(out, tuple) and len(out) == 2 else out).__name__
            raise TypeError(
                f"{who}: a block called with an eqx.nn.State returns `(x, state)` with "
                f"the state it was given, updated (e.g. `x, state = self.norm(x, state)`), "
                f"but it returned {got} in its place."
            )
        return out

    if with_state:
        return run

    def apply(params, x, extras, args, kwargs):
        return run(params, None, x, extras, args, kwargs)[0]

    return apply
