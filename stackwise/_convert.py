"""What every conversion shares: exact stacking, layer discovery, model correspondence.

Framework-free (jax and numpy only). The layout tools (:mod:`stackwise._layout`)
and each adapter's ``_convert.py`` build on these, so that every conversion
follows one rule and the same failure reads the same everywhere: a conversion
moves every leaf exactly (bitwise, dtype kept) or raises a ValueError/TypeError
that names the leaf, the layer and the fix. It never overwrites an entry,
never guesses a depth from a partial sequence, never leaves layers behind and
never promotes a dtype.

Three parts:

- exact stacking: :func:`stack_exact` / :func:`unstack_exact` (and a pattern's
  positions, :func:`pattern_counts` / :func:`pattern_depth` / :func:`pattern_depths`);
- finding a loop's layers by name: :func:`layer_names`, :func:`find_depth`,
  :func:`check_distinct`;
- matching two models leaf by leaf in the order the framework creates their
  variables: :class:`Leaf`, :func:`correspond`, :func:`assemble`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Leaf",
    "assemble",
    "check_distinct",
    "check_n",
    "check_pattern",
    "correspond",
    "find_depth",
    "layer_names",
    "pattern_counts",
    "pattern_depth",
    "pattern_depths",
    "stack_exact",
    "unstack_exact",
]

# --------------------------------------------------------------------------
# Exact stacking.


def _dtype(a: Any) -> Any:
    dtype = getattr(a, "dtype", None)
    return np.asarray(a).dtype if dtype is None else dtype


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(np.shape(a)) if not hasattr(a, "shape") else tuple(a.shape)


def _dtype_name(dtype: Any) -> str:
    return getattr(dtype, "name", None) or str(dtype)


def describe(a: Any) -> str:
    """``float32[4, 8]``: a leaf's dtype and shape, for messages."""
    return f"{_dtype_name(_dtype(a))}{list(_shape(a))}"


def _by_layer(values: Sequence[Any], label: Callable[[int], str]) -> str:
    """``layers 0, 2: float32; layer 1 ('block_1'): bfloat16``: layers grouped by value."""
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(str(v), []).append(i)
    parts = []
    for value, layers in groups.items():
        if len(layers) == 1:
            parts.append(f"{label(layers[0])}: {value}")
        else:
            parts.append(f"layers {', '.join(map(str, layers))}: {value}")
    return "; ".join(parts)


def stack_arrays(column: Sequence[Any]) -> Any:
    """Stacks arrays of one shape and dtype along a new axis 0, exactly.

    NumPy arrays stay NumPy (so a float64 or int64 checkpoint keeps its dtype);
    anything else goes through ``jnp.stack``, which for arrays of one dtype
    copies bits and never converts.
    """
    if all(isinstance(a, (np.ndarray, np.generic)) for a in column):
        return np.stack(column)
    if all(isinstance(a, (bool, int, float, complex)) for a in column):
        return np.stack([np.asarray(a) for a in column])
    return jnp.stack(column)


