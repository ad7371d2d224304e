"""Optax transformations that see the layers of stacked params.

A stacked leaf of shape ``(n, d, f)`` holds n layers' ``(d, f)`` weights. An optimizer that
only adds and multiplies (Adam, SGD, Lion) treats it as the loop model's n leaves; one that
looks at a leaf's shape or norm (LAMB, LARS, Adafactor, Muon, adaptive gradient clipping)
would treat the n layers as one matrix. :func:`layerwise` makes any
``optax.GradientTransformation`` give the loop model's updates:

- an ``optax.chain`` is split into its parts (optax's ``chain``, ``transforms/_combining.py``,
  keeps them in its ``update_fn``'s closure as ``init_fns`` / ``update_fns``; every optax
  alias such as ``lamb`` or ``adamw`` is such a chain), and each part is wrapped on its own,
  so that ``chain(clip_by_global_norm(1.0), lamb(1e-3))`` clips by the global norm and runs
  only the trust ratio per layer;
- each part is classified by the dataflow of one layer's view of its ``update`` (see
  ``_classify.py``): **elementwise** parts run as they are (the same program as unwrapped);
  **per-leaf** parts run per layer, ``jax.vmap`` ped over the layer axes of the stacked leaves
  with their optimizer state stacked the same way, while the shared state (the step count,
  ``inject_hyperparams``' hyperparameters) stays as it is; parts that **mix leaves** are
  ``clip_by_global_norm`` (its norm over all elements is the loop's norm: run as it is) or
  anything else, which runs on the loop model's own tree (each stacked leaf unstacked into its
  n layers, then restacked): exact, at the cost of a program that grows with n.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stackwise.optax._classify import Program

__all__ = ["layer_decay", "layer_mask", "layerwise", "muon_dimensions"]

_WHERE = "stackwise.optax.layerwise"

# Whole-tree transformations whose reductions run over every element of the tree, however
# the elements are grouped into leaves: on stacked leaves they compute the loop's value.
# optax/transforms/_clipping.py, `clip_by_global_norm`: `g_norm = optax.tree.norm(updates)`.
_WHOLE_TREE = frozenset(["clip_by_global_norm.<locals>.update_fn"])

# The update functions of the transformations made here: they already see the layers, so a
# `layerwise` around them (or around a chain holding them) leaves them as they are.
_LAYER_AWARE: weakref.WeakSet = weakref.WeakSet()


def _aware(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    _LAYER_AWARE.add(tx.update)
    return tx


# What `stacked=` may be: as in `stackwise.fsdp_specs`, plus an int (how many leading layer
# axes: 2 for a stack of stacks).
Which = bool | int | Callable[[str], Any] | Any


# --------------------------------------------------------------------------- which leaves


def _depth_of(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | np.integer) and value >= 0:
        return int(value)
    raise TypeError(
        f"{where}: `stacked` must give each leaf a bool (True: one layer axis first) or an "
        f"int >= 0 (the number of leading layer axes, 2 for a stack of stacks); leaf {name} "
        f"got {value!r}."
    )


def _depths(stacked: Which, tree: Any, where: str) -> list[int]:
    """The number of leading layer axes of each flat leaf of ``tree``, checked."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    names = [jax.tree_util.keystr(p) or "<root>" for p, _ in pairs]
    if isinstance(stacked, bool | int | np.integer):
        depths = [_depth_of(stacked, n, where) for n in names]
    elif callable(stacked):
        depths = [_depth_of(stacked(jax.tree_util.keystr(p)), n, where)
                  for (p, _), n in zip(pairs, names)]
    else:
        try:
            flags = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub),
                                 stacked, tree)
        except (ValueError, TypeError):
            raise ValueError(
                f"{where}: `stacked` must be True, False, an int, a tree prefix of the params "
                "with a bool or int per subtree (e.g. `{'embed': False, 'blocks': True}`) or a "
                "function of a leaf's path (`jax.tree_util.keystr`); its structure does not "
                "match the params':\n"
                f"  stacked: {jax.tree_util.tree_structure(stacked)}\n"
                f"  params:  {jax.tree_util.tree_structure(tree)}"
            ) from None
        depths = [_depth_of(f, n, where) for f, n in zip(jax.tree.leaves(flags), names)]
    for (_, leaf), name, d in zip(pairs, names, depths):
        if d and np.ndim(leaf) < d:
            raise ValueError(
                f"{where}: leaf {name} has shape {tuple(np.shape(leaf))}, but `stacked` says it "
                f"has {d} leading layer axes. Mark only the stacked leaves (e.g. "
                "`stacked=lambda path: 'blocks' in path`), or give the right depth."
            )
    return depths


