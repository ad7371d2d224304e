"""A :class:`~stackwise.equinox.Stack` in the serving layout: each layer its own block.

``Stack.to_serving()`` gives the same Stack with ``layers`` a ``stackwise.Serving`` of the n
per-layer blocks (:meth:`Stack.to_layers`' blocks, in layer order), and the Stack passes
their arrays to the core's serving path (``Stacked.apply`` over a ``stackwise.Serving``): a
Python loop over separate per-layer buffers, with a ``with_state=True`` cache converted
by ``stackwise.to_serving`` and written in place in each layer's buffer when donated.
``Stack.from_serving()`` stacks the blocks back, exactly.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx

import stackwise
from stackwise.equinox import _convert, _state

__all__ = ["from_serving", "positions", "served", "to_serving", "unpack"]


def served(layers: Any) -> bool:
    """Whether a Stack's ``layers`` are in the serving layout."""
    return isinstance(layers, stackwise.Serving)


def positions(layers: stackwise.Serving) -> tuple[tuple, bool]:
    """``(blocks, is_pattern)`` as ``Stack._blocks`` gives them: one block per position."""
    k = layers.pattern or 1
    return tuple(layers.layers[:k]), layers.pattern is not None


def _refuse_state(layers: Any, who: str) -> None:
    if _state.holds_state_index(layers):
        raise TypeError(
            f"{who}: its blocks keep state in an eqx.nn.State (they hold eqx.nn.StateIndex "
            "es), which the serving layout does not take. Hold the cache as an explicit "
            "per-layer state (`Stack(..., with_state=True)`, converted with "
            "`stackwise.to_serving(cache)`), or run the blocks as a loop: "
            "`blocks, states = stack.to_layers(state)`."
        )


def to_serving(stack: Any, who: str) -> Any:
    """``stack`` with its layers as a ``stackwise.Serving`` of its per-layer blocks."""
    if served(stack.layers):
        raise TypeError(
            f"{who}: the Stack is already in the serving layout (its `layers` are a "
            "`stackwise.Serving`); convert once. `stack.from_serving()` stacks it back."
        )
    for option in ("fsdp", "nested"):
        if getattr(stack, option):
            raise ValueError(
                f"{who}: the Stack was built with `{option}={getattr(stack, option)!r}`, "
                "which runs stacked layers only; the serving layout runs each layer's "
                f"whole params in a Python loop. Build the Stack without `{option}` (e.g. "
                f"`Stack.from_layers(stack.to_layers(), ...)` with the other options) first."
            )
    _refuse_state(stack.layers, who)
    k = len(stack.layers) if isinstance(stack.layers, tuple) else None
    layers = stackwise.Serving(stack.to_layers(), pattern=k)
    return eqx.tree_at(lambda s: s.layers, stack, layers)


def from_serving(stack: Any, who: str) -> Any:
    """``stack`` with its served blocks stacked back (position p of a pattern: layers p,
    p + k, ...), bit for bit."""
    if not served(stack.layers):
        raise TypeError(
            f"{who}: the Stack is not in the serving layout (its `layers` are stacked); "
            "`stack.to_serving()` gives the serving one."
        )
    blocks, k = list(stack.layers.layers), stack.layers.pattern or 1
    _check_count(blocks, stack.n, who)
    stacked = [
        _convert.stack_blocks(blocks[p::k], who, range(p, len(blocks), k)) for p in range(k)
    ]
    return eqx.tree_at(
        lambda s: s.layers, stack, tuple(stacked) if stack.layers.pattern else stacked[0]
    )


def _check_count(blocks: list, n: int, who: str) -> None:
    if len(blocks) != n:
        raise ValueError(
            f"{who}: the serving layout holds {len(blocks)} blocks, but the Stack has n={n}; "
            "convert this Stack's own layers (`stack.to_serving()`)."
        )


def unpack(layers: stackwise.Serving, n: int, who: str) -> tuple[stackwise.Serving, list]:
    """``(params, statics)``: the served blocks' arrays as a ``stackwise.Serving`` for
    ``Stacked.apply``, and each pattern position's shared rest. Every layer must agree with
    its position's first block in everything but array values (the core runs position p's
    rest for all of them)."""
    blocks, k = list(layers.layers), layers.pattern or 1
    _check_count(blocks, n, who)
    _refuse_state(layers, who)
    for i in range(k, len(blocks)):
        a, b = blocks[i % k], blocks[i]
        found = _convert.first_difference(a, b, arrays=False) or _convert.first_difference(a, b)
        if found is not None:
            at, how = found
            raise TypeError(
                f"{who}: served layer {i} ({type(blocks[i]).__name__}) differs from layer "
                f"{i % k} at `{at}`: {how}. Layers of the serving layout keep their "
                "position's static fields and array shapes; replace array values only "
                "(e.g. `eqx.tree_at`), or convert the Stack again (`stack.to_serving()`)."
            )
    parts = [eqx.partition(b, _convert.is_array) for b in blocks]
    params = stackwise.Serving([a for a, _ in parts], layers.pattern)
    return params, [s for _, s in parts[:k]]