def _leaf_paths(tree: Any) -> list[str]:
    return [
        jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def stack_exact(
    layers: Sequence[Any],
    who: str,
    label: Callable[[int], str] | None = None,
    leaf_name: Callable[[str], str] = lambda path: path,
) -> Any:
    """Stacks per-layer trees along a new axis 0, bitwise, or raises naming layer and leaf.

    Args:
      layers: the per-layer trees, all of one structure.
      who: the public function, for messages.
      label: names layer i in messages (default ``layer i``).
      leaf_name: turns a ``keystr`` path into the framework's leaf name.

    Raises:
      ValueError: no layers, layers of different structure, or a leaf whose
        shape differs between layers (the layers are listed by shape).
      TypeError: a leaf whose dtype differs between layers: stacking would
        promote it (bfloat16 + float32 -> float32, int32 -> float32 loses
        integers above 2**24), so the layers are listed by dtype instead.
    """
    label = label or (lambda i: f"layer {i}")
    layers = list(layers)
    if not layers:
        raise ValueError(f"{who}: needs at least one layer, got none.")
    first = jax.tree_util.tree_structure(layers[0])
    for i, layer in enumerate(layers[1:], 1):
        if jax.tree_util.tree_structure(layer) != first:
            have, want = set(_leaf_paths(layer)), set(_leaf_paths(layers[0]))
            missing = ", ".join(leaf_name(p) for p in sorted(want - have)) or "none"
            extra = ", ".join(leaf_name(p) for p in sorted(have - want)) or "none"
            raise ValueError(
                f"{who}: {label(i)} holds other leaves than {label(0)} (missing: {missing}; "
                f"extra: {extra}; structure {jax.tree_util.tree_structure(layer)} vs "
                f"{first}). Every layer must have the same params: convert layers built "
                "from one block."
            )
    paths = _leaf_paths(layers[0])
    columns = list(zip(*(jax.tree_util.tree_leaves(layer) for layer in layers)))
    out = []
    for path, column in zip(paths, columns):
        shapes = [_shape(a) for a in column]
        if len(set(shapes)) > 1:
            raise ValueError(
                f"{who}: leaf {leaf_name(path)} has a different shape in some layers "
                f"({_by_layer(shapes, label)}); every layer's leaf must have one shape "
                "to be stacked."
            )
        dtypes = [_dtype(a) for a in column]
        if len(set(dtypes)) > 1:
            names = [_dtype_name(d) for d in dtypes]
            raise TypeError(
                f"{who}: leaf {leaf_name(path)} has different dtypes in different layers "
                f"({_by_layer(names, label)}); stacking them would promote the values, "
                "which stackwise never does. Cast the layers to one dtype first if that "
                "is what you want, e.g. `jax.tree.map(lambda a: a.astype(jnp.float32), "
                "layer)`."
            )
        stacked = stack_arrays(column)
        if _dtype(stacked) != dtypes[0]:  # e.g. a NumPy int64 next to jax arrays
            raise TypeError(
                f"{who}: leaf {leaf_name(path)} of dtype {_dtype_name(dtypes[0])} would be "
                f"stored as {_dtype_name(_dtype(stacked))}; pass all layers' leaves as "
                "NumPy arrays (kept as they are) or as jax arrays."
            )
        out.append(stacked)
    return jax.tree_util.tree_unflatten(first, out)


def unstack_exact(stacked: Any, n: int) -> list[Any]:
    """``[layer_0, ..., layer_{n-1}]``: each leaf's slice ``[i]`` (exact)."""
    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]


def depth_of(tree: Any, who: str, what: str, fix: str = "") -> int:
    """The common length of every leaf's leading axis; ValueError listing the leaves if none."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise ValueError(f"{who}: the {what} has no array leaves.")
    depths = {_shape(a)[0] if _shape(a) else None for _, a in leaves}
    if len(depths) != 1 or None in depths:
        lines = "\n".join(
            f"  {jax.tree_util.keystr(p) or '<root>'}: shape {_shape(a)}" for p, a in leaves
        )
        raise ValueError(
            f"{who}: every leaf of the {what} needs the same leading layer axis, but the "
            f"leaves are:\n{lines}" + (f"\n{fix}" if fix else "")
        )
    return depths.pop()


# --------------------------------------------------------------------------
# Patterns: position p of k holds layers p, p + k, p + 2k, ...


def check_pattern(pattern: Any, who: str) -> int | None:
    """``None`` or the pattern's length k, a positive int."""
    if pattern is None:
        return None
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise TypeError(
            f"{who}: `pattern` must be None or the number k of layers in the repeating "
            f"pattern (a positive int, as in `stackwise.stack([init_a, init_b], ...)` "
            f"where k=2), got {type(pattern).__name__} {pattern!r}."
        )
    return pattern


def pattern_counts(n: int, k: int) -> list[int]:
    """How many of n layers each of k pattern positions holds: ``len(range(p, n, k))``."""
    return [len(range(p, n, k)) for p in range(k)]


