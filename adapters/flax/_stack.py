"""``Stack``: one Flax linen block repeated n times, built on :func:`stackwise.stack`.

The adapter only turns the block into a per-layer function and binds the
stacked variables into the ``Stack`` module's own scope; scanning and remat
are the core's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import errors as flax_errors
from flax.core import meta

import stackwise
from stackwise import _kit
from stackwise.flax._blocks import fresh_block, position_names
from stackwise.flax._boxes import unbox, wrong_layer_axis

__all__ = ["Stack", "layer_index"]


# --------------------------------------------------------------------------
# The layer index, readable from inside a block.


def layer_index() -> jax.Array:
    """The index of the layer being run, called from inside a block of a :class:`Stack`.

    A traced int32 scalar (layer ``i`` of ``n`` gets ``i``, whatever
    ``reverse``, and across a pattern of blocks), usable in arithmetic,
    ``jnp.where`` or ``lax.switch``; to record it, ``sow`` it.

    >>> import jax, jax.numpy as jnp, flax.linen as nn, stackwise.flax
    >>> class Scale(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         i = stackwise.flax.layer_index()
    ...         self.sow("intermediates", "index", i)
    ...         return x * 10 + i
    >>> stack = stackwise.flax.Stack(Scale, n=3)
    >>> y, state = stack.apply({}, jnp.zeros(()), mutable="intermediates")
    >>> y, state["intermediates"]["index"][0]
    (Array(12., dtype=float32), Array([0, 1, 2], dtype=int32))

    Raises:
      RuntimeError: called outside a block run by :class:`Stack`.
    """
    return _kit.current_layer_index("flax")


# --------------------------------------------------------------------------
# The block: a class, a partial of one, or an instance used as a template.


def _check_block(block: Any, who: str) -> None:
    target = block
    while isinstance(target, functools.partial):
        target = target.func
    is_class = isinstance(target, type) and issubclass(target, nn.Module)
    if not (is_class or isinstance(block, nn.Module)):
        raise TypeError(
            f"{who}: `block` must be a Flax linen module class, a functools.partial of "
            f"one or a module instance used as a template, got {type(block).__name__} "
            f"{block!r}. For example `Stack(Block, n=4)` or `Stack(Block(features=512), "
            "n=4)`; for an NNX module use `stackwise.nnx.Stack`."
        )


# --------------------------------------------------------------------------
# Checks with messages that name the block and the variable.


def _path(col: str, path: tuple) -> str:
    return f"{col}{jax.tree_util.keystr(path)}"


def _check_depth(variables: dict, n: int, who: str) -> None:
    leaves = [
        (_path(col, path), leaf)
        for col, tree in variables.items()
        for path, leaf in jax.tree_util.tree_leaves_with_path(unbox(tree))
    ]
    _kit.check_depth(
        leaves,
        n,
        who,
        "variables",
        "Variables of a Python loop of blocks (`layers_0`, `layers_1`, ...) convert with "
        "`stackwise.flax.from_loop`, those of `nn.scan` with "
        "`stackwise.flax.from_scan`; keep the first k layers with `stackwise.slice_layers`."
        + (_kit.qwix_fix("stackwise.flax.quantize_params") if _kit.holds_qwix(variables) else ""),
    )


def _check_box_names(variables: dict, layer_axis_name: Any, who: str) -> None:
    for col, tree in variables.items():
        wrong = wrong_layer_axis(tree, layer_axis_name)
        if wrong is not None:
            path, names = wrong
            raise ValueError(
                f"{who}: the partitioning of "
                f"`{_path(col, path)}` is {names}, whose first (layer) axis "
                f"should be named {layer_axis_name!r} (this Stack's "
                f"`layer_axis_name`). Build the Stack with "
                f"`layer_axis_name={names[0] if names else None!r}`, or convert the "
                "variables with `stackwise.flax.from_scan(..., layer_axis_name=...)`."
            )


def _check_stackable(variables: dict, who: str) -> None:
    for col, tree in variables.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(unbox(tree)):
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
                raise TypeError(
                    f"{who}: variable `{_path(col, path)}` holds a "
                    f"{type(leaf).__name__} ({leaf!r}), which cannot be stacked along a "
                    "layer axis: every variable a stacked block creates (in any "
                    "collection) must be an array. Keep Python values as module "
                    "attributes, or store them as arrays, e.g. `jnp.asarray(...)`."
                )


def _split_mutable(trees: list, mutable: Callable[[str], bool], many: bool) -> tuple:
    """``(params, state)``: each ``{collection: tree}`` of ``trees`` split into the
    collections the call does not update and those it does; a tuple of each if ``many``."""
    params = tuple({c: v for c, v in t.items() if not mutable(c)} for t in trees)
    state = tuple({c: v for c, v in t.items() if mutable(c)} for t in trees)
    return (params, state) if many else (params[0], state[0])


def _check_served_leaves(positions: list, who: str) -> None:
    """Each ``stackwise.Serving`` among served variables holds arrays (one per layer), not
    the core's per-layer trees (``stackwise.to_serving`` of a subtree)."""
    for position in positions:
        for col, tree in position.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_kit.serving.is_serving)
            for path, leaf in flat:
                if _kit.serving.is_serving(leaf) and not all(
                    jax.tree_util.treedef_is_leaf(jax.tree.structure(a)) for a in leaf.layers
                ):
                    raise TypeError(
                        f"{who}: `variables['{col}']{jax.tree_util.keystr(path)}` is a "
                        "`stackwise.Serving` of per-layer trees (the core's layout, "
                        "`stackwise.to_serving`); a Stack's served variables hold one per "
                        "leaf, of its per-layer arrays. Convert the stacked variables with "
                        "`stackwise.flax.to_serving(variables, path)`."
                    )