# --------------------------------------------------------------------------- one layer's view


def _view(leaf: Any, depth: int) -> Any:
    """One layer's slice of a leaf (abstract, as a ShapeDtypeStruct)."""
    return jax.ShapeDtypeStruct(tuple(leaf.shape)[depth:], leaf.dtype)


def _first(leaf: Any, depth: int) -> Any:
    """Layer 0 of a leaf (a stand-in for the leaves of other groups; its results are unused)."""
    return leaf[(0,) * depth] if depth else leaf


def _origin(fn: Any) -> str:
    """The qualified name of an update function, seen through ``with_extra_args_support``."""
    name = getattr(fn, "__qualname__", "")
    if name == "with_extra_args_support.<locals>.update" and fn.__closure__:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        inner = cells.get("tx")
        if inner is not None:
            return _origin(inner.update)
    return name


def _chain_parts(tx: Any) -> list | None:
    """The parts of an ``optax.chain`` (read from its update function's closure), or None."""
    fn = tx.update
    if getattr(fn, "__qualname__", "") != "chain.<locals>.update_fn" or not fn.__closure__:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    init_fns = cells.get("init_fns")
    update_fns = cells.get("update_fns")
    if init_fns is None:
        init_fns = tx.init.__closure__ and dict(
            zip(tx.init.__code__.co_freevars, (c.cell_contents for c in tx.init.__closure__))
        ).get("init_fns")
    if init_fns is None or update_fns is None or len(init_fns) != len(update_fns):
        return None
    return [optax.GradientTransformationExtraArgs(i, u) for i, u in zip(init_fns, update_fns)]


