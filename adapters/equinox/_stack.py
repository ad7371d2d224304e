"""``stackwise.equinox.Stack``: an ``eqx.Module`` built n times, held as one stacked block.

The adapter only turns a block into what :func:`stackwise.stack` takes: the block's arrays
(``eqx.partition(block, eqx.is_array)``), with a leading layer axis, are the params; the
rest (static fields, activation functions, Python numbers) is shared by every layer, and
``eqx.combine`` joins the two into layer i's block inside the scan. Scan, remat, unroll,
reverse and patterns all live in the core; an ``eqx.nn.State`` is handled in ``_state``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import stackwise
from stackwise import _kit
from stackwise.equinox import _convert, _quax, _serving, _state

__all__ = ["Stack", "layer_index"]


# --------------------------------------------------------------------------
# The layer index, readable from inside a block.


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
      last layer, index ``n - 1``, runs first, and across a pattern).

    Raises:
      RuntimeError: called outside a block run by :class:`Stack`.
    """
    return _kit.current_layer_index("equinox")


# --------------------------------------------------------------------------
# The block: a function of a key that builds an eqx.Module (a Module class taking
# `key` works too), or a list of them for a pattern.


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
    try:
        block = factory(key=key) if _takes_key_keyword(factory) else factory(key)
    except TypeError as e:
        if not isinstance(factory, type):
            raise  # the user's own function failed: its error is the right one
        name = factory.__name__
        raise TypeError(
            f"{who}: `block` is called with a key only, once per layer, but `{name}(key=key)` "
            f"failed: {e}. Pass a factory that gives the other arguments: "
            f"`functools.partial({name}, ...)` or `lambda key: {name}(..., key=key)`, e.g. "
            "`Stack(functools.partial(eqx.nn.Linear, 512, 512), n, key=key)`."
        ) from None
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
            f"{who}: `block` ({_kit.block_name(factory)}) must return an eqx.Module, but "
            f"it returned {got}. Pass a function that builds one block from a key, e.g. "
            "`lambda key: Block(512, key=key)`."
        )
    return block


def _check_key(key: Any, who: str) -> None:
    _kit.prng_key(key, who)


def _unused(*args: Any) -> None:
    """The apply of the stack that only builds the layers (:func:`_build`)."""
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
    applies = [_unused] * len(factories)
    made = stackwise.stack(
        inits if pattern else inits[0], applies if pattern else applies[0], n, name=who
    ).init(key)
    layers = [eqx.combine(a, s) for a, s in zip(made if pattern else (made,), statics)]
    return tuple(_state.distinct_markers(layers)) if pattern else layers[0]


