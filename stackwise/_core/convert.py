"""What every conversion by name shares: exact stacking, a loop's layers, depths.

Framework-free (jax and numpy only). The layout tools (:mod:`stackwise._core.layout`)
and each adapter's ``_convert.py`` build on these, so that every conversion
follows one rule and the same failure reads the same everywhere: a conversion
moves every leaf exactly (bitwise, dtype kept) or raises a ValueError/TypeError
that names the leaf, the layer and the fix. It never overwrites an entry,
never guesses a depth from a partial sequence, never leaves layers behind and
never promotes a dtype.

Two parts:

- exact stacking: :func:`stack_exact` / :func:`unstack_exact` (and a pattern's
  positions, :func:`pattern_counts` / :func:`pattern_depth` / :func:`pattern_depths`);
- finding a loop's layers by name: :func:`layer_names`, :func:`find_depth`,
  :func:`check_distinct`, :func:`check_names_count`, :func:`common_prefix`.

Matching two whole models leaf by leaf, in the order the framework creates
their variables (each adapter's ``convert``), is :mod:`stackwise._kit.matching`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import checks, trees

__all__ = [
    "check_distinct",
    "check_n",
    "check_names_count",
    "check_pattern",
    "common_prefix",
    "depth_of",
    "dtype_name",
    "dtype_of",
    "find_depth",
    "layer_names",
    "pattern_counts",
    "pattern_depth",
    "pattern_depths",
    "stack_arrays",
    "stack_exact",
    "unstack_exact",
]

# --------------------------------------------------------------------------
# Exact stacking.


dtype_of = checks.leaf_dtype  # a leaf's own dtype, never canonicalised by jax


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(np.shape(a)) if not hasattr(a, "shape") else tuple(a.shape)


def dtype_name(dtype: Any) -> str:
    """``float32``: a dtype's name, for messages."""
    return getattr(dtype, "name", None) or str(dtype)


def array_text(a: Any) -> str:
    """``float32[4, 8]``: a leaf's dtype and shape, for messages."""
    return f"{dtype_name(dtype_of(a))}{list(_shape(a))}"


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
    if all(trees.is_abstract(a) for a in column):  # a restore target: shapes only
        return trees.stack_abstract(column)
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
        dtypes = [dtype_of(a) for a in column]
        if len(set(dtypes)) > 1:
            names = [dtype_name(d) for d in dtypes]
            raise TypeError(
                f"{who}: leaf {leaf_name(path)} has different dtypes in different layers "
                f"({_by_layer(names, label)}); stacking them would promote the values, "
                "which stackwise never does. Cast the layers to one dtype first if that "
                "is what you want, e.g. `jax.tree.map(lambda a: a.astype(jnp.float32), "
                "layer)`."
            )
        stacked = stack_arrays(column)
        if dtype_of(stacked) != dtypes[0]:  # e.g. a NumPy int64 next to jax arrays
            raise TypeError(
                f"{who}: leaf {leaf_name(path)} of dtype {dtype_name(dtypes[0])} would be "
                f"stored as {dtype_name(dtype_of(stacked))}; pass all layers' leaves as "
                "NumPy arrays (kept as they are) or as jax arrays."
            )
        out.append(stacked)
    return jax.tree_util.tree_unflatten(first, out)


def unstack_exact(stacked: Any, n: int) -> list[Any]:
    """``[layer_0, ..., layer_{n-1}]``: each leaf's slice ``[i]`` (exact; abstract leaves
    give abstract slices)."""
    return [jax.tree.map(lambda a, i=i: trees.take(a, i), stacked) for i in range(n)]


depth_of = checks.depth  # the common depth of every leaf, or a ValueError listing them


# --------------------------------------------------------------------------
# Patterns: position p of k holds layers p, p + k, p + 2k, ...


def check_pattern(pattern: Any, who: str) -> int | None:
    """``None`` or the pattern's length k, a positive int."""
    if pattern is None:
        return None
    if isinstance(pattern, np.integer) and not isinstance(pattern, bool):
        pattern = int(pattern)
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
    if isinstance(n, np.integer):
        n = int(n)
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


def common_prefix(paths: Sequence[Sequence[Any]]) -> tuple:
    """The paths' longest common prefix, e.g. of a pattern's positions: the Stack's path."""
    common = tuple(paths[0])
    for path in paths[1:]:
        k = 0
        while k < min(len(common), len(path)) and common[k] == path[k]:
            k += 1
        common = common[:k]
    return common


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
      ValueError: fewer layers asked for (``n`` or ``fixed``) than the
        pattern has positions, no layer at all, a gap (the missing indices are
        named), or more layers than ``n`` (how many there are is said).
    """
    asked = fixed if fixed is not None else n
    if asked is not None and asked < pattern:
        raise ValueError(
            f"{who}: a pattern of {pattern} blocks needs at least {pattern} layers, got {asked}."
        )
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


def check_names_count(names: Any, depths: tuple[int, int], who: str, held_by: str) -> None:
    """Raises unless a list of ``names`` gives one name per layer held.

    Args:
      names: the loop's naming; only a list or tuple (one name per layer) is
        checked.
      depths: ``(lo, hi)`` from :func:`pattern_depths`: the depths the
        stacked tree may have.
      who: the public function, for messages.
      held_by: what holds the layers, with its verb, e.g. ``the stacked
        leaves hold``.
    """
    lo, hi = depths
    if isinstance(names, (list, tuple)) and not lo <= len(names) <= hi:
        held = lo if lo == hi else f"{lo} to {hi}"
        raise ValueError(
            f"{who}: {held_by} {held} layers but {len(names)} `names` were given; give one "
            "name per layer."
        )
