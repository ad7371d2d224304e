"""A :class:`~stackwise.equinox.Stack` in the serving layout: each layer its own block.

:func:`to_serving` gives a new model whose Stack (at ``path``) has ``layers`` a
``stackwise.Serving`` of the n per-layer blocks (:meth:`Stack.to_layers`' blocks, in layer
order), and the Stack passes
their arrays to the core's serving path (``Stacked.apply`` over a ``stackwise.Serving``): a
Python loop over separate per-layer buffers, with a ``with_state=True`` cache converted
by ``stackwise.to_serving`` and written in place in each layer's buffer when donated.
An ``eqx.nn.State`` converts with the Stack: each of its entries becomes a
``stackwise.Serving`` of per-layer values, and each layer's block gets an ``eqx.nn.State``
of its own buffers. :func:`from_serving` stacks the blocks (and State) back, exactly.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

import stackwise
from stackwise import _kit
from stackwise.equinox import _convert, _state

__all__ = [
    "from_serving",
    "layer_states",
    "positions",
    "served",
    "stacked_blocks",
    "to_serving",
    "unpack",
    "updated",
]


def served(layers: Any) -> bool:
    """Whether a Stack's ``layers`` are in the serving layout."""
    return isinstance(layers, stackwise.Serving)


def positions(layers: stackwise.Serving) -> tuple[tuple, bool]:
    """``(blocks, is_pattern)`` as ``Stack._blocks`` gives them: one block per position."""
    k = layers.pattern or 1
    return tuple(layers.layers[:k]), layers.pattern is not None


def stacked_blocks(stack: Any, who: str) -> tuple:
    """The stacked block of each position, for a method that takes the stacked State."""
    if served(stack.layers):
        raise TypeError(
            f"{who}: the Stack is in the serving layout, and its State too; its blocks are "
            "`stack[i]`, and `stack, state = stackwise.equinox.from_serving(stack, "
            "state=state)` gives the stacked ones, which `to_layers(state)` splits."
        )
    return stack._blocks()[0]


def to_serving(module: Any, path: Any = None, *, state: eqx.nn.State | None = None) -> Any:
    """A model with a :class:`Stack` in the serving layout: a new model, converted once.

    The Stack's ``layers`` become a ``stackwise.Serving`` of its n per-layer blocks (the
    blocks of ``Stack.to_layers()``, in layer order), which the Stack runs as a Python loop
    over their own buffers (the core's :func:`stackwise.to_serving` path): no layer slices
    a stacked weight, and its outputs equal the loop of those blocks bit for bit. A
    ``with_state=True`` cache goes in the core's layout (``stackwise.to_serving(cache)``,
    ``pattern=k`` for a pattern); an ``eqx.nn.State`` (blocks holding
    ``eqx.nn.StateIndex`` es) converts with the Stack, ``state=``, each of the Stack's
    entries a ``stackwise.Serving`` of per-layer values. Caches are written in place when
    donated. The given model is not changed (Equinox modules are immutable): the result is
    ``eqx.tree_at`` of it, the rest of the model shared.

    >>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
    >>> from functools import partial
    >>> stack = stackwise.equinox.Stack(
    ...     partial(eqx.nn.Linear, 4, 4), n=3, key=jax.random.key(0))
    >>> served = stackwise.equinox.to_serving(stack)
    >>> served.layers
    Serving(3 layers)
    >>> bool(jnp.allclose(served(jnp.ones(4)), stack(jnp.ones(4)), atol=1e-6))
    True
    >>> model = [eqx.nn.Linear(4, 4, key=jax.random.key(1)), stack]   # a Stack inside
    >>> served_model = stackwise.equinox.to_serving(model, "1")
    >>> served_model[1].layers, stackwise.equinox.from_serving(served_model, "1")[1].n
    (Serving(3 layers), 3)

    Patterns, ``reverse``, per-layer inputs and keys, and stacked QLoRA weights (each
    served block keeps its own codes, nf4 still packed) work as stacked. A Stack built with
    ``fsdp`` or ``nested`` refuses the layout.

    Args:
      module: a :class:`Stack`, or a model (any pytree) holding one.
      path: None (``module`` is the Stack), or the Stack's place in ``module``: attribute
        names, list indices and dict keys joined by ``.`` or ``/`` (``"decoder.blocks"``),
        or as a tuple.
      state: the ``eqx.nn.State`` holding the Stack's entries, for blocks with
        ``eqx.nn.StateIndex`` es (and only for them).

    Returns:
      The new model; with ``state``, ``(model, state)``, the new State's entries of the
      Stack each a ``stackwise.Serving``.

    Raises:
      TypeError: the Stack already in the serving layout, ``module`` not a Stack and no
        ``path``, a ``path`` naming no place, or a ``state`` missing or given where the
        blocks hold no ``eqx.nn.StateIndex``.
      ValueError: no Stack at ``path`` (the model's Stacks listed), or a Stack built with
        ``fsdp`` or ``nested``.
    """
    return _convert_at(module, path, state, "stackwise.equinox.to_serving", _to_serving)


