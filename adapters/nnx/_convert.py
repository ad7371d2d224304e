"""Exact conversions by name between an NNX Stack's state and other layouts.

An ``nnx.Module`` holds its state, so most moves are one ``nnx.update``
away: :meth:`Stack.from_layers` / :meth:`Stack.to_layers` stack built blocks
and split them again. The functions here convert *state* (an ``nnx.State``,
or the nested dict ``nnx.to_pure_dict`` gives), as checkpoints hold it:

- :func:`from_loop` / :func:`to_loop`: the layers of a loop (``layers[i]``,
  ``layer_{i}``, any naming), found by name (with a pattern of k blocks too);
- :func:`from_scan` / :func:`to_scan`: a block built with ``nnx.vmap`` and run
  with ``nnx.scan`` (its variables stacked along an axis).

:func:`stackwise.nnx.convert`, which matches two whole models leaf by leaf in
NNX's graph order, is in ``_correspond.py``; it shares :func:`flatten`,
:func:`unflatten`, :func:`show`, :func:`raw_value` and :data:`BLOCK` with
this module.

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

from stackwise import _kit

__all__ = [
    "BLOCK",
    "flatten",
    "from_loop",
    "from_scan",
    "raw_value",
    "show",
    "to_loop",
    "to_scan",
    "unflatten",
]

Path = str | tuple[str | int, ...]
Names = str | Sequence[Path] | Callable[[int], Path]

BLOCK = "layers"  # the attribute of a Stack that holds the stacked block


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
        return [stack + (BLOCK,)], stack, False
    if not path:
        raise TypeError(
            f"{who}: a pattern's `path` lists its k positions (for a Stack at 'layers': "
            "['layers/layers/0', ..., 'layers/layers/{k-1}']); got []."
        )
    positions = [_parts(p, who) for p in path]
    _kit.check_distinct([show(p) for p in positions], who, sep=None)
    for i, a in enumerate(positions):
        for j, b in enumerate(positions):
            if i != j and b[: len(a)] == a:
                raise ValueError(f"{who}: position {j} ({show(b)}) lies inside position {i}.")
    return positions, _kit.common_prefix(positions)[:-1], True


def show(path: tuple) -> str:
    """``layers.0.kernel``: a state path, for messages."""
    return ".".join(map(str, path)) or "<root>"


def flatten(tree: Any, who: str) -> tuple[dict[tuple, Any], bool]:
    """``({path: leaf}, is_state)``: an ``nnx.State`` or a nested dict, flattened (a
    served Stack's variables refused: see :func:`refuse_served`)."""
    if isinstance(tree, nnx.State):
        flat = dict(nnx.to_flat_state(tree))
    elif isinstance(tree, Mapping):
        flat = traverse_util.flatten_dict(dict(tree))
    if isinstance(tree, (nnx.State, Mapping)):
        refuse_served(flat, who)
        return flat, isinstance(tree, nnx.State)
    raise TypeError(
        f"{who}: `tree` must be an `nnx.State` (e.g. `nnx.state(model)`) or a nested dict "
        f"of arrays (`nnx.to_pure_dict`), got {type(tree).__name__}."
    )


def refuse_served(flat: dict[tuple, Any], who: str) -> None:
    """Refuses a state (or a model's) holding a served Stack's variables
    (``stackwise.Serving`` values): ``who`` converts stacked ones."""
    for path, v in flat.items():
        if _kit.serving.served(raw_value(v)):
            raise TypeError(
                f"{who}: `{show(path)}` is in the serving layout (a `stackwise.Serving`, from "
                f"`stackwise.nnx.to_serving`), but {who} takes a Stack's stacked variables. "
                "Stack the model's served Stacks back first, `model = "
                "stackwise.nnx.from_serving(model, path)`, and take its state again "
                "(`nnx.state(model)`)."
            )


def unflatten(flat: dict[tuple, Any], is_state: bool) -> Any:
    """The inverse of :func:`flatten`: an ``nnx.State`` or a nested dict."""
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
            f"{who}: {show(prefix)} already exists in the state; stackwise never "
            "overwrites an entry. Remove it first, or convert to another path or names."
        )
    for rest, v in leaves.items():
        flat[prefix + rest] = v