class _Plan:
    """How one (non-chain) transformation runs on a tree: 'direct', 'vmap' or 'loop'."""

    def __init__(self, tx, updates: Any, params: Any, depths: list[int], extra: dict):
        leaves, self.treedef = jax.tree.flatten(updates)
        self.depths = depths
        self.n_leaves = len(leaves)
        self.stacked = frozenset(i for i, d in enumerate(depths) if d)
        template = params if params is not None else updates
        p_leaves = jax.tree.leaves(template)
        view = lambda ls: jax.tree.unflatten(  # noqa: E731
            self.treedef, [_view(a, d) for a, d in zip(ls, depths)]
        )
        u_view, p_view = view(leaves), view(p_leaves)
        state_view = jax.eval_shape(tx.init, p_view)
        s_leaves, self.state_treedef = jax.tree.flatten(state_view)
        self.state_view = s_leaves
        self.owner: list[int | None] = [None] * len(s_leaves)
        if not self.stacked:
            self.kind = "direct"
            return
        if _origin(tx.update) in _WHOLE_TREE:
            self.kind = "direct"
            return
        with_params = params is not None

        def one_layer(u, s, p, e):
            new_u, new_s = tx.update(u, s, p if with_params else None, **e)
            return jax.tree.leaves(new_u), jax.tree.leaves(new_s)

        program = Program(one_layer, (u_view, state_view, p_view, extra))
        n, m = self.n_leaves, len(s_leaves)
        n_extra = len(jax.tree.leaves(extra))
        mine = [frozenset([i]) for i in range(n)]
        state_labels = [frozenset()] * m
        for _ in range(8):  # state labels: a fixpoint over steps (a few iterations)
            labels = mine + state_labels + mine + [frozenset()] * n_extra
            outs, elementwise = program.run(labels, self.stacked)
            new_state = [a | b for a, b in zip(state_labels, outs[n:])]
            if new_state == state_labels:
                break
            state_labels = new_state
        u_out = outs[:n]
        mixing = any(not labels <= {i} and (labels | {i}) & self.stacked
                     for i, labels in enumerate(u_out))
        mixing |= any(len(labels) > 1 and labels & self.stacked for labels in state_labels)
        if mixing:
            self.kind = "loop"
            return
        self.owner = [next(iter(lb)) if lb and lb <= self.stacked else None
                      for lb in state_labels]
        self.kind = "direct" if elementwise else "vmap"

    def groups(self, leaves: list) -> dict[tuple, list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i in sorted(self.stacked):
            groups.setdefault(tuple(leaves[i].shape[: self.depths[i]]), []).append(i)
        return groups


def _vmap_n(fn, depth: int, out_axes) -> Callable:
    for _ in range(depth):
        fn = jax.vmap(fn, in_axes=0, out_axes=out_axes)
    return fn


def _run_vmapped(plan: _Plan, tx, updates, state, params, extra):
    u_leaves = jax.tree.leaves(updates)
    p_leaves = jax.tree.leaves(params) if params is not None else None
    s_leaves = jax.tree.leaves(state)
    _check_state(plan, s_leaves, u_leaves)
    owner = plan.owner
    depths = plan.depths
    s_depth = [depths[o] if o is not None else 0 for o in owner]
    unstacked = [i for i in range(plan.n_leaves) if i not in plan.stacked]
    shared = [j for j, o in enumerate(owner) if o is None]
    out_u: list[Any] = [None] * len(u_leaves)
    out_s: list[Any] = [None] * len(s_leaves)
    for k, (layer_shape, idxs) in enumerate(plan.groups(u_leaves).items()):
        mine = set(idxs)
        s_idx = [j for j, o in enumerate(owner) if o in mine]

        def body(bu, bp, bs, idxs=idxs, s_idx=s_idx, mine=mine):
            us = [_first(a, d) if d and i not in mine else a
                  for i, (a, d) in enumerate(zip(u_leaves, depths))]
            ss = [_first(a, d) if d and owner[j] not in mine else a
                  for j, (a, d) in enumerate(zip(s_leaves, s_depth))]
            ps = None
            if p_leaves is not None:
                ps = [_first(a, d) if d and i not in mine else a
                      for i, (a, d) in enumerate(zip(p_leaves, depths))]
                for i, a in zip(idxs, bp):
                    ps[i] = a
                ps = jax.tree.unflatten(plan.treedef, ps)
            for i, a in zip(idxs, bu):
                us[i] = a
            for j, a in zip(s_idx, bs):
                ss[j] = a
            new_u, new_s = tx.update(jax.tree.unflatten(plan.treedef, us),
                                     jax.tree.unflatten(plan.state_treedef, ss), ps, **extra)
            fu, fs = jax.tree.leaves(new_u), jax.tree.leaves(new_s)
            return ([fu[i] for i in idxs], [fs[j] for j in s_idx],
                    [fu[i] for i in unstacked], [fs[j] for j in shared])

        bp = [p_leaves[i] for i in idxs] if p_leaves is not None else []
        res = _vmap_n(body, len(layer_shape), (0, 0, None, None))(
            [u_leaves[i] for i in idxs], bp, [s_leaves[j] for j in s_idx])
        for i, a in zip(idxs, res[0]):
            out_u[i] = a
        for j, a in zip(s_idx, res[1]):
            out_s[j] = a
        if k == 0:
            for i, a in zip(unstacked, res[2]):
                out_u[i] = a
            for j, a in zip(shared, res[3]):
                out_s[j] = a
    return (jax.tree.unflatten(plan.treedef, out_u),
            jax.tree.unflatten(plan.state_treedef, out_s))


def _init_vmapped(plan: _Plan, tx, params):
    p_leaves = jax.tree.leaves(params)
    owner, depths = plan.owner, plan.depths
    shared = [j for j, o in enumerate(owner) if o is None]
    out_s: list[Any] = [None] * len(plan.state_view)
    for k, (layer_shape, idxs) in enumerate(plan.groups(p_leaves).items()):
        mine = set(idxs)
        s_idx = [j for j, o in enumerate(owner) if o in mine]

        def body(bp, idxs=idxs, s_idx=s_idx, mine=mine):
            ps = [_first(a, d) if d and i not in mine else a
                  for i, (a, d) in enumerate(zip(p_leaves, depths))]
            for i, a in zip(idxs, bp):
                ps[i] = a
            fs = jax.tree.leaves(tx.init(jax.tree.unflatten(plan.treedef, ps)))
            return [fs[j] for j in s_idx], [fs[j] for j in shared]

        res = _vmap_n(body, len(layer_shape), (0, None))([p_leaves[i] for i in idxs])
        for j, a in zip(s_idx, res[0]):
            out_s[j] = _like(a, p_leaves[owner[j]])
        if k == 0:
            for j, a in zip(shared, res[1]):
                out_s[j] = a
    return jax.tree.unflatten(plan.state_treedef, out_s)


def _like(state_leaf: Any, param: Any) -> Any:
    """A stacked state leaf of its param's shape gets its param's sharding (e.g. FSDP)."""
    if tuple(state_leaf.shape) != tuple(param.shape):
        return state_leaf
    sharding = getattr(jax.typeof(param), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(e is None for e in spec):
        if isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer):
            return jax.device_put(state_leaf, param.sharding)
        return state_leaf
    return jax.sharding.reshard(state_leaf, sharding)


def _check_state(plan: _Plan, s_leaves: list, u_leaves: list) -> None:
    if len(s_leaves) != len(plan.state_view):
        raise ValueError(
            f"{_WHERE}: the optimizer state has {len(s_leaves)} leaves where this "
            f"transformation's state has {len(plan.state_view)}; pass the state that the same "
            "wrapped optimizer's `init` made."
        )
    for j, (a, v) in enumerate(zip(s_leaves, plan.state_view)):
        o = plan.owner[j]
        want = (tuple(u_leaves[o].shape[: plan.depths[o]]) if o is not None else ()) + v.shape
        if tuple(np.shape(a)) != want:
            raise ValueError(
                f"{_WHERE}: optimizer state leaf {j} has shape {tuple(np.shape(a))}, expected "
                f"{want} (one layer's state {v.shape}, stacked like its leaf). Make the state "
                "with the wrapped optimizer's `init`, not the unwrapped one's."
            )


# --------------------------------------------------------------------------- the loop view


def _to_loop(leaves: list, depths: list[int]) -> list:
    def split(a, d):
        if not d:
            return a
        return [split(a[i], d - 1) for i in range(a.shape[0])]

    return [split(a, d) for a, d in zip(leaves, depths)]


def _from_loop(sub: Any, depth: int) -> Any:
    if not depth:
        return sub
    return jnp.stack([_from_loop(s, depth - 1) for s in sub])


def _loop_tree(tree: Any, treedef, depths: list[int]) -> Any:
    return jax.tree.unflatten(treedef, _to_loop(jax.tree.leaves(tree), depths))


# --------------------------------------------------------------------------- the wrapper


def _single(tx: Any, stacked: Which) -> optax.GradientTransformationExtraArgs:
    tx = optax.with_extra_args_support(tx)

    def init_fn(params):
        depths = _depths(stacked, params, _WHERE)
        plan = _Plan(tx, params, params, depths, {})
        if plan.kind == "direct":
            return tx.init(params)
        if plan.kind == "loop":
            return tx.init(_loop_tree(params, plan.treedef, depths))
        return _init_vmapped(plan, tx, params)

    def update_fn(updates, state, params=None, **extra):
        depths = _depths(stacked, updates, _WHERE)
        plan = _Plan(tx, updates, params, depths, extra)
        if plan.kind == "direct":
            return tx.update(updates, state, params, **extra)
        if plan.kind == "loop":
            loop_p = None if params is None else _loop_tree(params, plan.treedef, depths)
            new_u, state = tx.update(_loop_tree(updates, plan.treedef, depths), state, loop_p,
                                     **extra)
            subs = plan.treedef.flatten_up_to(new_u)
            return jax.tree.unflatten(
                plan.treedef, [_from_loop(s, d) for s, d in zip(subs, depths)]), state
        return _run_vmapped(plan, tx, updates, state, params, extra)

    return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _wrap(tx: Any, stacked: Which) -> optax.GradientTransformationExtraArgs:
    if tx.update in _LAYER_AWARE:
        return optax.with_extra_args_support(tx)
    parts = _chain_parts(tx)
    if parts is None:
        return _single(tx, stacked)
    return _aware(optax.chain(*(_wrap(p, stacked) for p in parts)))


def _check_transform(tx: Any, where: str, arg: str) -> None:
    if not (isinstance(tx, tuple) and callable(getattr(tx, "init", None))
            and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{where}: `{arg}` must be an optax.GradientTransformation (e.g. "
            f"`optax.lamb(1e-3)`), got {type(tx).__name__}: {tx!r:.80}. Call the optimizer's "
            "factory: `optax.adam(1e-3)`, not `optax.adam`."
        )


def _layer_values(values: Any, leaf: Any, depth: int, name: str, where: str, arg: str):
    """``values`` (one per layer) shaped to broadcast against ``leaf``'s layer axes."""
    layer_shape = tuple(leaf.shape[:depth])
    n = math.prod(layer_shape)
    if values.shape != (n,):
        raise ValueError(
            f"{where}: `{arg}` gives {values.shape[0]} values, one per layer, but leaf {name} "
            f"has {n} layers (layer axes {layer_shape}). Give one value per layer of the "
            "stack; for a pattern (positions with different numbers of layers), wrap each "
            "position's params separately."
        )
    return jnp.asarray(values).reshape(layer_shape + (1,) * (leaf.ndim - depth))


def _layer_set(layers: Any, where: str, arg: str) -> tuple[int, ...]:
    if isinstance(layers, int | np.integer) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        out = tuple(layers)
    except TypeError:
        raise TypeError(
            f"{where}: `{arg}` must be a collection of layer indices, e.g. `{arg}=range(2)`, "
            f"got {layers!r}."
        ) from None
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int | np.integer) or i < 0:
            raise TypeError(
                f"{where}: `{arg}` must hold layer indices (ints >= 0), got {i!r} in {layers!r}."
            )
    return tuple(int(i) for i in out)


def _rows(tree: Any, depths: list[int], fn) -> list:
    """Per flat leaf: ``fn(name, leaf, depth)`` for a stacked leaf, None for the others."""
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    return [fn(jax.tree_util.keystr(p) or "<root>", a, d) if d else None
            for (p, a), d in zip(pairs, depths)]


def _map_rows(fn, rows: list, *trees) -> Any:
    """``fn(row, *leaves)`` on the stacked leaves of ``trees``; the first tree's leaf elsewhere."""
    flat = [jax.tree.leaves(t) for t in trees]
    out = [a[0] if r is None else fn(r, *a) for r, a in zip(rows, zip(*flat))]
    return jax.tree.unflatten(jax.tree.structure(trees[0]), out)


def _selected(layers: tuple[int, ...], where: str, arg: str):
    def mask(name, leaf, depth):
        n = math.prod(leaf.shape[:depth])
        bad = [i for i in layers if i >= n]
        if bad:
            raise ValueError(
                f"{where}: `{arg}` names layers {bad}, but leaf {name} has {n} layers "
                f"(0 to {n - 1})."
            )
        return _layer_values(np.isin(np.arange(n), layers), leaf, depth, name, where, arg)

    return mask


def layerwise(
    transform: optax.GradientTransformation,
    stacked: Which = True,
    *,
    freeze: Sequence[int] | None = None,
    lr_scale: Sequence[float] | np.ndarray | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``transform`` applied to stacked params as the loop model's layers would get it.

    The loop this replaces, and the stacked equivalent:

    >>> import jax, jax.numpy as jnp, optax, stackwise, stackwise.optax
    >>> loop = [{"w": jnp.full((3, 3), i + 1.0)} for i in range(4)]   # 4 layers
    >>> grads = [{"w": jnp.eye(3) * (i + 1.0)} for i in range(4)]
    >>> lamb = optax.lamb(1e-2)
    >>> u_loop, _ = lamb.update(grads, lamb.init(loop), loop)
    >>> params, g = stackwise.stack_layers(loop), stackwise.stack_layers(grads)
    >>> tx = stackwise.optax.layerwise(optax.lamb(1e-2))
    >>> u, _ = tx.update(g, tx.init(params), params)
    >>> bool(jnp.allclose(u["w"], stackwise.stack_layers(u_loop)["w"]))
    True

    Unwrapped, ``lamb`` would compute one trust ratio over all four layers. A whole model's
    params mix stacked leaves with others: ``stacked`` says which are which, as for
    :func:`stackwise.fsdp_specs`. Freezing the first two layers, and layer-wise learning-rate
    decay:

    >>> model = {"embed": jnp.ones((5, 3)), "blocks": params}
    >>> tx = stackwise.optax.layerwise(optax.adam(1e-2), {"embed": False, "blocks": True},
    ...                                freeze=[0, 1],
    ...                                lr_scale=stackwise.optax.layer_decay(0.5, 4))
    >>> state = tx.init(model)
    >>> grads = jax.tree.map(jnp.ones_like, model)
    >>> u, state = tx.update(grads, state, model)
    >>> [round(float(v), 6) for v in u["blocks"]["w"][:, 0, 0]]
    [0.0, 0.0, -0.005, -0.01]

    Args:
      transform: any optax gradient transformation (chains, aliases such as
        ``optax.lamb``, ``optax.inject_hyperparams(...)``, ``optax.contrib.muon``).
      stacked: which leaves have layer axes first: ``True`` (all), ``False``, an int
        (how many leading layer axes: 2 for a stack of stacks), a tree prefix of the
        params with a bool or int per subtree, or a function of a leaf's path
        (``jax.tree_util.keystr``); see :func:`stackwise.optax.stacked_in` for NNX and
        Equinox models.
      freeze: layer indices whose params do not move: their gradients enter the
        optimizer as zeros (so a global norm leaves them out, as
        ``optax.multi_transform`` with ``optax.set_to_zero()`` for them does) and their
        updates are zero, bitwise.
      lr_scale: one factor per layer multiplying its updates (e.g.
        :func:`layer_decay`), as ``optax.chain(transform, optax.scale(s_i))`` for layer i.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Its state has the structure of
      ``transform``'s (so ``state.hyperparams`` of ``inject_hyperparams`` is where it was),
      with the per-layer state of per-layer parts stacked like their leaves.

    Raises:
      TypeError: ``transform`` is not a gradient transformation, or ``stacked``,
        ``freeze`` or ``lr_scale`` have the wrong type.
      ValueError: ``stacked`` does not match the params, or ``freeze`` / ``lr_scale``
        do not match a stacked leaf's number of layers.
    """
    _check_transform(transform, _WHERE, "transform")
    core = _wrap(transform, stacked)
    frozen = None if freeze is None else _layer_set(freeze, _WHERE, "freeze")
    scales = None
    if lr_scale is not None:
        scales = np.asarray(lr_scale)
        if scales.ndim != 1 or not np.issubdtype(scales.dtype, np.number):
            raise TypeError(
                f"{_WHERE}: `lr_scale` must be a vector of numbers, one per layer (e.g. "
                f"`stackwise.optax.layer_decay(0.8, n)`), got {lr_scale!r}."
            )
    if frozen is None and scales is None:
        return core

    def update_fn(updates, state, params=None, **extra):
        depths = _depths(stacked, updates, _WHERE)
        zero = lambda k, a: jnp.where(k, jnp.zeros_like(a), a)  # noqa: E731
        if frozen is not None:
            is_frozen = _rows(updates, depths, _selected(frozen, _WHERE, "freeze"))
            updates = _map_rows(zero, is_frozen, updates)
        updates, state = core.update(updates, state, params, **extra)
        if scales is not None:
            factors = _rows(updates, depths, lambda name, a, d: _layer_values(
                scales, a, d, name, _WHERE, "lr_scale"))
            updates = _map_rows(lambda f, a: (a * f).astype(a.dtype), factors, updates)
        if frozen is not None:
            updates = _map_rows(zero, is_frozen, updates)
        return updates, state

    return _aware(optax.GradientTransformationExtraArgs(core.init, update_fn))


def layer_mask(
    transform: optax.GradientTransformation,
    layers: Sequence[int],
    stacked: Which = True,
) -> optax.GradientTransformationExtraArgs:
    """``transform`` on the given layers of stacked leaves only (``optax.masked`` by layer).

    Weight decay on layers 2 and 3 of 4, nothing on the others:

    >>> import jax.numpy as jnp, optax, stackwise.optax
    >>> params = {"w": jnp.ones((4, 2))}
    >>> tx = stackwise.optax.layer_mask(optax.add_decayed_weights(0.1), layers=[2, 3])
    >>> u, _ = tx.update({"w": jnp.zeros((4, 2))}, tx.init(params), params)
    >>> u["w"][:, 0].tolist()
    [0.0, 0.0, 0.10000000149011612, 0.10000000149011612]

    The other layers' updates pass through unchanged, and their gradients enter
    ``transform`` as zeros (a global norm leaves them out, as ``optax.masked`` does); leaves
    without layer axes pass through unchanged. ``transform`` is wrapped by
    :func:`layerwise`; use the result inside a chain, e.g.
    ``optax.chain(optax.scale_by_adam(), layer_mask(optax.add_decayed_weights(1e-4),
    range(2, n)), optax.scale(-lr))``.

    Args:
      transform: the optax gradient transformation to apply on ``layers``.
      layers: layer indices.
      stacked: which leaves have layer axes first, as for :func:`layerwise`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``transform``'s state.

    Raises:
      TypeError: ``transform`` is not a gradient transformation, or ``layers`` is not a
        collection of ints.
      ValueError: ``layers`` names a layer a stacked leaf does not have.
    """
    where = "stackwise.optax.layer_mask"
    _check_transform(transform, where, "transform")
    chosen = _layer_set(layers, where, "layers")
    core = layerwise(transform, stacked)

    def update_fn(updates, state, params=None, **extra):
        depths = _depths(stacked, updates, where)
        is_on = _rows(updates, depths, _selected(chosen, where, "layers"))
        inside = jax.tree.map(jnp.zeros_like, updates)
        inside = _map_rows(lambda k, a, _: jnp.where(k, a, jnp.zeros_like(a)), is_on, updates,
                           inside)
        new, state = core.update(inside, state, params, **extra)
        return _map_rows(lambda k, a, b: jnp.where(k, b, a), is_on, updates, new), state

    return _aware(optax.GradientTransformationExtraArgs(core.init, update_fn))


def layer_decay(decay: float, n: int) -> np.ndarray:
    """Layer-wise learning-rate decay: ``decay ** (n - 1 - i)`` for layer i of n.

    >>> import stackwise.optax
    >>> stackwise.optax.layer_decay(0.5, 4).tolist()
    [0.125, 0.25, 0.5, 1.0]

    Args:
      decay: the factor between consecutive layers, in (0, 1].
      n: the number of layers.

    Returns:
      A float32 vector of n scales (the last layer 1), for ``layerwise(lr_scale=...)``.

    Raises:
      TypeError: ``n`` is not a positive int.
      ValueError: ``decay`` is not in (0, 1].
    """
    where = "stackwise.optax.layer_decay"
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise TypeError(f"{where}: `n` must be a positive int (the number of layers), got {n!r}.")
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ValueError(
            f"{where}: `decay` must be a number in (0, 1] (e.g. 0.8), got {decay!r}."
        )
    return (float(decay) ** (n - 1 - np.arange(n))).astype(np.float32)


def muon_dimensions(stacked: Which = True) -> Callable[[Any], Any]:
    """``muon_weight_dimension_numbers`` for stacked params: the layer axes as batch axes.

    ``optax.contrib.muon`` orthogonalises 2-D leaves and gives the others AdamW; with these
    dimension numbers it orthogonalises each layer's matrix of a stacked leaf (the loop
    model's rule: a leaf whose one layer is 2-D), in one batch, without :func:`layerwise`:

    >>> import jax.numpy as jnp, optax, stackwise.optax
    >>> params = {"w": jnp.ones((4, 8, 16)), "b": jnp.ones((4, 16)), "embed": jnp.ones((9, 8))}
    >>> stacked = {"w": True, "b": True, "embed": False}
    >>> dims = stackwise.optax.muon_dimensions(stacked)
    >>> dims(params)["w"]
    MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))
    >>> dims(params)["b"] is None, dims(params)["embed"]
    (True, MuonDimensionNumbers(reduction_axis=(0,), output_axis=(1,)))
    >>> tx = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    >>> state = tx.init(params)

    Pass the result to ``muon`` itself, not to ``layerwise(muon(...))``: ``layerwise`` runs
    Muon per layer by ``vmap`` and needs no dimension numbers, but on CPU its step was slower
    (``benchmarks/results/optimizer_step.md``: ``vmap`` over Muon's own size-1 batch adds
    layout copies to every Newton-Schulz iteration).

    Args:
      stacked: which leaves have layer axes first, as for :func:`layerwise`.

    Returns:
      A function of the params giving a ``MuonDimensionNumbers`` (or ``None``: AdamW) per
      leaf.
    """
    dims_type = optax.contrib.MuonDimensionNumbers

    def dimensions(params):
        depths = _depths(stacked, params, "stackwise.optax.muon_dimensions")
        leaves, treedef = jax.tree.flatten(params)
        out = [dims_type(reduction_axis=(d,), output_axis=(d + 1,)) if a.ndim - d == 2
               else None for a, d in zip(leaves, depths)]
        return jax.tree.unflatten(treedef, out)

    return dimensions