def pattern_depth(counts: Sequence[int], who: str) -> int:
    """The depth n of a pattern whose positions hold ``counts`` layers, or ValueError."""
    k, n = len(counts), sum(counts)
    if list(counts) != pattern_counts(n, k):
        raise ValueError(
            f"{who}: the {k} pattern positions hold {list(counts)} layers, which no depth "
            f"gives: position p of {k} holds layers p, p+{k}, ..., so for n={n} they would "
            f"hold {pattern_counts(n, k)}. Give the positions' trees as `Stacked.init` "
            "returns them."
        )
    return n


def check_n(n: Any, who: str) -> int | None:
    """``None`` or a positive int number of layers."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{who}: `n` must be None (find the layers) or the number of layers, a "
            f"positive int; got {type(n).__name__} {n!r}."
        )
    if n < 1:
        raise ValueError(f"{who}: `n` must be at least 1, got {n}.")
    return n


# --------------------------------------------------------------------------
# A loop's layers, found by name.


def layer_names(
    names: Any, who: str, plain: Callable[[str, int], str] | None = None, example: str = ""
) -> Callable[[int], Any]:
    """``names`` as a function ``i -> name``.

    Args:
      names: ``"layers_{}"`` (``str.format`` with the index), a function of
        the index, or a sequence of names (one per layer). A str without
        ``{}`` is a framework's own naming of repeated modules when ``plain``
        is given (Haiku: ``block``, ``block_1``, ...) and an error otherwise:
        every layer would get the same name.
      who: the public function, for messages.
      plain: the framework's naming of the i-th repeat of a plain name.
      example: an example of a good ``names`` for messages.

    Returns:
      ``name(i)``; it raises IndexError past the end of a list.
    """
    if isinstance(names, str):
        if "{" in names:
            try:
                names.format(0)
            except (IndexError, KeyError, ValueError):
                raise TypeError(
                    f"{who}: `names={names!r}` is not a format string of one index: use "
                    "`{}` where the layer's index goes, e.g. 'layers_{}'."
                ) from None
            return lambda i: names.format(i)
        if plain is not None:
            return lambda i: plain(names, i)
        raise TypeError(
            f"{who}: `names={names!r}` has no `{{}}` for the layer index, so every layer "
            f"would get the same name. Pass a format string such as "
            f"{example or repr(names + '_{}')}, a function of the index, or a list of "
            "names, one per layer."
        )
    if callable(names):
        return names
    if isinstance(names, (list, tuple)) and names:
        seq = list(names)
        return lambda i: seq[i]
    raise TypeError(
        f"{who}: `names` must be a format string with `{{}}` for the layer index "
        f"(e.g. {example or repr('layers_{}')}), a function of the index or a non-empty "
        f"list of names; got {type(names).__name__} {names!r}."
    )


def check_distinct(names: Sequence[str], who: str, sep: str | None = "/") -> None:
    """Raises ValueError if two layers share a name (or one is nested in another's)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(
                f"{who}: layers {seen[name]} and {i} are both named {name!r}; each layer "
                "needs its own name, or one would overwrite the other. Use a format "
                "string with `{}` (e.g. 'layers_{}') or a list of distinct names."
            )
        seen[name] = i
    if sep:
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                if i != j and str(b).startswith(str(a) + sep):
                    raise ValueError(
                        f"{who}: layer {j}'s name {b!r} lies inside layer {i}'s {a!r}; "
                        "each layer needs a name of its own."
                    )