@contextlib.contextmanager
def _param_added(who: str) -> Iterator[None]:
    """A param the block creates while it runs, with no place to keep it: refused, with
    the fix (flax's own error names only the block's scope, not the Stack)."""
    try:
        yield
    except flax_errors.ScopeParamNotFoundError as e:
        raise ValueError(
            f"{who}: a layer creates a param that the Stack's variables do not hold, while "
            f"'params' is not mutable ({e}). A param a transformation adds inside the layer "
            "(qwix's LoRA params, a quantized kernel) is kept stacked, one per layer: take "
            "the variables from `init` of the transformed model, or from `apply(variables, "
            "x, mutable=['params'])`, which returns them with a leading layer axis."
        ) from None


# --------------------------------------------------------------------------
# The module.


class Stack(nn.Module):
    """``n`` copies of a linen block, with stacked variables and one scanned call.

    The loop it replaces, one block per layer:

    >>> import jax, jax.numpy as jnp, flax.linen as nn, stackwise.flax
    >>> class Block(nn.Module):
    ...     features: int = 8
    ...     @nn.compact
    ...     def __call__(self, x, *, scale=1.0):
    ...         return x + scale * jnp.tanh(nn.Dense(self.features)(x))
    >>> class Loop(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         for i in range(4):
    ...             x = Block(name=f"layers_{i}")(x, scale=0.5)
    ...         return x
    >>> x = jnp.ones((2, 8))
    >>> loop_vars = Loop().init(jax.random.key(0), x)

    The same, stacked (the block is traced once, whatever ``n``); the loop's
    variables convert exactly:

    >>> class Model(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return stackwise.flax.Stack(Block, n=4, name="layers")(x, scale=0.5)
    >>> variables = Model().init(jax.random.key(0), x)
    >>> variables["params"]["layers"]["Dense_0"]["kernel"].shape
    (4, 8, 8)
    >>> converted = stackwise.flax.from_loop(loop_vars, "layers")
    >>> y, y_loop = Model().apply(converted, x), Loop().apply(loop_vars, x)
    >>> bool(jnp.allclose(y, y_loop, atol=1e-6))
    True

    Every collection the block creates (``params``, ``batch_stats``,
    ``cache``, sown ``intermediates``, custom ones) gets a leading layer axis;
    which collections are updated follows the caller's ``mutable=``. Every
    RNG stream given to ``init``/``apply`` (``params``, ``dropout``, custom)
    is split into n independent per-layer streams.

    Per-layer inputs: wrap an argument in :func:`stackwise.per_layer` (layer
    ``i`` gets slice ``i``); inside the block :func:`stackwise.flax.layer_index`
    gives the layer's index. Per-layer outputs: ``self.sow`` them (stacked
    along axis 0 in ``intermediates``) or return ``(x, aux)`` with
    ``has_aux=True``.

    >>> class Gated(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x, gate):
    ...         return x * gate, x.sum()
    >>> gates = jnp.array([1.0, 2.0, 3.0])
    >>> stack = stackwise.flax.Stack(Gated, n=3, has_aux=True)
    >>> y, sums = stack.apply({}, jnp.ones(2), stackwise.per_layer(gates))
    >>> y, sums
    (Array([6., 6.], dtype=float32), Array([2., 2., 4.], dtype=float32))

    For decoding, :func:`stackwise.flax.to_serving` converts the Stack's variables once
    into the serving layout (each stacked leaf a ``stackwise.Serving`` of its per-layer
    arrays): the Stack then runs its layers as a Python loop over the separate buffers,
    as a loop of the blocks does, and returns the collections it updates (a ``cache``)
    served, each layer's buffer written in place when donated.

    LoRA and quantized weights (``docs/finetune.md``): ``params`` may hold
    ``stackwise.lora.attach(base, adapters, per_leaf=True)`` and
    ``stackwise.quant.quantize`` leaves. A batch of g adapters
    (``stackwise.lora.stack_adapters``) runs group j of ``x``'s leading axis
    with adapter j; every group gets the same RNG keys, and a mutable
    collection a group updates from its rows (``batch_stats`` in training) is
    refused, one that every group leaves alike is kept.

    Attributes:
      block: the layer: a linen ``nn.Module`` class, a ``functools.partial`` of
        one, or an instance used as a template (``Block(features=512)``). Called
        as ``block(x, *args, **kwargs)`` and must return ``x`` with the same
        shapes and dtypes (or ``(x, aux)`` with ``has_aux``).
      n: the number of layers.
      remat: rematerialise each layer in the backward pass: ``False``,
        ``True`` or a :mod:`jax.checkpoint_policies` policy (see
        :func:`stackwise.stack`); the default, ``stackwise.DEFAULT_REMAT``,
        saves matmul outputs and recomputes the rest.
      nested: two-level remat over groups of layers (``True`` or a group size).
      unroll: passed to ``lax.scan``; ``True`` runs a Python loop.
      reverse: run the last layer first.
      has_aux: the block returns ``(x, aux)``; the Stack returns ``(x, aux)``
        with aux stacked along a leading layer axis.
      layer_axis_name: the partitioning name given to the layer axis of every
        ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` variable
        (``None``: replicated over layers), as ``nn.scan``'s
        ``metadata_params={nn.PARTITION_NAME: ...}``.

    Raises:
      TypeError: ``block`` is not a linen module, the block changes its
        input's shape or dtype, it creates a variable that is not an array, or
        variables some of whose leaves are served and some stacked.
      ValueError: ``n < 1``, variables without a leading axis of length
        ``n`` (the offending variables are listed), served variables of another
        depth, or served variables given to a Stack built with ``fsdp`` or ``nested``.
    """

    block: Any
    n: int
    remat: bool | Callable[..., Any] = stackwise.DEFAULT_REMAT
    nested: bool | int = False
    unroll: int | bool = 1
    reverse: bool = False
    has_aux: bool = False
    fsdp: str | tuple[str, ...] | None = None
    layer_axis_name: str | None = None

    def __post_init__(self) -> None:
        who = _kit.stack_name("flax", self.block, self.n)
        blocks = self.block if isinstance(self.block, (list, tuple)) else [self.block]
        if not blocks:
            raise ValueError(f"{who}: a pattern needs at least one block; got an empty list.")
        for block in blocks:
            _check_block(block, who)
        self._options(who)  # checked now, not at the first call
        _kit.check_layer_axis_name(self.layer_axis_name, who)
        super().__post_init__()

    def _options(self, who: str) -> dict[str, Any]:
        return _kit.stack_options(who, self.n, vars(self))

    def _served(self, positions: list, pattern: bool, who: str) -> tuple:
        """The core's ``(params, state)`` in the serving layout (each a ``stackwise.Serving``
        of per-layer trees) of the positions' leaf-wise served variables."""
        _kit.refuse_unservable(
            self.fsdp,
            self.nested,
            who,
            ". Build the Stack you serve with without `{option}` (the same variables), or "
            "run the stacked variables (`stackwise.flax.from_serving(variables, path)`).",
        )
        _check_served_leaves(positions, who)
        core = _kit.serving.gather(positions, self.n, pattern, who, "variables")
        mutable = self.scope.is_mutable_collection
        params, state = _split_mutable(core.layers, mutable, True)
        return stackwise.Serving(params, core.pattern), stackwise.Serving(state, core.pattern)

    @nn.compact
    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs the n layers: ``block(x, *args, **kwargs)`` each, in order."""
        who = _kit.stack_name("flax", self.block, self.n)
        pattern = isinstance(self.block, (list, tuple))
        blocks = list(self.block) if pattern else [self.block]
        k = len(blocks)
        names = position_names(blocks) if pattern else [None]
        axis_params = {nn.PARTITION_NAME: self.layer_axis_name}
        scope = self.scope
        mutable = scope.mutable
        variables = dict(self.variables)
        initializing = not jax.tree_util.tree_leaves(variables) and (
            self.is_initializing() or scope.is_mutable_collection("params")
        )
        positions = [
            variables if name is None else {c: t[name] for c, t in variables.items() if name in t}
            for name in names
        ]
        served = not initializing and _kit.serving.served(variables)
        if not initializing:
            for p, position in enumerate(positions):
                if not served:
                    _check_depth(position, len(range(p, self.n, k)), who)
                _check_box_names(position, self.layer_axis_name, who)
        # Every stream the caller provides, split per layer (deterministically).
        extras = {
            "index": stackwise.layer_index(),
            "rngs": {s: stackwise.per_layer_keys(self.make_rng(s)) for s in scope.rngs},
        }

        def one(block):
            block = fresh_block(block, who)

            def run(params, x, s, extras, call):
                layer_vars = {**params, **s}
                args, kwargs, rngs = call.args, call.kwargs, extras["rngs"]
                with _kit.at_layer(extras["index"]), _param_added(who):
                    if initializing:
                        out, new = block.init_with_output(rngs, x, *args, **kwargs, mutable=mutable)
                    elif mutable is False:
                        out, new = block.apply(layer_vars, x, *args, rngs=rngs, **kwargs), {}
                    else:
                        out, new = block.apply(
                            layer_vars, x, *args, rngs=rngs, mutable=mutable, **kwargs
                        )
                return out, dict(new)

            def layer(p, s, x, extras, call):
                # Gathered (FSDP) params go in unboxed: a block's `self.param` would
                # otherwise constrain them back to the sharded layout their names give
                # under `nn.logical_axis_rules` (an assertion on explicit mesh axes).
                params = unbox(p) if self.fsdp else meta.remove_axis(p, 0, axis_params)
                s = meta.remove_axis(s, 0, axis_params)
                # LoRA / quantized: float weights; a batch of adapters: one group per adapter.
                out, new = _kit.run_layer(run, params, x, s, extras, call, who=who)
                _check_stackable(new, who)
                return out, meta.add_axis(new, 0, axis_params)

            return layer

        # Variables are created by `init_with_output` inside the scanned layer, so
        # each layer's init sees its own input (as in a loop and in nn.scan) and
        # BatchNorm statistics, caches and sown values follow Flax's init rules;
        # the core's vmapped `init` is therefore not used.
        layers = stackwise.stack(
            None,
            [one(b) for b in blocks] if pattern else one(blocks[0]),
            self.n,
            with_state=True,
            name=who,  # the core checks x's shape and dtype
            **self._options(who),
        )
        if served:
            params, state = self._served(positions, pattern, who)
        else:
            params, state = _split_mutable(positions, scope.is_mutable_collection, pattern)
            _kit.warn_unrematted(params, self.remat, who)
        out, new = layers.apply(params, state, x, extras, _kit.CallArgs(args, kwargs))
        if served:
            new = _kit.serving.scatter(new, k)
        for name, position in zip(names, new if pattern or served else [new]):
            for col, tree in position.items():
                if name is not None:
                    self.put_variable(col, name, tree)
                    continue
                for var_name, value in tree.items():
                    self.put_variable(col, var_name, value)
        return out
