"""``stackwise.haiku.Stack``: an ordinary ``hk.Module`` repeated n times, scanned.

The adapter only turns the block into per-layer ``init``/``apply`` functions
with :func:`haiku.transform_with_state`, stacks them with
:func:`stackwise.stack` (which owns scan, remat, unroll and reverse) and lifts
the stacked params and state into the enclosing Haiku transform. Params and state
in the serving layout (``_serving.py``) go to the same stack's serving loop.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax

import stackwise
from stackwise import _kit
from stackwise.haiku import _serving

__all__ = ["Stack", "layer_index"]


# --------------------------------------------------------------------------
# The layer index, readable from inside a block.


def layer_index() -> jax.Array:
    """The index of the layer being run, inside a block run by :class:`Stack`.

    A traced int32 scalar: layer i of the stack gets ``i`` (also with
    ``reverse=True``, where layer ``n - 1`` runs first, and across a pattern of
    blocks). Inside nested Stacks it is the index within the innermost one.

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> def block(x):
    ...     return x * 10 + stackwise.haiku.layer_index()
    >>> f = hk.transform(lambda x: stackwise.haiku.Stack(block, n=3)(x))
    >>> f.apply(f.init(None, 0), None, 0)
    Array(12, dtype=int32)

    Raises:
      RuntimeError: when called outside a block run by :class:`Stack`.
    """
    return _kit.current_layer_index("haiku")


# --------------------------------------------------------------------------
# The block: a module class, a factory of modules, or a function of x.


def _block_kind(block: Any, who: str) -> str:
    """``"factory"`` (called with no arguments, returns a module) or ``"function"``."""
    usage = (
        "`block` must be an `hk.Module` subclass, a `functools.partial` of one, a "
        "zero-argument callable returning a module (e.g. `lambda: Block(d=8)`), or a "
        "function `f(x, *args, **kwargs)` that uses Haiku modules"
    )
    if isinstance(block, hk.Module):
        raise TypeError(
            f"{who}: {usage}; got the module instance {block!r}. Every layer needs its "
            f"own module: pass `{type(block).__name__}` (or `lambda: "
            f"{type(block).__name__}(...)`) instead of `{type(block).__name__}(...)`."
        )
    if not callable(block):
        raise TypeError(f"{who}: {usage}; got {type(block).__name__} {block!r}.")
    target = block.func if isinstance(block, functools.partial) else block
    if isinstance(target, type) and not issubclass(target, hk.Module):
        raise TypeError(f"{who}: {usage}; got the class {target.__qualname__}.")
    try:
        inspect.signature(block).bind()
    except TypeError:
        if isinstance(target, type):
            raise TypeError(
                f"{who}: the module class needs constructor arguments "
                f"{inspect.signature(block)}; pass them with "
                f"`functools.partial({target.__qualname__}, ...)` or "
                f"`lambda: {target.__qualname__}(...)`."
            ) from None
        return "function"
    except ValueError:  # no signature (some builtins): treat as a function of x
        return "function"
    return "factory"


def _check_call(module: Any, who: str, x: Any, args: tuple, kwargs: dict) -> None:
    """Raises a TypeError naming the block when it cannot take the Stack's arguments."""
    try:
        signature = inspect.signature(module)
    except (TypeError, ValueError):  # no signature to check against
        return
    try:
        signature.bind(x, *args, **kwargs)
    except TypeError as e:
        passed = ", ".join(["x", *("<arg>" for _ in args), *(f"{k}=..." for k in kwargs)])
        raise TypeError(
            f"{who}: the block cannot take the Stack's arguments: {e}. Every layer is "
            f"called as `block({passed})` with the arguments of the Stack's call, but the "
            f"block's signature is {signature}."
        ) from None