# --------------------------------------------------------------------------
# Variables: values and the layer axis in `out_sharding`.


def raw_value(v: Any) -> Any:
    """A variable's array (anything else as it is)."""
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
                f"{who}: variable {show(prefix + rest)} has out_sharding {tuple(spec)}, "
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
    label = lambda j: f"layer {index_of(j)} ({show(prefix_of(j))})"  # noqa: E731
    for i, layer in enumerate(layers[1:], 1):
        for rest in sorted(set(first) & set(layer), key=str):
            if _meta(first[rest]) != _meta(layer[rest]):
                raise ValueError(
                    f"{who}: variable {show(prefix_of(i) + rest)} has type and metadata "
                    f"{_meta(layer[rest])} but {label(0)} has {_meta(first[rest])}; the "
                    "stacked variable keeps one, so the layers must agree."
                )
    values = _kit.stack_exact(
        [{show(r): raw_value(v) for r, v in layer.items()} for layer in layers],
        who,
        label=label,
        leaf_name=lambda s: f"{s[2:-2]} (in each layer)",
    )
    return {r: _with(v, values[show(r)], lambda s: (axis_name, *s)) for r, v in first.items()}


# --------------------------------------------------------------------------
# By name: a loop's layers <-> a Stack's block.


def _names(names: Any, stack: tuple, who: str) -> Callable[[int], tuple]:
    if names is None:
        return lambda i: stack + (i,)
    name_of = _kit.layer_names(names, who, example="'layers/{}' or 'layer_{}'")
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
      TypeError: a state holding a served Stack's variables (``stackwise.nnx.to_serving``).
      ValueError: no layer found, a gap, more layers than ``n``, layers that
        differ in variables, shapes or metadata, or a Stack's block that
        already exists in the state.
      TypeError: a variable whose dtype differs between layers (never
        promoted), or a bad argument.
    """
    who = "stackwise.nnx.from_loop"
    flat, is_state = flatten(tree, who)
    positions, stack, _ = _positions(path, who)
    k = len(positions)
    n = _kit.check_n(n, who)
    name_of = _names(names, stack, who)

    def exists(i: int) -> bool:
        try:
            return _has(flat, name_of(i))
        except (IndexError, KeyError):
            return False

    fixed = len(names) if isinstance(names, (list, tuple)) else None
    label = lambda i: repr(show(name_of(i)))  # noqa: E731
    n = _kit.find_depth(exists, label, n, len(flat), who, fixed=fixed, pattern=k)
    prefixes = [name_of(i) for i in range(n)]
    _kit.check_distinct([p for p in prefixes], who, sep=None)
    for i, a in enumerate(prefixes):
        for j, b in enumerate(prefixes):
            if i != j and b[: len(a)] == a:
                raise ValueError(f"{who}: layer {j} ({show(b)}) lies inside layer {i}.")
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
    return unflatten(rest, is_state)


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
      TypeError: a state holding a served Stack's variables (``stackwise.nnx.to_serving``).
      ValueError: no Stack block at ``path`` (or a pattern's block given as
        one path), leaves without a common leading axis, positions whose
        depths no n gives, variables under a pattern Stack at none of the
        positions, two layers of one name, or a layer that already exists.
    """
    who = "stackwise.nnx.to_loop"
    flat, is_state = flatten(tree, who)
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
        raw = {show(r): raw_value(v) for r, v in inside.items()}
        depth = _kit.depth_of(raw, who, f"Stack block at {show(where)}")
        held[q] = (inside, _kit.unstack_exact(raw, depth))
    if not held:
        tops = sorted({show(p[:2]) for p in flat}, key=str)[:12]
        if not listed:
            raise ValueError(
                f"{who}: no Stack block at {show(positions[0])} (a Stack at {show(stack)} "
                f"keeps its block there); the state has {tops}."
            )
        raise ValueError(
            f"{who}: nothing at the pattern's positions "
            f"{[show(p) for p in positions]}; the state has {tops}."
        )
    rest = {p: v for p, v in flat.items() if not any(p[: len(w)] == w for w in positions)}
    if k > 1:
        common = stack + (positions[0][len(stack)],)
        left = sorted(show(p) for p in rest if p[: len(common)] == common)
        if left:
            raise ValueError(
                f"{who}: {left[:3]} lie in the Stack's {show(common)} but at none of the "
                f"pattern's positions {[show(p) for p in positions]}; they would be left "
                "behind, stacked. Check `path` (each position's path, in the pattern's order)."
            )
    span = _kit.pattern_depths({q: len(v[1]) for q, v in held.items()}, k, who)
    name_of = _names(names, stack, who)
    _kit.check_names_count(names, span, who, "the Stack holds")
    indices = sorted(q + j * k for q, (_, layers) in held.items() for j in range(len(layers)))
    prefixes = {i: name_of(i) for i in indices}
    _kit.check_distinct(list(prefixes.values()), who, sep=None)
    for q, (inside, layers) in held.items():
        for j, layer_values in enumerate(layers):
            layer = {r: _with(v, layer_values[show(r)], lambda s: s[1:]) for r, v in inside.items()}
            _put_all(rest, prefixes[q + j * k], layer, who)
    return unflatten(rest, is_state)