def from_serving(module: Any, path: Any = None, *, state: eqx.nn.State | None = None) -> Any:
    """The inverse of :func:`to_serving`: a new model with the Stack stacked, bit for bit.

    >>> import jax, jax.numpy as jnp, equinox as eqx, stackwise.equinox
    >>> from functools import partial
    >>> stack = stackwise.equinox.Stack(
    ...     partial(eqx.nn.Linear, 2, 2), n=3, key=jax.random.key(0))
    >>> back = stackwise.equinox.from_serving(stackwise.equinox.to_serving(stack))
    >>> bool(jnp.array_equal(back.layers.weight, stack.layers.weight))
    True

    Args:
      module: a served :class:`Stack`, or a model holding one.
      path: as for :func:`to_serving`.
      state: the served ``eqx.nn.State`` (from :func:`to_serving` or the served calls),
        for blocks with ``eqx.nn.StateIndex`` es.

    Returns:
      The new model; with ``state``, ``(model, state)`` stacked too.

    Raises:
      TypeError: the Stack not in the serving layout, a State entry of the Stack's not
        served, or a bad ``module``, ``path`` or ``state``.
      ValueError: a served Stack of another depth, a State without the Stack's entries,
        or no Stack at ``path``.
    """
    return _convert_at(module, path, state, "stackwise.equinox.from_serving", _from_serving)


def _convert_at(module: Any, path: Any, state: Any, who: str, convert: Any) -> Any:
    """``convert(stack, state, who)`` applied to the Stack at ``path`` in ``module``,
    which ``eqx.tree_at`` puts back: the new model, or ``(model, state)``."""
    from stackwise.equinox._stack import Stack  # (the Stack's module imports this one)

    found, _ = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: isinstance(x, Stack))
    paths = {tuple(_key(k) for k in at): at for at, x in found if isinstance(x, Stack)}
    stacks = [(keys, _node(module, at)) for keys, at in paths.items()]
    keys, stack = _kit.serving.stack_at(module, path, stacks, Stack, who)
    out = convert(stack, state, f"{who}: {stack._who()}")
    new, state = out if state is not None else (out, None)
    if keys:
        new = eqx.tree_at(lambda m: _node(m, paths[keys]), module, new)
    return new if state is None else (new, state)


def _key(k: Any) -> Any:
    """One entry of a pytree path: an attribute's name, a dict key or a sequence index."""
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _node(tree: Any, at: tuple) -> Any:
    """The node at the pytree path ``at`` (jax's keys) in ``tree``."""
    for k in at:
        tree = getattr(tree, k.name) if hasattr(k, "name") else tree[_key(k)]
    return tree


