"""Exact conversions between an NNX Stack's state and other layouts.

An ``nnx.Module`` holds its state, so most moves are one ``nnx.update``
away: :meth:`Stack.from_layers` / :meth:`Stack.to_layers` stack built blocks
and split them again. The functions here convert *state* (an ``nnx.State``,
or the nested dict ``nnx.to_pure_dict`` gives), as checkpoints hold it:

- :func:`convert`: one model's state onto another's, leaf by leaf in NNX's
  graph order (an upstream model with ``self.layers = [Block(...) ...]`` into
  its port with ``self.layers = Stack(...)``, and back), in one call;
- :func:`from_loop` / :func:`to_loop`: the layers of a loop (``layers[i]``,
  ``layer_{i}``, any naming), found by name (with a pattern of k blocks too);
- :func:`from_scan` / :func:`to_scan`: a block built with ``nnx.vmap`` and run
  with ``nnx.scan`` (its variables stacked along an axis).

A Stack at ``path`` keeps its block at ``path + ("layers",)``, every
variable with a leading layer axis; a pattern Stack keeps position p's block
at ``path + ("layers", p)``. Every function moves every leaf exactly
(bitwise, dtype, variable type and metadata kept; the layer axis added to or
removed from ``out_sharding``) or raises naming the variable, the layer and
the fix; none overwrites an entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx, traverse_util

from stackwise import _convert

__all__ = ["convert", "from_loop", "from_scan", "to_loop", "to_scan"]

Path = str | tuple[str | int, ...]
Names = str | Sequence[Path] | Callable[[int], Path]

_BLOCK = "layers"  # the attribute of a Stack that holds the stacked block


# --------------------------------------------------------------------------
# Paths and flat state.


def _parts(path: Any, who: str, what: str = "path") -> tuple:
    """``"layers/3/attn"``, ``"layers.3.attn"`` or ``("layers", 3, "attn")`` as a tuple."""
    if isinstance(path, str):
        parts = tuple(int(p) if p.isdigit() else p for p in re.split(r"[/.]", path) if p)
    elif isinstance(path, tuple) and all(isinstance(p, (str, int)) for p in path):
        parts = path
    else:
        parts = None
    if not parts:
        raise TypeError(
            f"{who}: `{what}` must name a place in the state, e.g. 'layers', 'layers/0' or "
            f"('layers', 0), got {path!r}."
        )
    return parts


def _single(path: Any, who: str) -> tuple:
    if isinstance(path, list):
        raise TypeError(
            f"{who}: `path` is one place here, the vmapped block's, got a list {path!r}. "
            "For a pattern Stack's positions by name, use `from_loop` / `to_loop` with the "
            "list of positions."
        )
    return _parts(path, who)


def _positions(path: Any, who: str) -> tuple[list[tuple], tuple, bool]:
    """``(positions, stack, listed)``: where each pattern position's block is, and
    where the Stack is (a loop there is its default naming).

    One path is a Stack's place, its block at ``path + ("layers",)``. A list
    of k paths names the k positions of a pattern Stack, each where its
    stacked block is (``"layers/layers/0"``, ``"layers/layers/1"``, ... for
    a Stack at ``layers``); the Stack is then the positions' common parent.
    """
    if not isinstance(path, list):
        stack = _parts(path, who)
        return [stack + (_BLOCK,)], stack, False
    if not path:
        raise TypeError(
            f"{who}: a pattern's `path` lists its k positions (for a Stack at 'layers': "
            "['layers/layers/0', ..., 'layers/layers/{k-1}']); got []."
        )
    positions = [_parts(p, who) for p in path]
    _convert.check_distinct([_show(p) for p in positions], who, sep=None)
    for i, a in enumerate(positions):
        for j, b in enumerate(positions):
            if i != j and b[: len(a)] == a:
                raise ValueError(f"{who}: position {j} ({_show(b)}) lies inside position {i}.")
    common = positions[0]
    for p in positions[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    if len(positions) == 1:
        common = positions[0]
    return positions, common[:-1], True


def _show(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


def _flat(tree: Any, who: str) -> tuple[dict[tuple, Any], bool]:
    """``({path: leaf}, is_state)``: an ``nnx.State`` or a nested dict, flattened."""
    if isinstance(tree, nnx.State):
        return dict(nnx.to_flat_state(tree)), True
    if isinstance(tree, Mapping):
        return traverse_util.flatten_dict(dict(tree)), False
    raise TypeError(
        f"{who}: `tree` must be an `nnx.State` (e.g. `nnx.state(model)`) or a nested dict "
        f"of arrays (`nnx.to_pure_dict`), got {type(tree).__name__}."
    )


def _unflat(flat: dict[tuple, Any], is_state: bool) -> Any:
    if is_state:
        return nnx.from_flat_state(flat)
    return traverse_util.unflatten_dict(flat)


def _under(flat: dict[tuple, Any], prefix: tuple) -> dict[tuple, Any]:
    """The leaves under ``prefix``, keyed by the rest of their path."""
    k = len(prefix)
    return {p[k:]: v for p, v in flat.items() if p[:k] == prefix and len(p) > k}


def _has(flat: dict[tuple, Any], prefix: tuple) -> bool:
    k = len(prefix)
    return any(p[:k] == prefix for p in flat)


def _put_all(flat: dict, prefix: tuple, leaves: dict[tuple, Any], who: str) -> None:
    if _has(flat, prefix):
        raise ValueError(
            f"{who}: {_show(prefix)} already exists in the state; stackwise never "
            "overwrites an entry. Remove it first, or convert to another path or names."
        )
    for rest, v in leaves.items():
        flat[prefix + rest] = v


# --------------------------------------------------------------------------
# Variables: values and the layer axis in `out_sharding`.


def _raw(v: Any) -> Any:
    return v.get_raw_value() if isinstance(v, nnx.Variable) else v


def _meta(v: Any) -> Any:
    return (type(v).__name__, v.get_metadata()) if isinstance(v, nnx.Variable) else None


def _with(v: Any, value: Any, sharding: Callable[[tuple], tuple]) -> Any:
    """``value`` in a copy of variable ``v`` (its ``out_sharding`` changed by ``sharding``)."""
    if not isinstance(v, nnx.Variable):
        return value
    spec = v.get_metadata("out_sharding", None)
    if spec:
        return v.copy(value, out_sharding=sharding(tuple(spec)))
    return v.copy(value)


def _check_layer_axis(flat: dict, prefix: tuple, axis_name: Any, who: str) -> None:
    for rest, v in flat.items():
        spec = v.get_metadata("out_sharding", None) if isinstance(v, nnx.Variable) else None
        if spec and tuple(spec)[0] != axis_name:
            raise ValueError(
                f"{who}: variable {_show(prefix + rest)} has out_sharding {tuple(spec)}, "
                f"whose first (layer) axis should be named {axis_name!r}; pass the Stack's "
                f"`layer_axis_name={tuple(spec)[0]!r}`."
            )


def _stack(
    layers: list[dict],
    prefix_of: Callable[[int], tuple],
    axis_name: Any,
    who: str,
    index_of: Callable[[int], int] = lambda j: j,
) -> dict:
    """Per-layer flat leaves -> stacked leaves (variables keep type and metadata).

    ``layers[j]`` is the loop's layer ``index_of(j)``, named ``prefix_of(j)``.
    """
    first = layers[0]
    label = lambda j: f"layer {index_of(j)} ({_show(prefix_of(j))})"  # noqa: E731
    for i, layer in enumerate(layers[1:], 1):
        for rest in sorted(set(first) & set(layer), key=str):
            if _meta(first[rest]) != _meta(layer[rest]):
                raise ValueError(
                    f"{who}: variable {_show(prefix_of(i) + rest)} has type and metadata "
                    f"{_meta(layer[rest])} but {label(0)} has {_meta(first[rest])}; the "
                    "stacked variable keeps one, so the layers must agree."
                )
    values = _convert.stack_exact(
        [{_show(r): _raw(v) for r, v in layer.items()} for layer in layers],
        who,
        label=label,
        leaf_name=lambda s: f"{s[2:-2]} (in each layer)",
    )
    return {r: _with(v, values[_show(r)], lambda s: (axis_name, *s)) for r, v in first.items()}


# --------------------------------------------------------------------------
# By name: a loop's layers <-> a Stack's block.


def _names(names: Any, stack: tuple, who: str) -> Callable[[int], tuple]:
    if names is None:
        return lambda i: stack + (i,)
    name_of = _convert.layer_names(names, who, example="'layers/{}' or 'layer_{}'")
    return lambda i: _parts(name_of(i), who, "names")


def from_loop(
    tree: Any,
    path: Path | list[Path],
    names: Names | None = None,
    *,
    n: int | None = None,
    layer_axis_name: str | None = None,
) -> Any:
    """A loop's state (layers held one by one) in a :class:`Stack`'s layout, exactly.

    The layers ``names(i)`` (by default ``path`` then the index: a list
    ``self.layers = [Block(...) for ...]``) are stacked along a new leading
    axis into the Stack's block, ``path + ("layers",)``; other variables are
    kept. Then ``nnx.update(model, state)``.

    >>> import jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Loop(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
    >>> class Port(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = stackwise.nnx.Stack(
    ...             lambda rngs: nnx.Linear(4, 4, rngs=rngs), 3, rngs=rngs)
    >>> loop = Loop(nnx.Rngs(0))
    >>> state = stackwise.nnx.from_loop(nnx.state(loop), "layers")
    >>> state["layers"]["layers"]["kernel"].shape
    (3, 4, 4)
    >>> port = nnx.eval_shape(lambda: Port(nnx.Rngs(0)))
    >>> nnx.update(port, state)
    >>> bool(jnp.array_equal(port.layers.layers.kernel[2], loop.layers[2].kernel[...]))
    True

    Layers are found by name, all of them: a gap (``layer_0``, ``layer_2``)
    or more layers than ``n`` is an error naming what was found.

    For a pattern Stack (``Stack([make_local, make_local, make_global], n,
    rngs=rngs)``, whose k positions' blocks are ``stack.layers[p]``),
    ``path`` lists the k positions' paths, as in Haiku and linen: layer i
    goes to position ``i % k``, e.g. ``[f"layers/layers/{p}" for p in
    range(3)]`` for a Stack at ``layers``.

    Args:
      tree: the state, an ``nnx.State`` (``nnx.state(model)``) or a nested
        dict of arrays (``nnx.to_pure_dict``, a checkpoint).
      path: where the Stack is in the model, e.g. ``"layers"`` or
        ``"decoder/layers"`` (``.`` also separates; a number is a list index);
        for a pattern, the list of the k positions' paths (the Stack is then
        their common parent, ``layers``).
      names: the loop's layers: None (the Stack's path then the index, a
        list's layout), a format string (``"layer_{}"``, ``"blocks/{}"``), a
        function of the index or a list of n paths.
      n: the number of layers; by default all layers found.
      layer_axis_name: the Stack's ``layer_axis_name``, added first to every
        variable's ``out_sharding``.

    Returns:
      A new state of the input's kind (``nnx.State`` or dict).

    Raises:
      ValueError: no layer found, a gap, more layers than ``n``, layers that
        differ in variables, shapes or metadata, or a Stack's block that
        already exists in the state.
      TypeError: a variable whose dtype differs between layers (never
        promoted), or a bad argument.
    """
    who = "stackwise.nnx.from_loop"
    flat, is_state = _flat(tree, who)
    positions, stack, _ = _positions(path, who)
    k = len(positions)
    n = _convert.check_n(n, who)
    name_of = _names(names, stack, who)

    def exists(i: int) -> bool:
        try:
            return _has(flat, name_of(i))
        except (IndexError, KeyError):
            return False

    fixed = len(names) if isinstance(names, (list, tuple)) else None
    asked = fixed if fixed is not None else n
    if asked is not None and asked < k:
        raise ValueError(f"{who}: a pattern of {k} blocks needs at least {k} layers, got {asked}.")
    label = lambda i: repr(_show(name_of(i)))  # noqa: E731
    n = _convert.find_depth(exists, label, n, len(flat), who, fixed=fixed, pattern=k)
    prefixes = [name_of(i) for i in range(n)]
    _convert.check_distinct([p for p in prefixes], who, sep=None)
    for i, a in enumerate(prefixes):
        for j, b in enumerate(prefixes):
            if i != j and b[: len(a)] == a:
                raise ValueError(f"{who}: layer {j} ({_show(b)}) lies inside layer {i}.")
    layers = [_under(flat, p) for p in prefixes]
    rest = {p: v for p, v in flat.items() if not any(p[: len(q)] == q for q in prefixes)}
    for q, where in enumerate(positions):
        own = list(range(q, n, k))
        if not own or not layers[q]:
            continue  # a kind of block without variables
        stacked = _stack(
            [layers[i] for i in own],
            lambda j, own=own: prefixes[own[j]],
            layer_axis_name,
            who,
            lambda j, own=own: own[j],
        )
        _put_all(rest, where, stacked, who)
    return _unflat(rest, is_state)


def to_loop(
    tree: Any,
    path: Path | list[Path],
    names: Names | None = None,
    *,
    layer_axis_name: str | None = None,
) -> Any:
    """A :class:`Stack`'s state in the layout of a loop of layers: the inverse of :func:`from_loop`.

    >>> import jax.numpy as jnp, stackwise.nnx
    >>> state = {"layers": {"layers": {"w": jnp.arange(6.0).reshape(3, 2)}}}
    >>> loop = stackwise.nnx.to_loop(state, "layers")
    >>> sorted(loop["layers"]), loop["layers"][2]["w"].tolist()
    ([0, 1, 2], [4.0, 5.0])

    Args:
      tree: the state, an ``nnx.State`` or a nested dict of arrays.
      path: where the Stack is in the model (its block is ``path + ("layers",)``);
        for a pattern Stack, the list of the k positions' paths
        (``"layers/layers/0"``, ...), as for :func:`from_loop`.
      names: the loop's layers, as for :func:`from_loop`.
      layer_axis_name: the Stack's ``layer_axis_name`` (removed from every
        ``out_sharding``; another name there is an error).

    Returns:
      A new state of the input's kind.

    Raises:
      ValueError: no Stack block at ``path`` (or a pattern's block given as
        one path), leaves without a common leading axis, positions whose
        depths no n gives, variables under a pattern Stack at none of the
        positions, two layers of one name, or a layer that already exists.
    """
    who = "stackwise.nnx.to_loop"
    flat, is_state = _flat(tree, who)
    positions, stack, listed = _positions(path, who)
    k = len(positions)
    held = {}
    for q, where in enumerate(positions):
        inside = _under(flat, where)
        if not inside:
            continue  # with a pattern: a kind of block without variables
        if not listed:
            _check_not_a_pattern(inside, where, who)
        _check_layer_axis(inside, where, layer_axis_name, who)
        raw = {_show(r): _raw(v) for r, v in inside.items()}
        depth = _convert.depth_of(raw, who, f"Stack block at {_show(where)}")
        held[q] = (inside, _convert.unstack_exact(raw, depth))
    if not held:
        tops = sorted({_show(p[:2]) for p in flat}, key=str)[:12]
        if not listed:
            raise ValueError(
                f"{who}: no Stack block at {_show(positions[0])} (a Stack at {_show(stack)} "
                f"keeps its block there); the state has {tops}."
            )
        raise ValueError(
            f"{who}: nothing at the pattern's positions "
            f"{[_show(p) for p in positions]}; the state has {tops}."
        )
    rest = {p: v for p, v in flat.items() if not any(p[: len(w)] == w for w in positions)}
    if k > 1:
        common = stack + (positions[0][len(stack)],)
        left = sorted(_show(p) for p in rest if p[: len(common)] == common)
        if left:
            raise ValueError(
                f"{who}: {left[:3]} lie in the Stack's {_show(common)} but at none of the "
                f"pattern's positions {[_show(p) for p in positions]}; they would be left "
                "behind, stacked. Check `path` (each position's path, in the pattern's order)."
            )
    lo, hi = _convert.pattern_depths({q: len(v[1]) for q, v in held.items()}, k, who)
    name_of = _names(names, stack, who)
    if isinstance(names, (list, tuple)) and not lo <= len(names) <= hi:
        count = lo if lo == hi else f"{lo} to {hi}"
        raise ValueError(
            f"{who}: the Stack holds {count} layers but {len(names)} `names` were given; "
            "give one name per layer."
        )
    indices = sorted(q + j * k for q, (_, layers) in held.items() for j in range(len(layers)))
    prefixes = {i: name_of(i) for i in indices}
    _convert.check_distinct(list(prefixes.values()), who, sep=None)
    for q, (inside, layers) in held.items():
        for j, layer_values in enumerate(layers):
            layer = {
                r: _with(v, layer_values[_show(r)], lambda s: s[1:]) for r, v in inside.items()
            }
            _put_all(rest, prefixes[q + j * k], layer, who)
    return _unflat(rest, is_state)


def _check_not_a_pattern(inside: dict[tuple, Any], where: tuple, who: str) -> None:
    """A pattern Stack's block is an ``nnx.List`` of its k positions: refuse to slice it as one."""
    tops = {r[0] for r in inside}
    if len(tops) > 1 and tops == set(range(len(tops))):
        k = len(tops)
        listed = [_show(where + (p,)) for p in range(k)]
        raise ValueError(
            f"{who}: {_show(where)} holds the {k} positions of a pattern Stack "
            f"({_show(where + (0,))}, ...), not one stacked block. Pass them as a list: "
            f"path={listed}."
        )


# --------------------------------------------------------------------------
# nnx.vmap / nnx.scan's layout: the block's variables stacked along an axis.


def _axes(variable_axes: Any, who: str) -> list[tuple[Callable, int]]:
    if variable_axes is None:
        return [(lambda path, v: True, 0)]
    if not isinstance(variable_axes, Mapping):
        raise TypeError(
            f"{who}: `variable_axes` maps NNX filters to the stacked axis, e.g. "
            f"{{nnx.Param: 0, ...: 0}}, got {type(variable_axes).__name__}."
        )
    out = []
    for filt, axis in variable_axes.items():
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(
                f"{who}: `variable_axes[{filt!r}]` must be an int axis or None "
                f"(broadcast: not converted), got {axis!r}."
            )
        out.append((nnx.filterlib.to_predicate(filt), axis))
    return out


def _move(tree, path, variable_axes, to_stack, scan_axis_name, layer_axis_name, who):
    flat, is_state = _flat(tree, who)
    where = _single(path, who)
    src_prefix, dst_prefix = (where, where + (_BLOCK,)) if to_stack else (where + (_BLOCK,), where)
    inside = _under(flat, src_prefix)
    if not inside:
        raise ValueError(
            f"{who}: nothing at {_show(src_prefix)} to convert; the state has "
            f"{sorted({_show(p[:2]) for p in flat}, key=str)[:12]}."
        )
    axes = _axes(variable_axes, who)
    rest = {p: v for p, v in flat.items() if p[: len(src_prefix)] != src_prefix}
    moved = {}
    for r, v in inside.items():
        axis = next((a for pred, a in axes if pred(r, v)), None)
        if axis is None:
            raise ValueError(
                f"{who}: variable {_show(src_prefix + r)} ({type(v).__name__}) is matched by "
                "no int axis of `variable_axes`: a broadcast variable holds one copy for "
                "all layers, which a Stack cannot hold."
            )
        value = _raw(v)
        src, dst = (axis, 0) if to_stack else (0, axis)
        if jnp.ndim(value) <= max(src, dst):
            raise ValueError(
                f"{who}: variable {_show(src_prefix + r)} has shape {jnp.shape(value)}, "
                f"without axis {max(src, dst)}."
            )
        spec = v.get_metadata("out_sharding", None) if isinstance(v, nnx.Variable) else None
        if spec:
            spec, expected = list(spec), scan_axis_name if to_stack else layer_axis_name
            if spec[src] != expected:
                fix = "`scan_axis_name`" if to_stack else "`layer_axis_name`"
                raise ValueError(
                    f"{who}: variable {_show(src_prefix + r)} has out_sharding {tuple(spec)}, "
                    f"whose axis {src} should be named {expected!r}; pass the name it was "
                    f"given as {fix}."
                )
            del spec[src]
            spec.insert(dst, layer_axis_name if to_stack else scan_axis_name)
        new = jnp.moveaxis(value, src, dst) if src != dst else value
        moved[r] = _with(v, new, lambda s, spec=spec: tuple(spec))
    _put_all(rest, dst_prefix, moved, who)
    return _unflat(rest, is_state)


def from_scan(
    tree: Any,
    path: Path,
    *,
    variable_axes: Mapping[Any, int | None] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> Any:
    """The state of a block built with ``nnx.vmap`` (and run with ``nnx.scan``) in a Stack's layout.

    NNX's own recipe keeps the vmapped block as a module attribute, e.g.
    ``self.blocks = create_blocks(rngs)``: its variables at ``blocks.*``
    with the layer axis first. A Stack at ``blocks`` keeps them at
    ``blocks.layers.*``; with other ``variable_axes`` (``nnx.StateAxes``) the
    axis moves to 0, and ``out_sharding`` (``transform_metadata=
    {nnx.PARTITION_NAME: ...}``) is renamed.

    >>> import jax.numpy as jnp, stackwise.nnx
    >>> scanned = {"blocks": {"kernel": jnp.zeros((3, 4, 5))}}
    >>> state = stackwise.nnx.from_scan(scanned, "blocks")
    >>> state["blocks"]["layers"]["kernel"].shape
    (3, 4, 5)
    >>> stackwise.nnx.to_scan(state, "blocks")["blocks"]["kernel"].shape
    (3, 4, 5)

    Args:
      tree: the state (``nnx.State`` or nested dict).
      path: where the vmapped block is, and the Stack will be.
      variable_axes: NNX filter -> the stacked axis, as in ``nnx.StateAxes``
        (default: every variable on axis 0).
      scan_axis_name: the partition name given to ``nnx.vmap``'s
        ``transform_metadata``.
      layer_axis_name: the Stack's ``layer_axis_name``.

    Returns:
      A new state of the input's kind.

    Raises:
      ValueError: nothing at ``path``, a variable no int axis matches, or an
        ``out_sharding`` whose layer axis has another name.
    """
    return _move(
        tree, path, variable_axes, True, scan_axis_name, layer_axis_name, "stackwise.nnx.from_scan"
    )


def to_scan(
    tree: Any,
    path: Path,
    *,
    variable_axes: Mapping[Any, int | None] | None = None,
    scan_axis_name: str | None = None,
    layer_axis_name: str | None = None,
) -> Any:
    """The inverse of :func:`from_scan`: a Stack's state in ``nnx.vmap``'s layout.

    Args and Returns: as :func:`from_scan`, the other way round.
    """
    return _move(
        tree, path, variable_axes, False, scan_axis_name, layer_axis_name, "stackwise.nnx.to_scan"
    )


# --------------------------------------------------------------------------
# By graph order: one model's state -> another's.


class _Model:
    """A model's state as :class:`stackwise._convert.Leaf` s, in NNX's graph order.

    NNX orders a module's state by attribute name (lists by index), the order
    of ``nnx.state`` and ``nnx.to_flat_state``. A :class:`Stack`'s block is a
    stack: its leaves come layer by layer.
    """

    def __init__(self, model: Any, side: str, who: str):
        from stackwise.nnx._stack import Stack  # the adapter's module type

        if not isinstance(model, nnx.Module):
            if not callable(model):
                raise TypeError(
                    f"{who}: the {side} model must be an `nnx.Module` or a function "
                    f"building one, got {type(model).__name__} {model!r}."
                )
            model = nnx.eval_shape(model)
            if not isinstance(model, nnx.Module):
                raise TypeError(f"{who}: the {side} model's function did not build a module.")
        self.side, self.who = side, who
        owners, stacks = {}, {}  # path -> class name; a Stack's block path -> pattern length
        for path, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Pytree):  # modules and their containers (nnx.List)
                owners[tuple(path)] = type(node).__name__
            if isinstance(node, Stack):
                stacks[tuple(path) + (_BLOCK,)] = len(node.layers) if node.pattern else 1
        self.flat = dict(nnx.to_flat_state(nnx.state(model)))
        self.paths = list(self.flat)
        self.groups = []  # each leaf's layer root: its Stack's block, or pattern position
        self.leaves = []
        for path in self.paths:
            value = _raw(self.flat[path])
            group = next((g for g in stacks if path[: len(g)] == g), None)
            shape, depth, position, k, root = tuple(value.shape), 0, 0, 1, ()
            if group is not None:
                depth, shape, k, root = shape[0], shape[1:], stacks[group], group
                if k > 1:
                    position = path[len(group)]
                    root = group + (position,)
            scope = tuple(
                owners[path[:j]] for j in range(len(root), len(path)) if path[:j] in owners
            )
            owner = owners.get(path[:-1], "")
            self.groups.append(None if group is None else root)
            self.leaves.append(
                _convert.Leaf(
                    _show(path),
                    owner,
                    str(path[-1]),
                    shape,
                    value.dtype,
                    depth,
                    group,
                    None,
                    scope,
                    position,
                    k,
                )
            )

    def check(self, flat: dict) -> None:
        bad = [f"  missing: {_show(p)}" for p in self.paths if p not in flat]
        bad += [f"  not in the model: {_show(p)}" for p in flat if p not in self.flat]
        bad += [
            f"  {_show(p)}: {_convert.describe(_raw(flat[p]))}, the model has "
            f"{_convert.describe(_raw(self.flat[p]))}"
            for p in self.paths
            if p in flat
            and (
                tuple(jnp.shape(_raw(flat[p]))) != tuple(_raw(self.flat[p]).shape)
                or _convert._dtype(_raw(flat[p])) != _raw(self.flat[p]).dtype
            )
        ]
        if bad:
            raise ValueError(
                f"{self.who}: the state given is not the {self.side} model's:\n"
                + "\n".join(bad[:20])
            )


def _local(model: _Model, i: int) -> tuple:
    path, group = model.paths[i], model.groups[i]
    return path if group is None else path[len(group) :]


def _check_names(src: _Model, tgt: _Model, sources: list, who: str) -> None:
    """NNX names are local: paired leaves must have the same path within their layer.

    A loop's layer i is one subtree (``layers.3``, ``layer_3``): all leaves
    paired with one layer of a stack share one root, the rest of their path
    being the stacked leaf's path inside the block.
    """
    roots: dict[tuple, tuple] = {}
    for t, slots in enumerate(sources):
        for j, s in enumerate(slots):
            a, b = _local(src, s.leaf), _local(tgt, t)
            s_group, t_group = src.groups[s.leaf], tgt.groups[t]
            if (s_group is None) == (t_group is None):
                ok = a == b
            else:  # one side is a loop: its path ends with the stacked leaf's
                long, short = (a, b) if s_group is None else (b, a)
                layer = ("target", t_group, j) if s_group is None else ("source", s_group, s.layer)
                ok = long[len(long) - len(short) :] == short
                if ok:
                    root = long[: len(long) - len(short)]
                    ok = roots.setdefault(layer, root) == root
            if not ok:
                where = f" (layer {s.layer})" if s.layer is not None else ""
                raise ValueError(
                    f"{who}: in graph order, the target's {_show(tgt.paths[t])} takes the "
                    f"source's {_show(src.paths[s.leaf])}{where}, but their names within "
                    "the layer differ. NNX orders state by attribute name: keep the loop's "
                    "attribute names in the port (`self.layers = Stack(...)` where upstream "
                    "had `self.layers = [...]`), or convert by name with "
                    "`stackwise.nnx.from_loop` / `to_loop`."
                )


def convert(tree: Any, source: Any, target: Any) -> Any:
    """One model's state in the layout of another, matched in NNX's graph order.

    Porting a model onto a :class:`Stack` keeps its blocks and attribute
    names: upstream ``self.layers = [Block(...) for _ in range(n)]`` (state
    ``layers.0.attn...``, ``layers.1.attn...``) becomes ``self.layers =
    stackwise.nnx.Stack(lambda rngs: Block(...), n, rngs=rngs)`` (state
    ``layers.layers.attn...`` with a leading axis n). ``convert`` walks both
    models' state in NNX's order (by attribute name, lists by index; a
    Stack's block layer by layer) and moves the k-th leaf of the source to
    the k-th of the target, checking that they agree in module class,
    variable name, path within the layer, shape and dtype. It works both ways.

    A pattern Stack (``Stack([Local, Local, Global], n)``) takes the loop's
    layer i into position ``i % k``, whatever order it runs its positions in;
    a loop layer of another position's kind of block (its class among the
    modules around the variable) is refused, even with alike variables.

    >>> import jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.norm = nnx.LayerNorm(4, rngs=rngs)
    ...         self.linear = nnx.Linear(4, 4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return x + self.linear(self.norm(x))
    >>> class Loop(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([Block(rngs) for _ in range(3)])
    ...         self.final_norm = nnx.LayerNorm(4, rngs=rngs)
    ...     def __call__(self, x):
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return self.final_norm(x)
    >>> class Port(Loop):
    ...     def __init__(self, rngs):
    ...         self.layers = stackwise.nnx.Stack(Block, 3, rngs=rngs)
    ...         self.final_norm = nnx.LayerNorm(4, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.final_norm(self.layers(x))
    >>> loop = Loop(nnx.Rngs(0))
    >>> port = nnx.eval_shape(lambda: Port(nnx.Rngs(1)))
    >>> nnx.update(port, stackwise.nnx.convert(nnx.state(loop), loop, port))
    >>> x = jnp.ones((2, 4))
    >>> bool(jnp.allclose(port(x), loop(x), atol=1e-6))
    True
    >>> back = stackwise.nnx.convert(nnx.state(port), port, loop)
    >>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, nnx.state(loop)))
    True

    Args:
      tree: the source model's state: an ``nnx.State`` or a nested dict of
        arrays (``nnx.to_pure_dict``, e.g. a checkpoint).
      source: the model the state belongs to: an ``nnx.Module`` (abstract,
        from ``nnx.eval_shape``, is enough) or a function building it.
      target: the model to convert to, the same way.

    Returns:
      The target's state, of the input's kind (an ``nnx.State`` of the
      target's variables, or a nested dict); every array is the source's,
      bitwise (stacked or sliced). Load it with ``nnx.update(target, state)``.

    Raises:
      ValueError: the state is not the source's (the differing variables are
        listed), or the models do not correspond one to one (the first
        difference is shown).
      TypeError: a model that is neither a module nor a function.
    """
    who = "stackwise.nnx.convert"
    flat, is_state = _flat(tree, who)
    src, tgt = _Model(source, "source", who), _Model(target, "target", who)
    src.check(flat)
    hint = "Models whose state differs in names convert by name with `from_loop` / `to_loop`."
    sources = _convert.correspond(src.leaves, tgt.leaves, who, hint)
    _check_names(src, tgt, sources, who)
    values = [_raw(flat[p]) for p in src.paths]
    out = {}
    for path, value in zip(tgt.paths, _convert.assemble(tgt.leaves, sources, values)):
        out[path] = tgt.flat[path].copy(value) if is_state else value
    return _unflat(out, is_state)
