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
  ``_classify.py``): **elementwise** parts run as they are (the same program as unwrapped),
  if their program on the stacked tree is their per-layer program with layer axes added
  (else a ``mask=`` or label function inside would see stacked shapes: they run per layer);
  **per-leaf** parts run per layer, ``jax.vmap`` ped over the layer axes of the stacked leaves
  with their optimizer state stacked the same way, while the shared state (the step count,
  ``inject_hyperparams``' hyperparameters) stays as it is; parts that **mix leaves** are
  ``clip_by_global_norm`` (its norm over all elements is the loop's norm: run as it is) or
  anything else, which runs on the loop model's own tree (each stacked leaf unstacked into its
  n layers, then restacked): exact, at the cost of a program that grows with n.

- an ``optax.partition`` (``contrib.muon`` is one) is split into its groups, labelled on one
  layer's view, and Muon's parts run through Muon's own batch axes (``_own.py``).

Which leaves and layers (``stacked=``, ``freeze=``, ``lr_scale=``, a pattern's positions) are
resolved in ``_which.py``, how each part runs in ``_plan.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import optax
from stackwise import _kit
from stackwise.optax import _upstream
from stackwise.optax._own import layer_labels, own_batch_axes
from stackwise.optax._plan import Plan, from_loop, init_vmapped, loop_tree, run_vmapped
from stackwise.optax._which import (
    Which,
    layer_set,
    layer_values,
    leaf_depths,
    map_rows,
    rows,
    selected,
)

__all__ = ["layer_decay", "layer_mask", "layerwise", "muon_dimensions"]

_WHERE = "stackwise.optax.layerwise"

# The update functions of the transformations made here: they already see the layers, so a
# `layerwise` around them (or around a chain holding them) leaves them as they are.
_LAYER_AWARE: weakref.WeakSet = weakref.WeakSet()


def _aware(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    _LAYER_AWARE.add(tx.update)
    return tx


# True while `layerwise` runs a part it could not split into parts (traced on one layer's
# view, vmapped per layer or on the loop model's tree): a layer-aware transformation nested
# in such a part would see one layer's leaves, and refuses (`_outside_opaque`).
_OPAQUE: contextvars.ContextVar[bool] = contextvars.ContextVar("stackwise_optax_opaque",
                                                               default=False)


@contextlib.contextmanager
def _opaque():
    token = _OPAQUE.set(True)
    try:
        yield
    finally:
        _OPAQUE.reset(token)


def _outside_opaque(where: str) -> None:
    if _OPAQUE.get():
        raise ValueError(
            f"{where} is nested inside a transformation that `stackwise.optax.layerwise` "
            "cannot split into parts (such as `optax.MultiSteps`, `optax.apply_if_finite`, "
            "`optax.inject_hyperparams` or one of your own), so it runs that one per layer "
            "or on the loop model's leaves, where layers cannot be named. Put `layerwise` "
            "inside it instead: `optax.MultiSteps(stackwise.optax.layerwise(tx, ...), k)`, "
            "`optax.apply_if_finite(stackwise.optax.layerwise(tx, ...), m)`."
        )


def _single(tx: Any, stacked: Which) -> optax.GradientTransformationExtraArgs:
    tx = optax.with_extra_args_support(tx)

    def init_fn(params):
        with _opaque():
            return _init(params)

    def update_fn(updates, state, params=None, **extra):
        with _opaque():
            return _update(updates, state, params, **extra)

    def _init(params):
        depths = leaf_depths(stacked, params, _WHERE)
        plan = Plan(tx, params, params, depths, {})
        if plan.kind == "direct":
            return tx.init(params)
        if plan.kind == "loop":
            return tx.init(loop_tree(params, plan.treedef, depths))
        return init_vmapped(plan, tx, params)

    def _update(updates, state, params=None, **extra):
        depths = leaf_depths(stacked, updates, _WHERE)
        plan = Plan(tx, updates, params, depths, extra)
        if plan.kind == "direct":
            return tx.update(updates, state, params, **extra)
        if plan.kind == "loop":
            loop_p = None if params is None else loop_tree(params, plan.treedef, depths)
            new_u, state = tx.update(loop_tree(updates, plan.treedef, depths), state, loop_p,
                                     **extra)
            subs = plan.treedef.flatten_up_to(new_u)
            return jax.tree.unflatten(
                plan.treedef, [from_loop(s, d) for s, d in zip(subs, depths)]), state
        return run_vmapped(plan, tx, updates, state, params, extra)

    return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _wrap(tx: Any, stacked: Which) -> optax.GradientTransformationExtraArgs:
    if tx.update in _LAYER_AWARE:
        return optax.with_extra_args_support(tx)
    parts = _upstream.chain_parts(tx)
    if parts is not None:
        return _aware(optax.chain(*(_wrap(p, stacked) for p in parts)))
    groups = _upstream.partition_parts(tx)
    if groups is not None:
        transforms, labels, extra_masked = groups
        return _aware(optax.partition(
            {k: _wrap(t, stacked) for k, t in transforms.items()},
            layer_labels(labels, stacked), mask_compatible_extra_args=extra_masked))
    own = own_batch_axes(tx, stacked)
    if own is not None:
        return _aware(optax.with_extra_args_support(own))
    return _single(tx, stacked)


def _check_transform(tx: Any, where: str, arg: str) -> None:
    if not (isinstance(tx, tuple) and callable(getattr(tx, "init", None))
            and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"{where}: `{arg}` must be an optax.GradientTransformation (e.g. "
            f"`optax.lamb(1e-3)`), got {type(tx).__name__}: {tx!r:.80}. Call the optimizer's "
            "factory: `optax.adam(1e-3)`, not `optax.adam`."
        )


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
        Equinox models. A pattern's positions: :func:`stackwise.optax.pattern`, so that
        ``freeze`` and ``lr_scale`` name the model's layers.
      freeze: layer indices (ints or NumPy integers, negative ones counting from the
        end of each stacked leaf, or of a pattern) whose params do not move: their
        gradients enter the optimizer as zeros (so a global norm leaves them out, as
        ``optax.multi_transform`` with ``optax.set_to_zero()`` for them does) and their
        updates are zero, bitwise.
      lr_scale: one factor per layer multiplying its updates (e.g.
        :func:`layer_decay`), as ``optax.chain(transform, optax.scale(s_i))`` for layer i
        (of a pattern: the model's n layers).

    Returns:
      An ``optax.GradientTransformationExtraArgs``. Its state has the structure of
      ``transform``'s (so ``state.hyperparams`` of ``inject_hyperparams`` is where it was),
      with the per-layer state of per-layer parts stacked like their leaves.

    Raises:
      TypeError: ``transform`` is not a gradient transformation, or ``stacked``,
        ``freeze`` or ``lr_scale`` have the wrong type.
      ValueError: ``stacked`` does not match the params, ``freeze`` or ``lr_scale`` is
        given but ``stacked`` marks no leaf, ``lr_scale`` holds inf or NaN or does not
        match a stacked leaf's number of layers, this optimizer is nested in a
        transformation that another ``layerwise`` runs per layer, or ``update`` is given a
        state that this optimizer's ``init`` did not make (another structure, or other
        shapes).
      IndexError: ``freeze`` names a layer a stacked leaf does not have.
    """
    _check_transform(transform, _WHERE, "transform")
    core = _wrap(transform, stacked)
    frozen = None if freeze is None else layer_set(freeze, _WHERE, "freeze")
    scales = None if lr_scale is None else _scales(lr_scale)
    per_layer = [arg for arg, v in (("freeze", frozen), ("lr_scale", scales)) if v is not None]
    for arg in per_layer[:1]:
        _has_layers(stacked, None, _WHERE, arg)

    def init_fn(params):
        _outside_opaque(_WHERE)
        for arg in per_layer[:1]:
            _has_layers(stacked, params, _WHERE, arg)
        return core.init(params)

    def update_fn(updates, state, params=None, **extra):
        _outside_opaque(_WHERE)
        _check_state(core.init, updates if params is None else params, state)
        for arg in per_layer[:1]:
            _has_layers(stacked, updates, _WHERE, arg)
        zero = lambda k, a: jnp.where(k, jnp.zeros_like(a), a)  # noqa: E731
        if frozen is not None:
            is_frozen = rows(updates, stacked, _WHERE, selected(frozen, _WHERE, "freeze"))
            updates = map_rows(zero, is_frozen, updates)
        updates, state = core.update(updates, state, params, **extra)
        if scales is not None:
            factors = rows(updates, stacked, _WHERE, lambda name, a, d, p: layer_values(
                scales, a, d, p, name, _WHERE, "lr_scale"))
            updates = map_rows(lambda f, a: (a * f).astype(a.dtype), factors, updates)
        if frozen is not None:
            updates = map_rows(zero, is_frozen, updates)
        return updates, state

    return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))


def _scales(lr_scale: Any) -> np.ndarray:
    """``lr_scale`` checked: a vector of finite real numbers."""
    scales = np.asarray(lr_scale)
    if scales.ndim != 1 or not (np.issubdtype(scales.dtype, np.integer)
                                or np.issubdtype(scales.dtype, np.floating)):
        raise TypeError(
            f"{_WHERE}: `lr_scale` must be a vector of real numbers, one per layer (e.g. "
            f"`stackwise.optax.layer_decay(0.8, n)`), got {lr_scale!r}."
        )
    bad = np.flatnonzero(~np.isfinite(scales))
    if bad.size:
        raise ValueError(
            f"{_WHERE}: `lr_scale` must be finite, but `lr_scale[{bad[0]}]` is "
            f"{float(scales[bad[0]])}: that layer's params would become inf or NaN at the first "
            "step. Give every layer a finite factor (0 stops a layer; so does `freeze=`)."
        )
    return scales


def _has_layers(stacked: Which, tree: Any, where: str, arg: str) -> None:
    """Per-layer controls need a stacked leaf: ``stacked`` (of ``tree``, when given) marks
    one, else ``arg`` would apply to nothing."""
    if tree is None:
        none = isinstance(stacked, bool | np.bool_ | int | np.integer) and not stacked
    else:
        none = not any(leaf_depths(stacked, tree, where))
    if none:
        raise ValueError(
            f"{where}: `{arg}` is per layer, but `stacked` ({stacked!r:.60}) marks no leaf "
            f"of the params as stacked, so `{arg}` would apply to nothing. Mark the stacked "
            "leaves: `stacked=True`, a tree prefix such as `{'blocks': True, 'embed': "
            "False}`, `stacked=lambda path: 'blocks' in path`, or "
            f"`stackwise.optax.stacked_in(model)` for NNX and Equinox; or drop `{arg}`."
        )


def _check_state(init: Callable, params: Any, state: Any) -> None:
    """``state`` has the structure and shapes that ``init`` gives ``params`` (abstractly)."""
    want = jax.eval_shape(init, params)
    if jax.tree.structure(state) != jax.tree.structure(want):
        raise ValueError(
            f"{_WHERE}: the optimizer state does not have the structure this optimizer's "
            "state has (the unwrapped optimizer's state, or another optimizer's?); pass the "
            "state that the same wrapped optimizer's `init` made:\n"
            f"  state:    {jax.tree.structure(state)}\n"
            f"  expected: {jax.tree.structure(want)}"
        )
    pairs = jax.tree_util.tree_leaves_with_path(want)
    for (path, w), a in zip(pairs, jax.tree.leaves(state)):
        if tuple(np.shape(a)) != tuple(w.shape):
            raise ValueError(
                f"{_WHERE}: optimizer state leaf {jax.tree_util.keystr(path)} has shape "
                f"{tuple(np.shape(a))}, expected {tuple(w.shape)} (a per-layer state is "
                "stacked like its leaf). Make the state with the wrapped optimizer's `init`, "
                "not the unwrapped one's."
            )


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
    ``transform`` as zeros, as do the leaves without layer axes, which pass through
    unchanged too (a global norm counts the chosen layers alone, as ``optax.masked`` over
    the loop does). ``transform`` is wrapped by
    :func:`layerwise`; use the result inside a chain, e.g.
    ``optax.chain(optax.scale_by_adam(), layer_mask(optax.add_decayed_weights(1e-4),
    range(2, n)), optax.scale(-lr))``.

    Args:
      transform: the optax gradient transformation to apply on ``layers``.
      layers: layer indices, as for ``freeze`` in :func:`layerwise`.
      stacked: which leaves have layer axes first, as for :func:`layerwise`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``transform``'s state.

    Raises:
      TypeError: ``transform`` is not a gradient transformation, or ``layers`` is not a
        collection of ints.
      IndexError: ``layers`` names a layer a stacked leaf does not have.
      ValueError: ``stacked`` marks no leaf, or this is nested in a transformation that
        :func:`layerwise` runs per layer (``optax.MultiSteps``: put ``layerwise`` inside it).
    """
    where = "stackwise.optax.layer_mask"
    _check_transform(transform, where, "transform")
    chosen = layer_set(layers, where, "layers")
    _has_layers(stacked, None, where, "layers")
    core = layerwise(transform, stacked)

    def init_fn(params):
        _outside_opaque(where)
        _has_layers(stacked, params, where, "layers")
        return core.init(params)

    def update_fn(updates, state, params=None, **extra):
        _outside_opaque(where)
        _has_layers(stacked, updates, where, "layers")
        is_on = rows(updates, stacked, where, selected(chosen, where, "layers"))
        # Only the chosen layers enter: the others, and the leaves without layer axes, as
        # zeros (a global norm leaves them out, as `optax.masked` over the loop does).
        inside = map_rows(lambda k, z, a: jnp.where(k, a, z), is_on,
                          jax.tree.map(jnp.zeros_like, updates), updates)
        new, state = core.update(inside, state, params, **extra)
        return map_rows(lambda k, a, b: jnp.where(k, b, a), is_on, updates, new), state

    return _aware(optax.GradientTransformationExtraArgs(init_fn, update_fn))


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
      TypeError: ``n`` is not an int (a NumPy integer works too).
      ValueError: ``n`` is below 1, or ``decay`` is not in (0, 1].
    """
    where = "stackwise.optax.layer_decay"
    n = _kit.integer(n, where, "n", minimum=1)
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 < decay <= 1:
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

    ``layerwise(optax.contrib.muon(...))`` does this itself (it compiles to the same
    program), and also for Muon's parts (``scale_by_muon``) in a chain of your own; these
    dimension numbers are for Muon used without :func:`layerwise`.

    Args:
      stacked: which leaves have layer axes first, as for :func:`layerwise`.

    Returns:
      A function of the params giving a ``MuonDimensionNumbers`` (or ``None``: AdamW) per
      leaf.
    """
    dims_type = optax.contrib.MuonDimensionNumbers
    where = "stackwise.optax.muon_dimensions"

    def dimensions(params):  # abstract params (`jax.eval_shape`) too: shapes suffice
        depths = leaf_depths(stacked, params, where)
        leaves, treedef = jax.tree.flatten(params)
        ndims = [len(_kit.leaf_shape(a, where, "")) for a in leaves]  # checked by _depths
        out = [dims_type(reduction_axis=(d,), output_axis=(d + 1,)) if k - d == 2 else None
               for k, d in zip(ndims, depths)]
        return jax.tree.unflatten(treedef, out)

    return dimensions