def find_depth(
    exists: Callable[[int], bool],
    label: Callable[[int], str],
    n: int | None,
    bound: int,
    who: str,
    *,
    fixed: int | None = None,
    pattern: int = 1,
) -> int:
    """The number of layers of a loop, found by name: all of 0..n-1 present and no more.

    Looks at indices ``0 .. max(bound, n)`` (``bound``: an upper bound on the
    layers the tree can hold, e.g. its number of entries), so a gap or a
    surplus is seen whatever the naming.

    With a pattern of k kinds of blocks, a kind may have nothing in this
    tree (a Haiku state dict, a linen collection, that only some kinds
    create): the layers of the kinds present must then be there without a
    gap, and those of the others are absent. The depth found ends with the
    last layer present; a position p is present if layer p is.

    Args:
      exists: whether layer i's name is in the tree.
      label: layer i's name, for messages.
      n: the number of layers the caller expects, or None to find it.
      bound: no layer index reaches it.
      who: the public function, for messages.
      fixed: the number of names when they were given as a list (then exactly
        those are taken).
      pattern: the pattern's length k (1: no pattern).

    Raises:
      ValueError: no layer at all, a gap (the missing indices are named), or
        more layers than ``n`` (how many there are is said).
    """
    if fixed is not None:
        if n is not None and n != fixed:
            raise ValueError(f"{who}: got n={n} but {fixed} names; give one name per layer.")
        n, limit = fixed, fixed
    else:
        limit = max(bound * pattern, n or 0) + 1
    present = [i for i in range(limit) if exists(i)]
    if not present:
        raise ValueError(
            f"{who}: found no layer: nothing is named {label(0)} (layer 0). Pass the "
            "per-layer naming as `names=`."
        )
    found = present[-1] + 1
    kinds = {i % pattern for i in present}
    expected = [i for i in range(max(found, n or 0)) if i % pattern in kinds]
    missing = sorted(set(expected) - set(present))
    if missing:
        shown = ", ".join(f"{i} ({label(i)})" for i in missing[:5])
        shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        if missing[0] >= found:  # n asks for more layers than there are
            raise ValueError(
                f"{who}: n={n} asks for layers 0..{n - 1}, but only {found} are present: "
                f"layer(s) {shown} missing. Pass n={found}, or check `names=`."
            )
        raise ValueError(
            f"{who}: layer(s) {shown} missing, yet layer {found - 1} ({label(found - 1)}) "
            "is present: a loop's layers are numbered without gaps, so the depth cannot "
            "be told. Check `names=`, or rename the layers 0, 1, 2, ... first."
        )
    if n is not None and found > n:
        raise ValueError(
            f"{who}: found {found} layers ({label(0)} ... {label(found - 1)}) but n={n}: "
            f"layers {n}..{found - 1} would be left behind. Pass n={found} (then, for a "
            f"shallower model, `stackwise.slice_layers(stacked, 0, {n})`), or remove them "
            "from the tree first."
        )
    return found if n is None else n


def pattern_depths(counts: Mapping[int, int], k: int, who: str) -> tuple[int, int]:
    """``(lo, hi)``: the depths n for which positions p hold ``counts[p]`` layers.

    ``counts`` may leave out positions that have nothing in a tree (a kind of
    block without state); with every position given, ``lo == hi`` is the
    depth (:func:`pattern_depth`). Position p holds ``len(range(p, n, k))``
    layers, so ``counts[p] = c`` means ``p + (c - 1) k < n <= p + c k``.

    Raises:
      ValueError: no depth gives these counts.
    """
    if len(counts) == k:
        n = pattern_depth([counts[p] for p in range(k)], who)
        return n, n
    lo, hi = k, None
    for p, c in counts.items():
        lo = max(lo, p + (c - 1) * k + 1)
        hi = p + c * k if hi is None else min(hi, p + c * k)
    if hi is None or lo > hi:
        shown = ", ".join(f"position {p}: {c}" for p, c in sorted(counts.items()))
        raise ValueError(
            f"{who}: the pattern positions found hold so many layers ({shown}) as no "
            f"depth gives: position p of {k} holds layers p, p+{k}, ... Give the positions' "
            "trees as `Stacked.init` returns them."
        )
    return lo, hi


# --------------------------------------------------------------------------
# Two models, leaf by leaf, in the order the framework creates their variables.


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
                "together, so this model cannot be matched leaf by leaf."
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
            raise ValueError(
                f"{who}: the {side} model's stack {leaf.group!r} holds leaves of depths "
                f"{depths} (by pattern position) in an order no loop or pattern gives."
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
        f"{leaf.name}{where}: {owner}{leaf.key!r} {_dtype_name(leaf.dtype)}{list(leaf.shape)}"
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
        column = [values[s.leaf] if s.layer is None else values[s.leaf][s.layer] for s in slots]
        out.append(stack_arrays(column) if leaf.depth else column[0])
    return out