# --------------------------------------------------------------------------
# The module.


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

    A pattern of blocks repeats along the depth (layer i is ``block[i % k]``,
    ``n`` need not be a multiple of ``k``); each position's params are named
    as a function calling the k blocks in order would name them:

    >>> class Local(hk.Module):
    ...     def __call__(self, x):
    ...         return x + jnp.tanh(hk.Linear(8)(x))
    >>> class Global(Local):
    ...     pass
    >>> f = hk.transform(lambda x: stackwise.haiku.Stack([Local, Local, Global], n=8)(x))
    >>> jax.tree.map(jnp.shape, f.init(jax.random.key(0), jnp.ones((2, 8))))["stack/local_1/linear"]
    {'b': (3, 8), 'w': (3, 8, 8)}

    Names: the Stack is a module (named ``stack``, ``stack_1``, ... unless
    ``name`` is given) and the block's own names follow it, so a block
    ``Block`` with an ``hk.Linear`` keeps its params under
    ``"<scope>/stack/block/linear"``, e.g. ``"model/~/stack/block/linear"``
    for a Stack built in the constructor of a module ``Model``. A function
    block has no module of its own: its ``hk.Linear`` is
    ``"<scope>/stack/linear"`` (in a pattern, a function block is a module
    named after the function). State (``hk.get_state``) is named the same way
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

    LoRA and quantized weights (``docs/finetune.md``): the params may hold
    ``stackwise.lora.attach(..., per_leaf=True)`` and ``stackwise.quant.quantize``
    leaves. A batch of g adapters (``stackwise.lora.stack_adapters``) runs group
    j of ``x``'s leading axis with adapter j; every group gets the same ``rng``,
    and state a group updates from its rows (``hk.BatchNorm`` in training) is
    refused.

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
    State is stacked per layer and updated on every apply; a KV cache a
    block writes with ``lax.dynamic_update_slice`` is updated in place.

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

    Serving: params and state converted once by :func:`stackwise.haiku.to_serving`
    (each stacked leaf a ``stackwise.Serving`` of its per-layer arrays) run as a Python
    loop over the separate buffers, as the loop of blocks does: no per-layer slice of a
    stacked weight, and a donated cache written in place in each layer's own buffer. The
    new state comes back in that layout; :func:`stackwise.haiku.from_serving` stacks it
    back. A Stack built with ``fsdp`` or ``nested`` refuses it.

    Args:
      block: what one layer is: an ``hk.Module`` subclass (built with no
        arguments), a ``functools.partial`` of one or any zero-argument
        callable returning a module (``lambda: Block(d=8)``); or a function
        ``f(x, *args, **kwargs)`` that uses Haiku modules. A list of k of
        these is a pattern: layer i is ``block[i % k]``.
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
      fsdp: mesh axis (or axes) the params are sharded over: each layer's
        params are gathered inside the loop and never saved for the
        backward pass (see :func:`stackwise.stack`).
      name: the module name; by default ``stack``, ``stack_1``, ...

    Raises:
      TypeError: ``block`` is not a module class, factory or function; ``n``
        or an option has the wrong type; an argument the block does not
        accept; a block that changes the carry's structure, shape or dtype;
        variables partly served and partly stacked, or a module's whole dict
        replaced by a ``stackwise.Serving``.
      ValueError: ``n < 1``; params, state or ``per_layer`` inputs whose
        leading axis is not ``n`` (served ones: that do not hold the Stack's layers);
        served variables given a Stack built with ``fsdp`` or ``nested``.
    """

    def __init__(
        self,
        block: type[hk.Module] | Callable[..., Any] | list[Any],
        n: int,
        *,
        remat: bool | Callable[..., Any] = stackwise.DEFAULT_REMAT,
        nested: bool | int = False,
        unroll: int | bool = 1,
        reverse: bool = False,
        has_aux: bool = False,
        fsdp: str | tuple[str, ...] | None = None,
        name: str | None = None,
    ):
        super().__init__(name=name)
        who = _kit.stack_name("haiku", block, n)
        options = _kit.stack_options(who, n, locals())
        self._layers = _Layers(block, n, who, **options)

    @property
    @hk.transparent  # a plain read, also outside a transform: no name scope, no interceptor
    def position_names(self) -> list[str] | None:
        """A pattern's positions' module names, in the pattern's order; None without a pattern.

        Each position is a module inside the Stack, named as a function calling
        the k blocks in order would name them. The names are known once the
        Stack has run (at init or apply); before, this is None too.

        >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
        >>> class Local(hk.Module):
        ...     def __call__(self, x):
        ...         return x + hk.Linear(2)(x)
        >>> class Global(Local):
        ...     pass
        >>> names = []
        >>> def g(x):
        ...     stack = stackwise.haiku.Stack([Local, Local, Global], n=5)
        ...     y = stack(x)
        ...     names.append(stack.position_names)
        ...     return y
        >>> _ = hk.transform(g).init(jax.random.key(0), jnp.ones(2))
        >>> names
        [['local', 'local_1', 'global']]
        """
        layers = self._layers
        return list(layers.names) if layers.pattern and layers.names is not None else None

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the ``n`` layers: ``block(x, *args, **kwargs)`` each, in order.

        Returns:
          The last layer's ``x``; with ``has_aux=True``, ``(x, aux)`` with aux
          stacked along a leading ``n`` axis (a tuple per position for a pattern).
        """
        layers, prefix = self._layers, f"{self.module_name}/"
        if not hk.running_init():  # (Haiku's lift takes a dict per module)
            _serving.refuse_whole(hk.get_params(), prefix, layers.who)
        call = _kit.CallArgs(args, kwargs)
        init_key = hk.maybe_next_rng_key() if hk.running_init() else None
        rng = hk.maybe_next_rng_key()
        extras = {
            "index": stackwise.layer_index(),
            "init_key": None if init_key is None else stackwise.per_layer_keys(init_key),
            "rng": None if rng is None else stackwise.per_layer_keys(rng),
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
            out, params, initial, forward["state"] = layers.initialize(x, extras, call)
            forward["out"] = out
            return params, initial

        lifted, updater = hk.experimental.transparent_lift_with_state(init, allow_reuse=any(reused))
        params, state = lifted()
        if forward:  # init: the layers already ran, each right after its init
            out, state = forward["out"], forward["state"]
        else:
            state = state if current is None else current
            out, state = layers.apply(params, state, x, extras, call, self.module_name)
        updater.update(state)
        return out


def _under(tree: Any, prefix: str) -> dict:
    """The entries of a Haiku params/state dict under ``prefix``, with it cut off."""
    return {k[len(prefix) :]: dict(v) for k, v in tree.items() if k.startswith(prefix)}


class _Layers:
    """The block (or a pattern of blocks) as per-layer functions, stacked by the core.

    ``apply``: the scanned apply of the stacked params and state. ``initialize``:
    layer by layer as in a Python loop, layer i is initialised on the output of
    layer i - 1 and then run, so that state set from data (``hk.BatchNorm``'s
    averages) starts as in the loop.

    A plain class, not an ``hk.Module``: Haiku would run a module's methods
    inside its name scope.
    """

    def __init__(self, block: Any, n: int, who: str, **options: Any):
        self.pattern = isinstance(block, (list, tuple))
        blocks = list(block) if self.pattern else [block]
        if not blocks:
            raise ValueError(f"{who}: a pattern needs at least one block; got an empty list.")
        kinds = [_block_kind(b, who) for b in blocks]
        # What the block's call is checked against: the function, or the module it builds.
        self.signatures = [b if kind == "function" else None for b, kind in zip(blocks, kinds)]
        if self.pattern:  # each position is a module, named as a call of all k would name it
            blocks = [b if kind == "factory" else _as_module(b) for b, kind in zip(blocks, kinds)]
            kinds = ["factory"] * len(blocks)
        self.blocks, self.kinds, self.who, self.has_aux = blocks, kinds, who, options["has_aux"]
        self.remat, self.fsdp, self.nested = options["remat"], options["fsdp"], options["nested"]
        self.n, k = n, len(blocks)
        self.counts = [len(range(p, n, k)) for p in range(k)]
        self.transformed = [hk.transform_with_state(self._one_layer(p)) for p in range(k)]
        one = (lambda fns: fns) if self.pattern else (lambda fns: fns[0])
        self.forward = stackwise.stack(
            None,
            one([self._apply(p) for p in range(k)]),
            n,
            with_state=True,
            name=who,
            **options,
        )
        self.initializer = stackwise.stack(
            None,
            one([self._init_then_apply(p) for p in range(k)]),
            n,
            unroll=options["unroll"],
            reverse=options["reverse"],
            has_aux=True,
            name=who,
        )
        self.names: list[str] | None = None  # each position's module name, once known

    def _one_layer(self, p: int) -> Callable:
        """Position p as a Haiku function: builds the k blocks in order, calls block p."""

        def one_layer(x, call):
            args, kwargs = call.args, call.kwargs
            if self.kinds[p] == "function":
                module = self.blocks[p]
            else:
                modules = [make() for make in self.blocks] if self.pattern else [self.blocks[p]()]
                module = modules[p] if self.pattern else modules[0]
                if not callable(module):
                    raise TypeError(
                        f"{self.who}: `block()` must return a callable module, got "
                        f"{type(module).__name__} {module!r}."
                    )
                if self.pattern and self.names is None:
                    self.names = [m.module_name for m in modules]
            _check_call(self.signatures[p] or module, self.who, x, args, kwargs)
            out = module(x, *args, **kwargs)
            if self.has_aux and not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"{self.who}: with `has_aux=True` the block returns `(x, aux)`, but it "
                    f"returned {_kit.describe(out)}. Return `x, aux` from the block's "
                    "`__call__` (aux may "
                    "be `()`), or build the Stack without `has_aux`."
                )
            return out

        return one_layer

    def _apply(self, p: int) -> Callable:
        def block(params, x, state, extras, call):
            with _kit.at_layer(extras["index"]):
                return self.transformed[p].apply(params, state, extras["rng"], x, call)

        def apply(params, state, x, extras, call):
            # LoRA / quantized: float weights; a batch of adapters: one group per adapter.
            return _kit.run_layer(block, params, x, state, extras, call, who=self.who)

        return apply

    def _init_then_apply(self, p: int) -> Callable:
        def init_then_apply(_, x, extras, call):
            transformed = self.transformed[p]
            with _kit.at_layer(extras["index"]):
                params, initial = transformed.init(extras["init_key"], x, call)
                out, state = transformed.apply(params, initial, extras["rng"], x, call)
            x, aux = out if self.has_aux else (out, None)
            return x, (aux, params, initial, state)

        return init_then_apply

    def initialize(self, x, extras, call) -> tuple[Any, dict, dict, dict]:
        """``(out, params, initial_state, state)``, the layers run one by one."""
        x, per_position = self.initializer.apply(None, x, extras, call)
        if not self.pattern:
            per_position = (per_position,)
        aux, params, initial, state = zip(*per_position)
        out = (x, aux if self.pattern else aux[0]) if self.has_aux else x
        return out, _merge(params), _merge(initial), _merge(state)

    def apply(self, params, state, x, extras, call, module_name) -> tuple[Any, dict]:
        """``(out, new_state)``: the scanned layers on the lifted params and state; served
        ones (:func:`stackwise.haiku.to_serving`) run as a loop of the layers."""
        params, state = self._positions(params), self._positions(state)
        if _kit.serving.served((params, state)):
            return self._serve(params, state, x, extras, call, module_name)
        fix = (
            "Stacked params and state come from this model's `init`; convert those of a "
            "Python loop of blocks with `stackwise.haiku.from_loop`, of `hk.layer_stack` "
            "with `stackwise.haiku.from_layer_stack`, and take the first k layers with "
            "`stackwise.slice_layers`."
        )
        for what, positions in (("params", params), ("state", state)):
            for p, tree in enumerate(positions):
                leaves = [  # (a LoRA or quantized node's own arrays, named inside it)
                    (f"{module_name}/{module}/{name}{jax.tree_util.keystr(path)}", leaf)
                    for module, bundle in tree.items()
                    for name, value in bundle.items()
                    for path, leaf in jax.tree_util.tree_leaves_with_path(value)
                ]
                _kit.check_depth(leaves, self.counts[p], self.who, what, fix)
        _kit.warn_unrematted(params, self.remat, self.who)
        if not self.pattern:
            params, state = params[0], state[0]
        out, state = self.forward.apply(params, state, x, extras, call)
        return out, _merge(state) if self.pattern else state

    def _serve(self, params, state, x, extras, call, module_name) -> tuple[Any, dict]:
        """``(out, new_state)`` of the core's serving loop over the per-layer buffers; the
        new state leaf-wise served again."""
        _kit.refuse_unservable(
            self.fsdp, self.nested, self.who,
            ". Build the Stack you serve with without `{option}` (the same params and "
            "state fit it), or run the stacked ones (`stackwise.haiku.from_serving`).",
        )  # fmt: skip
        params, state = (
            _serving.gather(trees, self.n, self.pattern, module_name, self.who, what)
            for trees, what in ((params, "params"), (state, "state"))
        )
        out, state = self.forward.apply(params, state, x, extras, call)
        return out, _merge(_kit.serving.scatter(state, len(self.blocks)))

    def _positions(self, tree: dict) -> tuple[dict, ...]:
        """A lifted params/state dict split into one dict per pattern position."""
        if not self.pattern:
            return (tree,)
        if self.names is None:  # the modules' names, as built in a fresh transform
            build = hk.transform(lambda: [make().module_name for make in self.blocks])
            self.names = build.apply({}, None)
        return tuple(
            {k: v for k, v in tree.items() if k.split("/")[0] == name} for name in self.names
        )


def _merge(trees: tuple[dict, ...]) -> dict:
    """One Haiku dict from the positions' dicts (their module names differ)."""
    merged: dict = {}
    for tree in trees:
        merged.update(tree)
    return merged


def _as_module(fn: Callable) -> Callable[[], hk.Module]:
    """A function block as a module factory: a module named after the function."""
    name = getattr(fn, "__name__", "block").strip("<>").replace("lambda", "block")

    def make() -> hk.Module:
        return hk.to_module(fn)(name=name)

    return make