def _to_serving(stack: Any, state: Any, who: str) -> Any:
    """``stack`` with its layers as a ``stackwise.Serving`` of its per-layer blocks; with an
    ``eqx.nn.State``, ``(stack, state)``, the stack's entries each a ``stackwise.Serving``."""
    if served(stack.layers):
        raise TypeError(
            f"{who}: the Stack is already in the serving layout (its `layers` are a "
            "`stackwise.Serving`); convert once. `stackwise.equinox.from_serving(module, "
            "path)` stacks it back."
        )
    _kit.refuse_unservable(
        stack.fsdp, stack.nested, who,
        ". Build the Stack without `{option}` (e.g. `Stack.from_layers(stack.to_layers(), "
        "...)` with the other options) first.",
    )
    blocks, k = stack._blocks()[0], len(stack.layers) if isinstance(stack.layers, tuple) else None
    _check_state_given(blocks, state, who, "to_serving")
    layers = stackwise.Serving(stack.to_layers(), pattern=k)
    new = eqx.tree_at(lambda s: s.layers, stack, layers)
    if state is None:
        return new
    counts = [len(range(p, stack.n, len(blocks))) for p in range(len(blocks))]
    for block, count in zip(blocks, counts):
        if not _state.holds_state_index(block):
            continue
        sub = _state.layer_states(state, (block,), False, [count], True, who)[0]
        entries = _entries(sub)
        state = state.update(_state_of({m: stackwise.to_serving(v) for m, v in entries.items()}))
    return new, state


def _check_state_given(blocks: tuple, state: Any, who: str, method: str) -> None:
    holds = any(_state.holds_state_index(b) for b in blocks)
    if holds and not isinstance(state, eqx.nn.State):
        raise TypeError(
            f"{who}: its blocks keep state in an eqx.nn.State (they hold eqx.nn.StateIndex "
            f"es), so convert it with them: `stack, state = stackwise.equinox.{method}("
            f"stack, state=state)`, got "
            f"{type(state).__name__} for `state`."
        )
    if state is not None and not holds:
        raise TypeError(
            f"{who}: got a `state`, but no block holds an eqx.nn.StateIndex; convert the "
            "Stack alone (a `with_state=True` cache: `stackwise.to_serving(cache)`)."
        )


def _entries(state: eqx.nn.State) -> dict:
    values, markers = state.tree_flatten()
    return dict(zip(markers, values))


def _state_of(entries: dict) -> eqx.nn.State:
    return eqx.nn.State.tree_unflatten(tuple(entries), tuple(entries.values()))


def _from_serving(stack: Any, state: Any, who: str) -> Any:
    """``stack`` with its served blocks stacked back (position p of a pattern: layers p,
    p + k, ...), bit for bit; with an ``eqx.nn.State``, ``(stack, state)`` stacked too."""
    if not served(stack.layers):
        raise TypeError(
            f"{who}: the Stack is not in the serving layout (its `layers` are stacked); "
            "`stackwise.equinox.to_serving(module, path)` gives the serving one."
        )
    blocks, k = list(stack.layers.layers), stack.layers.pattern or 1
    _check_count(blocks, stack.n, who)
    _check_state_given(tuple(blocks[:k]), state, who, "from_serving")
    stacked = [_convert.stack_blocks(blocks[p::k], who, range(p, len(blocks), k)) for p in range(k)]
    new = eqx.tree_at(
        lambda s: s.layers, stack, tuple(stacked) if stack.layers.pattern else stacked[0]
    )
    if state is None:
        return new
    for block in blocks[:k]:
        entries = _entries(_substate(state, block, who))
        for m, v in entries.items():
            if not isinstance(v, stackwise.Serving):
                raise TypeError(
                    f"{who}: the state's entry {m!r} is stacked, not served; pass the State "
                    "that `stack, state = stackwise.equinox.to_serving(stack, state=state)` "
                    "(or the served calls) gave."
                )
        state = state.update(_state_of({m: stackwise.from_serving(v) for m, v in entries.items()}))
    return new, state


def _substate(state: eqx.nn.State, block: Any, who: str) -> eqx.nn.State:
    try:
        return state.substate(block)
    except KeyError:
        raise ValueError(
            f"{who}: the given eqx.nn.State holds no values for the Stack's eqx.nn.StateIndex "
            "es; pass the State converted with it (`stack, state = "
            "stackwise.equinox.to_serving(stack, state=state)`)."
        ) from None