# --------------------------------------------------------------------------
# The module.


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

    Fine-tuning: quax's ``loraify`` of a Stack gives each layer its own adapter, and the
    Stack runs each layer quaxified inside its scan and remat (call it directly or through
    :func:`stackwise.equinox.quaxify`); ``stackwise.lora.attach(stack, adapters,
    per_leaf=True)`` and ``stackwise.quant.quantize(stack)`` are Stacks whose layers build
    their float weights one at a time; a batch of adapters runs group j of the input's
    leading axis with adapter j, the rows mapped outside (``docs/finetune.md``).

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
      fsdp: mesh axis (or axes) the arrays are sharded over: each layer's arrays are
        gathered inside the loop and never saved for the backward pass (see
        :func:`stackwise.stack`).
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
    fsdp: str | tuple[str, ...] | None = eqx.field(static=True)
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
        fsdp: str | tuple[str, ...] | None = None,
        with_state: bool = False,
        key: jax.Array | None,
    ):
        who = _kit.stack_name("equinox", block, n)
        _kit.hold_options(self, who, n, locals())
        self.with_state = _kit.check_bool(with_state, "with_state", who)
        if isinstance(block, _kit.Prebuilt):
            self.layers = block.layers
            return
        factories, pattern = _factories(block, who)
        _check_key(key, who)
        self.layers = _build(factories, pattern, n, key, who)

    def _blocks(self) -> tuple[tuple, bool]:
        """``(blocks, is_pattern)``: the stacked block of each pattern position (one
        without a pattern); ``layers`` is a tuple for a pattern."""
        pattern = isinstance(self.layers, tuple)
        return (self.layers if pattern else (self.layers,)), pattern

    def _who(self) -> str:
        served = _serving.served(self.layers)
        blocks, pattern = _serving.positions(self.layers) if served else self._blocks()
        return _kit.stack_name("equinox", list(blocks) if pattern else blocks[0], self.n)

    def is_stateful(self) -> bool:
        """Whether the stack is called ``x, state = stack(x, state, ...)``.

        True with ``with_state=True`` or when its blocks hold ``eqx.nn.StateIndex`` es
        (``eqx.nn.Sequential`` reads this to pass the state on).
        """
        return self.with_state or _state.holds_state_index(self.layers)

    def __call__(self, x: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
        """Runs the layers: ``stack(x, *args, key=None, **kwargs)``; see :class:`Stack`."""
        who, stateful, state = self._who(), self.is_stateful(), None
        if stateful:  # (served: the layers are run by the core's serving loop)
            state, args, kwargs = _state.take(args, kwargs, self.with_state, who)
        if _serving.served(self.layers):
            params, statics = _serving.unpack(self.layers, self.n, who)
            pattern = self.layers.pattern is not None
            states, takes_state = _serving.layer_states(state, self.layers, stateful, who)
        else:
            blocks, pattern = self._blocks()
            counts = [len(range(p, self.n, len(blocks))) for p in range(len(blocks))]
            states, takes_state = _state.layer_states(state, blocks, pattern, counts, stateful, who)
            parts = [eqx.partition(b, eqx.is_array) for b in blocks]
            params, statics = tuple(p for p, _ in parts), [s for _, s in parts]
            self._check_depth(params, pattern, counts, who)
            _kit.warn_unrematted(params, self.remat, who)
            if not _quax.holds_values(params):
                _quax.check_outer(params, pattern, self.remat or self.nested, who)
            params = params if pattern else params[0]
        quaxed = _quax.holds_values(params)
        eqx_state = isinstance(state, eqx.nn.State)
        applies = [
            _layer_apply(static, takes, eqx_state, quaxed, who)
            for static, takes in zip(statics, takes_state)
        ]
        layers = stackwise.stack(
            None,
            applies if pattern else applies[0],
            self.n,
            with_state=True,
            name=who,  # the core names the block in its errors (carry, returns)
            **{name: getattr(self, name) for name in _kit.OPTION_NAMES},
        )
        extras = {"index": stackwise.layer_index(), "key": None}
        if _kit.is_per_layer(key):  # the user's own marker: resolved (and named) as given
            kwargs = {**kwargs, "key": key}
        elif key is not None:
            _check_key(key, who)
            extras["key"] = stackwise.per_layer_keys(key)
        call = _kit.CallArgs(args, kwargs)
        out, new = layers.apply(params, states, x, extras, call)
        served = _serving.served(self.layers)
        new = _serving.updated(state, new, self.layers) if served else new
        return (out, new if served else _state.updated(state, new, pattern)) if stateful else out

    def _check_depth(self, params: tuple, pattern: bool, counts: list[int], who: str) -> None:
        loop = "stackwise.equinox.to_serving(stack)"
        _kit.refuse_serving(who, loop, layers=params if pattern else params[0])
        fix = (
            "Stacked layers come from building the Stack or from `Stack.from_layers("
            "[block_0, ..., block_{n-1}])`; a replaced array keeps the layer axis, e.g. "
            "`eqx.tree_at(lambda s: s.layers.linear.weight, stack, new)` with `new` of "
            "shape (n, ...)."
        )
        for p, (sub, count) in enumerate(zip(params, counts)):
            where = "layers" + (f"[{p}]" if pattern else "")
            leaves = [
                (where + jax.tree_util.keystr(path), leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(sub)
            ]
            _kit.check_depth(leaves, count, who, "block's arrays", fix)

    # ----------------------------------------------------------------------
    # Conversion to and from a list of per-layer blocks.

    def __getitem__(self, i: int) -> eqx.Module:
        """Layer ``i`` as an ordinary block (its arrays sliced; the rest shared).

        >>> import jax, equinox as eqx, stackwise.equinox
        >>> from functools import partial
        >>> stack = stackwise.equinox.Stack(
        ...     partial(eqx.nn.Linear, 2, 3), n=4, key=jax.random.key(0))
        >>> stack[-1].weight.shape
        (3, 2)
        """
        who = self._who()
        i = _kit.layer_number(i, self.n, who, "i")
        if _serving.served(self.layers):
            return self.layers.layers[i]
        blocks, pattern = self._blocks()
        counts = [len(range(p, self.n, len(blocks))) for p in range(len(blocks))]
        self._check_depth(tuple(_convert.arrays(b) for b in blocks), pattern, counts, who)
        return _convert.layer_of(blocks[i % len(blocks)], i // len(blocks))

    def to_layers(self, state: eqx.nn.State | None = None) -> Any:
        """The n per-layer blocks, each an ordinary module holding layer i's arrays.

        Exact: ``Stack.from_layers(stack.to_layers())`` gives back the same stack, bit for
        bit. For a pattern, the blocks come in layer order (layer i is of the kind of
        position ``i % k``).

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
        stacked = _serving.stacked_blocks(self, f"{self._who()}.to_layers")
        return blocks, _state.unstack(state, stacked, self.n, f"{self._who()}.to_layers")

    def to_serving(self, state: eqx.nn.State | None = None) -> Any:
        """Refused: the serving layout is made by :func:`stackwise.equinox.to_serving`,
        ``stackwise.equinox.to_serving(stack)`` (``state=state`` for an ``eqx.nn.State``),
        the one call of every framework.

        Raises:
          TypeError: always, naming the call that replaced it.
        """
        given = "" if state is None else ", state=state"
        call = f"stackwise.equinox.to_serving(stack{given})"
        raise _kit.serving.moved(f"{self._who()}.to_serving()", call)

    def from_serving(self, state: eqx.nn.State | None = None) -> Any:
        """Refused: :func:`stackwise.equinox.from_serving` converts back.

        Raises:
          TypeError: always, naming the call that replaced it.
        """
        given = "" if state is None else ", state=state"
        call = f"stackwise.equinox.from_serving(stack{given})"
        raise _kit.serving.moved(f"{self._who()}.from_serving()", call)

    @classmethod
    def from_layers(
        cls,
        blocks: Sequence[eqx.Module],
        states: Sequence[eqx.nn.State] | None = None,
        *,
        pattern: int = 1,
        **options: Any,
    ) -> Any:
        """A :class:`Stack` holding the arrays of separately built blocks.

        Layer i is ``blocks[i]``. The blocks (with ``pattern=k``: the blocks of each
        position ``i % k``) must agree in everything but their array values: type, static
        fields, functions held in fields, and array shapes and dtypes. The inverse of
        :meth:`to_layers`, exact.

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
          pattern: k, the length of the repeating pattern of block kinds.
          **options: ``remat``, ``nested``, ``unroll``, ``reverse``, ``has_aux``,
            ``fsdp``, ``with_state``, as for :class:`Stack`.

        Returns:
          The stack; with ``states``, ``(stack, state)``: one ``eqx.nn.State`` holding
          the stacked values. The blocks themselves are left unchanged.

        Raises:
          TypeError: a block that is not an ``eqx.Module`` or that differs from the
            first block of its position (the first difference is named), or a bad
            ``pattern``.
          ValueError: no blocks, fewer blocks than the pattern's length, or blocks whose
            state lives in an ``eqx.nn.State`` but no ``states``.
        """
        who = "stackwise.equinox.Stack.from_layers"
        _kit.check_built_options(options, (*_kit.OPTION_NAMES, "with_state"), who)
        blocks = _kit.check_built(blocks, pattern, eqx.Module, "an eqx.Module", who)
        states = _state.check_states(blocks, states, who)
        stacked = [
            _convert.stack_blocks(blocks[p::pattern], who, range(p, len(blocks), pattern))
            for p in range(pattern)
        ]
        stacked = _state.distinct_markers(stacked)
        name = _kit.block_name(blocks[:pattern] if pattern > 1 else blocks[0])
        layers = tuple(stacked) if pattern > 1 else stacked[0]
        stack = cls(_kit.Prebuilt(layers, name), len(blocks), key=None, **options)
        if states is None:
            return stack
        return stack, _state.stack_states(blocks, states, stacked, who)


# --------------------------------------------------------------------------
# The per-layer function.


def _layer_apply(
    static: Any, takes_state: bool, eqx_state: bool, quaxed: bool, who: str
) -> Callable:
    """A position's layer for :func:`stackwise.stack`: its block, from the layer's arrays
    (quaxified when they hold quax values, so that the scan and remat see plain arrays)."""

    def run(block, x, state, extras, call):
        block = _quax.layer(block) if quaxed else block
        kwargs = call.kwargs if extras["key"] is None else {**call.kwargs, "key": extras["key"]}
        with _kit.at_layer(extras["index"]):
            if not takes_state:
                return block(x, *call.args, **kwargs), state
            out = block(x, state, *call.args, **kwargs)
        if eqx_state:
            _state.check_returned(out, who)
        return out

    def apply(params, state, x, extras, call):  # LoRA / quantized; a batch: group j, adapter j
        return _kit.run_layer(run, eqx.combine(params, static), x, state, extras, call, who=who)

    return apply
