"""Two models, leaf by leaf, in the order the framework creates their variables.

What every adapter's ``convert`` shares (framework-free: jax and numpy only).
Each adapter records, for each model, its variables as :class:`Leaf` s in
creation order (its ``_correspond.py``); :func:`correspond` pairs the two
models' leaves one to one, a stack's leaves layer by layer, and
:func:`assemble` builds the target's values from the source's, exactly;
before that, :func:`check_given` checks that the values given are the
source model's.

Like every conversion (:mod:`stackwise._core.convert`), it moves every leaf
exactly or raises a ValueError naming where the two models differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from stackwise._core import trees
from stackwise._core.convert import array_text, dtype_name, dtype_of, pattern_depths, stack_arrays

__all__ = ["Leaf", "assemble", "check_given", "correspond"]


class Leaf(NamedTuple):
    """One variable of a model, as a conversion between two models sees it.

    Attributes:
      name: the framework's name of the leaf, for messages and results.
      owner: the class of the module that created it ("" if none): checked
        equal between the two models.
      key: the leaf's own name in its module (``w``, ``kernel``): checked equal.
      shape: one layer's shape.
      dtype: the dtype.
      depth: 0 for a leaf outside any stack; n for a leaf stacked over n layers.
      group: the stack it belongs to (one value per stack), None outside one.
      extra: anything else the two models' leaves must agree on, checked equal
        when both have one (NNX: the leaf's name within its layer; linen: one
        layer's partitioning); None when there is nothing to check.
      scope: the classes of the modules around the leaf, outermost first and
        ``owner`` last: from the block down for a stacked leaf, from the
        model's root otherwise (``()``: unknown). Where a stacked leaf meets
        a loop's, the loop's layer must not be of another position's kind of
        block, so that a ``Global`` layer never fills a ``Local`` pattern
        position even when their variables look alike.
      position: for a leaf of a pattern of ``positions`` kinds of blocks, its
        position p (it holds layers p, p + k, ...); 0 otherwise.
      positions: the pattern's length k (1: no pattern).
    """

    name: str
    owner: str
    key: str
    shape: tuple
    dtype: Any
    depth: int = 0
    group: Any = None
    extra: Any = None
    scope: tuple = ()
    position: int = 0
    positions: int = 1


class _Slot(NamedTuple):
    leaf: int  # index into the model's leaves
    layer: int | None  # the slice of a stacked leaf
    index: int | None = None  # the layer it is (p + layer * k in a pattern), for messages


def _slots(leaves: Sequence[Leaf], who: str, side: str) -> list[_Slot]:
    """The leaves in loop order: a stack's leaves for layer 0, then layer 1, ...

    Within a stack the leaves are in the order its block creates them; with a
    pattern of k blocks, position by position (the adapters order them so), so
    walking slice j of every leaf with depth > j gives layers jk, ..., jk+k-1:
    the loop's order again.
    """
    out, i, done = [], 0, set()
    while i < len(leaves):
        leaf = leaves[i]
        if not leaf.depth:
            out.append(_Slot(i, None))
            i += 1
            continue
        j = i
        while j < len(leaves) and leaves[j].depth and leaves[j].group == leaf.group:
            j += 1
        if leaf.group in done:
            raise ValueError(
                f"{who}: the {side} model's stack {leaf.group!r} creates its variables in "
                f"two separate runs (at {leaf.name}); a stack's variables are created "
                "together, so this model cannot be matched leaf by leaf. A Stack nested "
                "in another Stack's block does this: convert nested stacks by name with "
                "`from_loop` / `to_loop`."
            )
        done.add(leaf.group)
        run = range(i, j)
        k = leaf.positions
        counts: dict[int, set] = {}
        for r in run:
            counts.setdefault(leaves[r].position, set()).add(leaves[r].depth)
        order = [leaves[r].position for r in run]
        bad = any(len(d) > 1 for d in counts.values()) or order != sorted(order)
        if not bad and k > 1:
            try:
                pattern_depths({p: min(d) for p, d in counts.items()}, k, who)
            except ValueError:
                bad = True
        if bad:
            depths = {p: sorted(d) for p, d in counts.items()}
            held = ", ".join(f"{leaves[r].name}: {leaves[r].depth}" for r in run[:6])
            raise ValueError(
                f"{who}: the {side} model's stack {leaf.group!r} holds leaves of depths "
                f"{depths} (by pattern position) in an order no loop or pattern gives "
                f"(layers per leaf: {held}). Every leaf of a stack holds all its layers "
                "(a pattern's position p: layers p, p + k, ...): build the stack anew "
                "(an NNX Stack from its blocks: `Stack.from_layers(blocks)`)."
            )
        for layer in range(max(leaves[r].depth for r in run)):
            out.extend(
                _Slot(r, layer, leaves[r].position + layer * k)
                for r in run
                if leaves[r].depth > layer
            )
        i = j
    return out


def _slot_text(leaves: Sequence[Leaf], slot: _Slot) -> str:
    leaf = leaves[slot.leaf]
    where = f" (layer {slot.index})" if slot.layer is not None else ""
    owner = f"{leaf.owner} " if leaf.owner else ""
    extra = f" {leaf.extra}" if leaf.extra is not None else ""
    scope = f" in {'/'.join(leaf.scope)}" if leaf.scope else ""
    return (
        f"{leaf.name}{where}: {owner}{leaf.key!r} {dtype_name(leaf.dtype)}{list(leaf.shape)}"
        f"{extra}{scope}"
    )


def _kinds(leaves: Sequence[Leaf]) -> dict[tuple, set]:
    """``(stack, position) -> {its block's class}``: the outermost class of each
    scope in a pattern's position (the position's block)."""
    kinds: dict[tuple, set] = {}
    for leaf in leaves:
        if leaf.depth and leaf.positions > 1 and leaf.scope:
            kinds.setdefault((leaf.group, leaf.position), set()).add(leaf.scope[0])
    return kinds


def _same_kind(stacked: Leaf, other: Leaf, kinds: dict[tuple, set]) -> bool:
    """A pattern position's leaf meets a leaf of its own kind of block.

    The other leaf is refused if its scope holds the block of another position
    of the pattern (``Global`` where position p is ``Local``) and not p's own;
    a scope with neither (a loop body written inline, without a block
    module) says nothing of the kind, and passes.
    """
    if not stacked.depth or stacked.positions < 2 or not other.scope:
        return True
    own = kinds.get((stacked.group, stacked.position), set())
    others = set().union(
        *(v for (g, p), v in kinds.items() if g == stacked.group and p != stacked.position)
    )
    scope = set(other.scope)
    return bool(scope & own) or not scope & (others - own)


def correspond(
    source: Sequence[Leaf], target: Sequence[Leaf], who: str, hint: str = ""
) -> list[list[_Slot]]:
    """For each target leaf, the source slots its layers come from (one per layer).

    The two models' leaves are walked in loop order (:func:`_slots`); the
    k-th leaf the target creates takes the k-th leaf the source creates. They
    must correspond one to one: as many leaves, each pair of one module class,
    leaf name, shape and dtype (and ``extra``, where both have one), and
    where a pattern position's leaf is paired, of its kind of block
    (:func:`_same_kind`).

    Raises:
      ValueError: the models differ; the message shows where, with the
        leaves around the first difference.
    """
    src, tgt = _slots(source, who, "source"), _slots(target, who, "target")
    src_kinds, tgt_kinds = _kinds(source), _kinds(target)

    def same(a: _Slot, b: _Slot) -> bool:
        s, t = source[a.leaf], target[b.leaf]
        extra = s.extra is None or t.extra is None or s.extra == t.extra
        return (
            s.owner == t.owner
            and s.key == t.key
            and tuple(s.shape) == tuple(t.shape)
            and s.dtype == t.dtype
            and extra
            and _same_kind(s, t, src_kinds)
            and _same_kind(t, s, tgt_kinds)
        )

    first_bad = next((i for i, (a, b) in enumerate(zip(src, tgt)) if not same(a, b)), None)
    if first_bad is not None or len(src) != len(tgt):
        at = first_bad if first_bad is not None else min(len(src), len(tgt))
        lo = max(0, at - 2)
        lines = []
        for i in range(lo, min(at + 3, max(len(src), len(tgt)))):
            mark = ">>" if i == at else "  "
            s = _slot_text(source, src[i]) if i < len(src) else "(none)"
            t = _slot_text(target, tgt[i]) if i < len(tgt) else "(none)"
            lines.append(f"{mark} #{i}\n     source: {s}\n     target: {t}")
        raise ValueError(
            f"{who}: the two models do not correspond one to one: the source has "
            f"{len(src)} per-layer leaves and the target {len(tgt)}, taken in the order "
            f"each creates them (a stack's layer by layer); they first differ at #{at} "
            "(module class, leaf name, shape and dtype must agree, and the classes of "
            "the blocks around them):\n"
            + "\n".join(lines)
            + "\nBoth models must create the same modules in the same order: the loop's "
            "body and the stacked block the same code." + (f" {hint}" if hint else "")
        )
    by_target: list[list[_Slot]] = [[] for _ in target]
    for a, b in zip(src, tgt):
        by_target[b.leaf].append(a)
    return by_target


def assemble(
    target: Sequence[Leaf], sources: list[list[_Slot]], values: Sequence[Any]
) -> list[Any]:
    """The target's leaf values from the source's (``values[i]`` is source leaf i's array).

    A stacked target leaf stacks its layers' values; an unstacked one takes
    its single value; a stacked source leaf gives slice ``[layer]``. Exact.
    """
    out = []
    for leaf, slots in zip(target, sources):
        column = [
            values[s.leaf] if s.layer is None else trees.take(values[s.leaf], s.layer)
            for s in slots
        ]
        out.append(stack_arrays(column) if leaf.depth else column[0])
    return out


def check_given(
    want: Mapping[str, Any],
    have: Mapping[str, Any],
    who: str,
    what: str,
    dtype: Callable[[Any], Any] = dtype_of,
) -> None:
    """Raises unless ``have`` holds exactly the leaves of ``want``, of their shapes and dtypes.

    Args:
      want: the model's leaves, name -> anything with ``shape`` and ``dtype``
        (e.g. a :class:`jax.ShapeDtypeStruct`).
      have: the values given, name -> array; listed in its order.
      who: the public function, for messages.
      what: what the values are not, e.g. ``the state given is not the
        source model's``.
      dtype: the dtype a given value is checked by: its own
        (:func:`stackwise._core.convert.dtype_of`, the default) or, as Haiku and
        linen check it, ``jnp.result_type`` (a NumPy float64 then checks as
        float32 when jax runs without x64).

    Raises:
      ValueError: listing (up to 20) missing leaves, leaves not in the
        model, and leaves of another shape or dtype.
    """
    bad = [f"  missing: {name}" for name in want if name not in have]
    bad += [f"  not in the model: {name}" for name in have if name not in want]
    bad += [
        f"  {name}: {array_text(have[name])}, the model has {array_text(want[name])}"
        for name in want
        if name in have
        and (
            tuple(jnp.shape(have[name])) != tuple(want[name].shape)
            or dtype(have[name]) != want[name].dtype
        )
    ]
    if bad:
        raise ValueError(f"{who}: {what}:\n" + "\n".join(bad[:20]))
