"""``eqx.nn.State`` in a :class:`~stackwise.equinox.Stack`: each layer's entries, stacked.

A block holding ``eqx.nn.StateIndex`` es (``eqx.nn.BatchNorm``, a KV cache) keeps their
values in the model's ``eqx.nn.State``. In a Stack, each index of the stacked block has one
entry whose value has a leading layer axis: the core slices it per layer like any stacked
state, block i sees an ``eqx.nn.State`` of its own slices, and the updated entries go back
into the model's State. :meth:`Stack.to_layers` and :meth:`Stack.from_layers` move a State
between that layout and one State per block.

Indices are matched by their position in the tree, not by marker: separately built blocks
carry different markers (``eqx.nn.make_with_state`` renames them after their path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from stackwise import _kit

__all__ = [
    "check_returned",
    "check_states",
    "distinct_markers",
    "holds_state_index",
    "layer_states",
    "marked",
    "stack_states",
    "state_indices",
    "take",
    "unmarked",
    "unstack",
    "updated",
]

_is_index = lambda x: isinstance(x, eqx.nn.StateIndex)  # noqa: E731


# --------------------------------------------------------------------------
# State indices and their markers.


def state_indices(tree: Any) -> list[eqx.nn.StateIndex]:
    """The ``eqx.nn.StateIndex`` es in ``tree``, in leaf order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_index) if _is_index(x)]


def holds_state_index(tree: Any) -> bool:
    return bool(state_indices(tree))


def marked(tree: Any, markers: Sequence[Any]) -> Any:
    """``tree`` with its StateIndexes' markers replaced, in leaf order (as
    ``eqx.nn.make_with_state`` replaces them)."""
    markers = iter(markers)

    def remark(x):
        if not _is_index(x):
            return x
        new = eqx.nn.StateIndex(x.init)
        object.__setattr__(new, "marker", next(markers))
        return new

    return jax.tree.map(remark, tree, is_leaf=_is_index)


def unmarked(tree: Any) -> Any:
    """``tree`` with every StateIndex marker the same, for comparing blocks."""
    return marked(tree, ["<marker>"] * len(state_indices(tree)))


def distinct_markers(stacked: Sequence[Any]) -> list[Any]:
    """The stacked blocks of a pattern, their StateIndex markers made distinct across
    positions (blocks built alike, e.g. by ``make_with_state(Block)``, share markers)."""
    seen: set = set()
    out = []
    for p, block in enumerate(stacked):
        markers = []
        for x in state_indices(block):
            m = x.marker
            if isinstance(m, str) and m in seen:
                m = f"layers[{p}]:{m}"
            seen.add(m)
            markers.append(m)
        out.append(marked(block, markers))
    return out


# --------------------------------------------------------------------------
# Calling a stateful Stack: `x, state = stack(x, state, *args, **kwargs)`.


def take(args: tuple, kwargs: dict, with_state: bool, who: str) -> tuple[Any, tuple, dict]:
    """``(state, args, kwargs)``: the state argument (``state=``, as ``eqx.nn.Sequential``
    passes it, or the first after ``x``) taken off the call's arguments."""
    if "state" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("state"), args, kwargs
    if args:
        return args[0], args[1:], kwargs
    which = (
        "the stacked per-layer state (`with_state=True`)"
        if with_state
        else "the model's eqx.nn.State (its blocks hold eqx.nn.StateIndex es; make it with "
        "`model, state = eqx.nn.make_with_state(Model)(...)`)"
    )
    raise TypeError(
        f"{who}: a stateful stack is called with {which} and returns it: "
        "`x, state = stack(x, state, ...)`."
    )


def layer_states(
    state: Any, blocks: tuple, pattern: bool, counts: list[int], stateful: bool, who: str
) -> tuple[Any, list[bool]]:
    """``(states, takes_state)``: what each position's layers get as state, as
    ``Stacked.apply`` takes it (a tuple of k for a pattern), and whether its blocks are
    called with it. ``state`` is the call's: an ``eqx.nn.State``, an explicit pytree
    (``with_state=True``), or None for a stack without state."""
    holds = [holds_state_index(b) for b in blocks]
    if not isinstance(state, eqx.nn.State):
        if any(holds):
            raise TypeError(
                f"{who}: its blocks hold eqx.nn.StateIndex es, so `state` must be the "
                f"model's eqx.nn.State (from `eqx.nn.make_with_state`), got "
                f"{type(state).__name__}."
            )
        return state, [stateful] * len(blocks)
    if not any(holds):
        raise TypeError(
            f"{who}: got an eqx.nn.State, but no block holds an eqx.nn.StateIndex: with "
            "`with_state=True` the state is the stacked per-layer pytree the blocks take "
            "(e.g. a KV cache `{'k': (n, ...)}`)."
        )
    subs = [
        _substate(state, b, count, p, pattern, who)
        for p, (b, count) in enumerate(zip(blocks, counts))
    ]
    return (tuple(subs) if pattern else subs[0]), holds