def _check_not_a_pattern(inside: dict[tuple, Any], where: tuple, who: str) -> None:
    """A pattern Stack's block is an ``nnx.List`` of its k positions: refuse to slice it as one."""
    tops = {r[0] for r in inside}
    if len(tops) > 1 and tops == set(range(len(tops))):
        k = len(tops)
        listed = [show(where + (p,)) for p in range(k)]
        raise ValueError(
            f"{who}: {show(where)} holds the {k} positions of a pattern Stack "
            f"({show(where + (0,))}, ...), not one stacked block. Pass them as a list: "
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
    flat, is_state = flatten(tree, who)
    where = _single(path, who)
    src_prefix, dst_prefix = (where, where + (BLOCK,)) if to_stack else (where + (BLOCK,), where)
    inside = _under(flat, src_prefix)
    if not inside:
        raise ValueError(
            f"{who}: nothing at {show(src_prefix)} to convert; the state has "
            f"{sorted({show(p[:2]) for p in flat}, key=str)[:12]}."
        )
    axes = _axes(variable_axes, who)
    rest = {p: v for p, v in flat.items() if p[: len(src_prefix)] != src_prefix}
    moved = {}
    for r, v in inside.items():
        axis = next((a for pred, a in axes if pred(r, v)), None)
        if axis is None:
            raise ValueError(
                f"{who}: variable {show(src_prefix + r)} ({type(v).__name__}) is matched by "
                "no int axis of `variable_axes`: a broadcast variable holds one copy for "
                "all layers, which a Stack cannot hold."
            )
        value = raw_value(v)
        src, dst = (axis, 0) if to_stack else (0, axis)
        if jnp.ndim(value) <= max(src, dst):
            raise ValueError(
                f"{who}: variable {show(src_prefix + r)} has shape {jnp.shape(value)}, "
                f"without axis {max(src, dst)}."
            )
        spec = v.get_metadata("out_sharding", None) if isinstance(v, nnx.Variable) else None
        if spec:
            spec, expected = list(spec), scan_axis_name if to_stack else layer_axis_name
            if spec[src] != expected:
                fix = "`scan_axis_name`" if to_stack else "`layer_axis_name`"
                raise ValueError(
                    f"{who}: variable {show(src_prefix + r)} has out_sharding {tuple(spec)}, "
                    f"whose axis {src} should be named {expected!r}; pass the name it was "
                    f"given as {fix}."
                )
            del spec[src]
            spec.insert(dst, layer_axis_name if to_stack else scan_axis_name)
        new = _kit.moveaxis(value, src, dst) if src != dst else value
        moved[r] = _with(v, new, lambda s, spec=spec: tuple(spec))
    _put_all(rest, dst_prefix, moved, who)
    return unflatten(rest, is_state)


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
      TypeError: a state holding a served Stack's variables (``stackwise.nnx.to_serving``).
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