def layer_states(state: Any, layers: stackwise.Serving, stateful: bool, who: str) -> tuple:
    """``(states, takes_state)`` of a served call: a ``stackwise.Serving`` of per-layer
    ``eqx.nn.State`` s (None for a position without StateIndexes) when ``state`` is one,
    else ``state`` as given (a served ``with_state=True`` pytree, or None)."""
    blocks, k, n = layers.layers, layers.pattern or 1, len(layers.layers)
    holds = [_state.holds_state_index(b) for b in blocks[:k]]
    if isinstance(state, eqx.nn.State) != any(holds):
        raise TypeError(
            f"{who}: a served Stack whose blocks hold eqx.nn.StateIndex es takes the "
            "eqx.nn.State converted with it (`stack, state = "
            "stackwise.equinox.to_serving(stack, state=state)`), and "
            "only such a Stack takes an eqx.nn.State (a `with_state=True` cache: "
            f"`stackwise.to_serving(cache)`); got {type(state).__name__}."
        )
    if not isinstance(state, eqx.nn.State):
        return state, [stateful] * k
    entries = [_entries(_substate(state, b, who)) if h else {} for b, h in zip(blocks, holds)]
    for p in range(k):
        for m, v in entries[p].items():
            if not (isinstance(v, stackwise.Serving) and len(v) == len(range(p, n, k))):
                raise TypeError(
                    f"{who}: the Stack is served but the state's entry {m!r} is not its "
                    "serving layout; convert both at once: `stack, state = "
                    "stackwise.equinox.to_serving(stack, state=state)` (from the stacked "
                    "Stack and State)."
                )
    per_layer = [
        _state_of({m: v.layers[i // k] for m, v in entries[i % k].items()})
        if holds[i % k]
        else None
        for i in range(n)
    ]
    return stackwise.Serving(per_layer, layers.pattern), holds


def updated(state: Any, new: Any, layers: stackwise.Serving) -> Any:
    """The call's ``state`` with the served layers' new states: an ``eqx.nn.State``'s
    entries each a ``stackwise.Serving`` again (the given State made stale), else ``new``."""
    if not isinstance(state, eqx.nn.State):
        return new
    k, n = layers.pattern or 1, len(layers.layers)
    for p in range(k):
        if new.layers[p] is None:
            continue
        per_layer = [_entries(new.layers[i]) for i in range(p, n, k)]
        entries = {m: stackwise.Serving([e[m] for e in per_layer]) for m in per_layer[0]}
        state = state.update(_state_of(entries))
    return state


def _check_count(blocks: list, n: int, who: str) -> None:
    if len(blocks) != n:
        raise ValueError(
            f"{who}: the serving layout holds {len(blocks)} blocks, but the Stack has n={n}; "
            "convert this Stack's own layers (`stackwise.equinox.to_serving(stack)`)."
        )


def unpack(layers: stackwise.Serving, n: int, who: str) -> tuple[stackwise.Serving, list]:
    """``(params, statics)``: the served blocks' arrays as a ``stackwise.Serving`` for
    ``Stacked.apply``, and each pattern position's shared rest. Every layer must agree with
    its position's first block in everything but array values (the core runs position p's
    rest for all of them)."""
    blocks, k = list(layers.layers), layers.pattern or 1
    _check_count(blocks, n, who)
    for i in range(k, len(blocks)):
        a, b = blocks[i % k], blocks[i]
        found = _convert.first_difference(a, b, arrays=False) or _convert.first_difference(a, b)
        if found is not None:
            at, how = found
            raise TypeError(
                f"{who}: served layer {i} ({type(blocks[i]).__name__}) differs from layer "
                f"{i % k} at `{at}`: {how}. Layers of the serving layout keep their "
                "position's static fields and array shapes; replace array values only "
                "(e.g. `eqx.tree_at`), or convert the Stack again "
                "(`stackwise.equinox.to_serving(stack)`)."
            )
    parts = [eqx.partition(b, _convert.is_array) for b in blocks]
    params = stackwise.Serving([a for a, _ in parts], layers.pattern)
    return params, [s for _, s in parts[:k]]