def _substate(state: eqx.nn.State, block: Any, count: int, p: int, pattern: bool, who: str) -> Any:
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
    _kit.check_depth(
        leaves,
        count,
        who,
        "state",
        "The State of a Stack comes from `eqx.nn.make_with_state` of a model holding it "
        "(or `Stack.from_layers(blocks, states)`).",
    )
    return sub


def check_returned(out: Any, who: str) -> None:
    """A block called with an ``eqx.nn.State`` returns ``(x, state)``."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State):
        return
    got = type(out[1] if isinstance(out, tuple) and len(out) == 2 else out).__name__
    raise TypeError(
        f"{who}: a block called with an eqx.nn.State returns `(x, state)` with the state "
        "it was given, updated (e.g. `x, state = self.norm(x, state)`), but it returned "
        f"{got} in its place."
    )


def updated(state: Any, new: Any, pattern: bool) -> Any:
    """The call's ``state`` with the layers' new ``state``: an ``eqx.nn.State`` updated
    (which, as in Equinox, makes the given one stale), else the new stacked pytree."""
    if not isinstance(state, eqx.nn.State):
        return new
    for sub in new if pattern else (new,):
        state = state.update(sub)
    return state


# --------------------------------------------------------------------------
# Conversions: one State per block <-> the Stack's entries.


def unstack(state: Any, stacked: Sequence[Any], n: int, who: str) -> list[eqx.nn.State]:
    """Layer i's entries, sliced, as an ``eqx.nn.State`` per layer (markers kept)."""
    if not isinstance(state, eqx.nn.State):
        raise TypeError(f"{who}: `state` must be an eqx.nn.State, got {type(state).__name__}.")
    k = len(stacked)
    per_position = []
    for p, block in enumerate(stacked):
        count = len(range(p, n, k))
        sub = _substate(state, block, count, p, k > 1, who)
        per_position.append([jax.tree.map(lambda a, j=j: a[j], sub) for j in range(count)])
    return [per_position[i % k][i // k] for i in range(n)]


def check_states(blocks: list, states: Sequence[Any] | None, who: str) -> list | None:
    """``Stack.from_layers``'s ``states`` as a list (one per block), or None when the blocks
    keep no values in an ``eqx.nn.State``."""
    if states is not None:
        states = list(states)
        if len(states) != len(blocks):
            raise ValueError(
                f"{who}: got {len(blocks)} blocks but {len(states)} states; give one "
                "eqx.nn.State per block."
            )
        return states
    for i, block in enumerate(blocks):
        # `make_with_state` leaves a sentinel (an empty module) where the values were.
        stripped = [x for x in state_indices(block) if isinstance(x.init, eqx.Module)]
        if any(not jax.tree.leaves(x.init) for x in stripped):
            raise ValueError(
                f"{who}: block {i} holds eqx.nn.StateIndex es whose values live in an "
                "eqx.nn.State (made by `eqx.nn.make_with_state`); pass them too: "
                "`stack, state = Stack.from_layers(blocks, states)`."
            )
    return None


def stack_states(blocks: list, states: list, stacked: Sequence[Any], who: str) -> eqx.nn.State:
    """One State holding every position's entries: block i's values, stacked per position
    (position p of the ``stacked`` blocks holds blocks p, p + k, ...)."""
    keys, values = [], []
    k = len(stacked)
    for p, block in enumerate(stacked):
        numbers = range(p, len(blocks), k)
        per_block = [_values(blocks[i], states[i], i, who) for i in numbers]
        keys += [x.marker for x in state_indices(block)]
        for entry in zip(*per_block):
            for i, value in zip(numbers, entry):
                for name, leaf in _kit.named_leaves(value):
                    _kit.exact_dtype(leaf, who, f"{name} of `states[{i}]`")
            values.append(jax.tree.map(lambda *a: jnp.stack(a), *entry))
    return eqx.nn.State.tree_unflatten(tuple(keys), tuple(values))


def _values(block: Any, state: Any, i: int, who: str) -> tuple:
    """Block i's entries in ``state``, in the order of its StateIndexes."""
    if not isinstance(state, eqx.nn.State):
        raise TypeError(
            f"{who}: `states[{i}]` must be the eqx.nn.State of block {i} (from "
            f"`eqx.nn.make_with_state`), got {type(state).__name__}."
        )
    try:
        return state.substate(block).tree_flatten()[0]
    except KeyError:
        raise ValueError(
            f"{who}: `states[{i}]` holds no values for the eqx.nn.StateIndex es of block {i}; "
            "give each block the State made with it, e.g. `eqx.nn.make_with_state(Block)(...)`."
        ) from None
