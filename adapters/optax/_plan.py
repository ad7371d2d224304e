"""How one (non-chain) transformation runs on stacked leaves: as it is, vmapped per layer, or
on the loop model's tree (each stacked leaf unstacked into its layers, then restacked).

:class:`Plan` classifies the transformation by the dataflow of one layer's view of its
``update`` (``_classify.py``); :func:`run_vmapped` / :func:`init_vmapped` run the per-leaf
parts per layer with their state stacked like their leaves; :func:`loop_tree` /
:func:`from_loop` give the loop view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from stackwise.optax import _upstream
from stackwise.optax._classify import Program, batched_alike

__all__ = ["Plan", "from_loop", "init_vmapped", "loop_tree", "run_vmapped", "view"]

_WHERE = "stackwise.optax.layerwise"


def _view(leaf: Any, depth: int) -> Any:
    """One layer's slice of a leaf (abstract, as a ShapeDtypeStruct); a Python number as JAX
    holds it (weakly typed)."""
    if not hasattr(leaf, "shape"):  # a Python number, whose dtype JAX picks
        return jax.eval_shape(lambda: jnp.asarray(leaf))
    return jax.ShapeDtypeStruct(tuple(leaf.shape)[depth:], leaf.dtype)


def _first(leaf: Any, depth: int) -> Any:
    """Layer 0 of a leaf (a stand-in for the leaves of other groups; its results are unused)."""
    return leaf[(0,) * depth] if depth else leaf


def view(tree: Any, depths: list[int]) -> Any:
    """One layer's view of a tree: each leaf abstract, its layer axes dropped."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [_view(a, d) for a, d in zip(leaves, depths)])


class Plan:
    """How one (non-chain) transformation runs on a tree: 'direct', 'vmap' or 'loop'."""

    def __init__(self, tx, updates: Any, params: Any, depths: list[int], extra: dict):
        leaves, self.treedef = jax.tree.flatten(updates)
        self.depths = depths
        self.n_leaves = len(leaves)
        self.stacked = frozenset(i for i, d in enumerate(depths) if d)
        template = params if params is not None else updates
        u_view, p_view = view(updates, depths), view(template, depths)
        state_view = jax.eval_shape(tx.init, p_view)
        s_leaves, self.state_treedef = jax.tree.flatten(state_view)
        self.state_view = s_leaves
        self.owner: list[int | None] = [None] * len(s_leaves)
        if not self.stacked:
            self.kind = "direct"
            return
        if _upstream.is_global_norm_clip(tx):  # its norm is over every element
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
        direct = elementwise and self._batched_alike(tx, one_layer, updates, template, extra,
                                                     (u_view, state_view, p_view))
        self.kind = "direct" if direct else "vmap"

    def _batched_alike(self, tx, one_layer, updates, template, extra, views) -> bool:
        """Whether ``tx`` run on the stacked tree is its per-layer program with layer axes
        added (``_classify.batched_alike``), for ``init`` and ``update``: no function inside
        it (a ``mask=``, a label function) decides by a leaf's shape otherwise than on one
        layer's leaves."""
        u_view, state_view, p_view = views
        leaves = jax.tree.leaves(updates)
        layers = {tuple(leaves[i].shape[: self.depths[i]]) for i in self.stacked}
        whole = [0] * self.n_leaves
        u_all, p_all = view(updates, whole), view(template, whole)
        if not batched_alike(tx.init, (p_view,), (p_all,), layers):
            return False
        s_all = jax.eval_shape(tx.init, p_all)
        return batched_alike(one_layer, (u_view, state_view, p_view, extra),
                             (u_all, s_all, p_all, extra), layers)

    def groups(self, leaves: list) -> dict[tuple, list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i in sorted(self.stacked):
            groups.setdefault(tuple(leaves[i].shape[: self.depths[i]]), []).append(i)
        return groups


def _vmap_n(fn, depth: int, out_axes) -> Callable:
    for _ in range(depth):
        fn = jax.vmap(fn, in_axes=0, out_axes=out_axes)
    return fn


def run_vmapped(plan: Plan, tx, updates, state, params, extra):
    u_leaves = jax.tree.leaves(updates)
    p_leaves = jax.tree.leaves(params) if params is not None else None
    s_leaves = jax.tree.leaves(state)
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


def init_vmapped(plan: Plan, tx, params):
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
    """A stacked state leaf of its param's shape gets its param's sharding (e.g. FSDP).

    Only a param placed on purpose (``committed``) passes its placement on: committing the
    state of an uncommitted param would change the jitted step's argument shardings after
    its first call, and every jitted function it feeds would compile a second time."""
    if tuple(state_leaf.shape) != tuple(param.shape):
        return state_leaf
    sharding = getattr(jax.typeof(param), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(e is None for e in spec):
        if (isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer)
                and param.committed):
            return jax.device_put(state_leaf, param.sharding)
        return state_leaf
    return jax.sharding.reshard(state_leaf, sharding)


# The loop view.


def _to_loop(leaves: list, depths: list[int]) -> list:
    def split(a, d):
        if not d:
            return a
        return [split(a[i], d - 1) for i in range(a.shape[0])]

    return [split(a, d) for a, d in zip(leaves, depths)]


def from_loop(sub: Any, depth: int) -> Any:
    if not depth:
        return sub
    return jnp.stack([from_loop(s, depth - 1) for s in sub])


def loop_tree(tree: Any, treedef, depths: list[int]) -> Any:
    return jax.tree.unflatten(treedef, _to_loop(jax.tree.leaves(tree), depths))

