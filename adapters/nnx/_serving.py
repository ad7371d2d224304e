"""An NNX :class:`~stackwise.nnx.Stack` in the serving layout: each Variable a
``stackwise.Serving`` of its layers.

:func:`to_serving` gives a new model (an ``nnx.clone``: the given one, and modules sharing
its Variables, keep theirs) whose Stack's stacked Variables (``nnx.Param``, ``nnx.Cache``,
``nnx.BatchStat``, RNG streams, any custom Variable) keep their types and metadata, each
value a ``stackwise.Serving`` of the n per-layer arrays (``_kit.serving.split``: leaf-wise,
so a quantized or LoRA node keeps its own leaves per layer). ``nnx.split``
then flattens each such Variable to n arrays, which ``jax.jit`` donates buffer by buffer.
At the call the Stack regroups them into the core's per-layer trees
(``_kit.serving.gather``), runs the core's serving loop (``Stacked.apply`` over a
``stackwise.Serving``) and writes each layer's new state back into its own buffer
(``_kit.serving.scatter``). :func:`from_serving` stacks every Variable back, exactly, in a
new model too. The given model keeps its arrays until it is dropped (``del``), so both
layouts are held for a moment, as in the core and the other adapters.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from stackwise import _kit
from stackwise.nnx import _inside

__all__ = ["check", "from_serving", "gather", "served", "take", "to_serving", "variables"]


def variables(stack: Any) -> list[list[tuple[tuple, nnx.Variable]]]:
    """Each pattern position's ``(path, Variable)`` s, the Variables themselves (not copies),
    without the RNG streams set on the block from outside (they have no layer axis)."""
    out = []
    for block in stack._blocks():
        outside = set(_inside.outside_streams(block))
        out.append(
            [
                (path, node)
                for path, node in nnx.iter_graph(block)
                if isinstance(node, nnx.Variable) and tuple(path[:-1]) not in outside
            ]
        )
    return out


def served(stack: Any) -> bool:
    """Whether any Variable of the Stack's block(s) holds a ``stackwise.Serving``."""
    return any(_kit.serving.served(v.get_raw_value()) for vs in variables(stack) for _, v in vs)


def _show(path: tuple) -> str:
    return ".".join(map(str, path))


def _position_trees(stack: Any) -> list[dict]:
    """Each position's Variable values, ``{"linear.kernel": value}`` (for the checks)."""
    return [{_show(p): v.get_raw_value() for p, v in vs} for vs in variables(stack)]


def check(stack: Any, who: str) -> None:
    """A served Stack's Variables: all served, each position's holding its layers, every
    layer of one shape and dtype (the core runs one block per position).

    Raises:
      TypeError: a stacked Variable among served ones (``_kit.serving.gather``), or a
        served Variable whose layers differ in shape or dtype.
      ValueError: a Variable serving another number of layers than its position runs.
    """
    trees = _position_trees(stack)
    _kit.serving.gather(trees, stack.n, stack.pattern, who, "layers")
    for tree in trees:
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=_kit.serving.is_serving
        )[0]:
            kinds = [(tuple(a.shape), str(a.dtype)) for a in leaf.layers]
            other = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), None)
            if other is not None:
                raise TypeError(
                    f"{who}: the served `layers{jax.tree_util.keystr(path)}` holds layers of "
                    f"other shapes or dtypes: {_describe(kinds[other])} in its layer {other}, "
                    f"{_describe(kinds[0])} in its layer 0. Each layer's buffer keeps the shape "
                    "and dtype it was converted with; set values of that shape (the served "
                    "calls' own state, `nnx.update`), or rebuild the Stack."
                )


def _describe(kind: tuple) -> str:
    shape, dtype = kind
    return f"{dtype}[{', '.join(map(str, shape))}]"


def to_serving(module: nnx.Module, path: Any = None) -> nnx.Module:
    """A model with a :class:`Stack` in the serving layout: a new model, converted once.

    Every Variable of the Stack's block (``nnx.Param``, ``nnx.Cache``, ``nnx.BatchStat``,
    RNG streams, custom Variables) keeps its type and metadata, and its value becomes a
    ``stackwise.Serving`` of its n per-layer arrays. Calling the served Stack runs its
    layers as a Python loop over those buffers (the core's serving path): no layer slices
    a stacked weight, and each layer's ``nnx.Cache`` is written in its own buffer, in place
    when donated, so decoding costs what a loop of ``Stack.to_layers()``' blocks costs,
    with the same outputs. The given model is not changed, nor is any module that shares
    its Variables (``nnx.merge`` of its ``nnx.split``): the result is an ``nnx.clone`` of
    ``module`` (new Variables; the arrays outside the Stack shared, as ``nnx.clone``
    shares them) with the Stack's Variables converted. :func:`from_serving` converts back.
    Both layouts are held until the given model is dropped (``del stack``).

    >>> import functools, jax, jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> class Cached(nnx.Module):           # writes x at `pos` of its own cache
    ...     def __init__(self, rngs):
    ...         self.linear = nnx.Linear(4, 4, rngs=rngs)
    ...         self.cache = nnx.Cache(jnp.zeros((5, 4)))
    ...     def __call__(self, x, pos):
    ...         self.cache[...] = jax.lax.dynamic_update_slice(self.cache[...], x, (pos, 0))
    ...         return x + self.linear(self.cache[...].sum(0, keepdims=True))
    >>> stack = stackwise.nnx.Stack(Cached, n=3, rngs=nnx.Rngs(0))
    >>> loop = stack.to_layers()            # the loop of blocks it serves like
    >>> served = stackwise.nnx.to_serving(stack)
    >>> served.layers.cache.get_value(), stack.layers.cache.shape   # `stack` stays stacked
    (Serving(3 layers), (3, 5, 4))
    >>> graphdef, params, cache = nnx.split(served, nnx.Param, nnx.Cache)
    >>> len(jax.tree.leaves(cache))         # one buffer per layer
    3
    >>> @functools.partial(jax.jit, donate_argnums=1)     # each cache written in place
    ... def step(params, cache, x, pos):
    ...     model = nnx.merge(graphdef, params, cache)
    ...     return model(x, pos), nnx.state(model, nnx.Cache)
    >>> x = jnp.ones((1, 4))
    >>> y, cache = step(params, cache, x, 0)
    >>> y_loop = x
    >>> for block in loop:
    ...     y_loop = block(y_loop, 0)
    >>> bool(jnp.allclose(y, y_loop))
    True
    >>> nnx.update(served, cache)
    >>> stackwise.nnx.from_serving(served).layers.cache.shape
    (3, 5, 4)

    A model holding a Stack converts at the Stack's place, ``path`` (``"blocks"``,
    ``"decoder.blocks"``), as ``stackwise.flax.to_serving(variables, path)`` does; one
    Stack a call (a model of several converts each in turn). Under ``nnx.jit`` the served
    Stack is called as any module; ``stack[i]`` and ``to_layers()`` give its layers as
    blocks; ``has_aux``, patterns, :func:`stackwise.per_layer` and ``nnx.Rngs`` arguments,
    ``reverse``, LoRA and quantized params (``stackwise.lora.attach(..., per_leaf=True)``,
    ``stackwise.quant.quantize``: each layer's codes stay packed in its buffer) and qwix's
    PTQ kernels work as stacked. ``unroll`` changes nothing; ``remat`` applies per layer.

    Args:
      module: a :class:`Stack`, or an ``nnx.Module`` holding one.
      path: None (``module`` is the Stack), or the Stack's place in ``module``: attribute
        names and list indices joined by ``.`` or ``/`` (``"layers.0"``), or as a tuple.

    Returns:
      A new model of ``module``'s type, its Stack's Variables each holding a
      ``stackwise.Serving``.

    Raises:
      TypeError: the Stack is already in the serving layout, ``module`` is not a Stack
        and no ``path`` is given, or ``path`` names no place.
      ValueError: no Stack at ``path`` (the model's Stacks listed), a Stack built with
        ``fsdp`` or ``nested`` (no serving form), or variables without the layer axis
        (named).
    """
    who = "stackwise.nnx.to_serving"
    new, stack = _clone_at(module, path, who)
    who = f"{who}: {stack._who()}"
    if served(stack):
        raise TypeError(
            f"{who}: the Stack is already in the serving layout (its Variables hold "
            "`stackwise.Serving` s); convert once. `stackwise.nnx.from_serving(module, "
            "path)` stacks it back."
        )
    _kit.refuse_unservable(
        stack.fsdp,
        stack.nested,
        who,
        ". Build the Stack without `{option}` (e.g. `Stack.from_layers(stack.to_layers(), "
        "...)` with the other options) first.",
    )
    stack._check_layers([_inside.outside_streams(b) for b in stack._blocks()])
    for vs in variables(stack):
        for p, v in vs:
            v.set_raw_value(_kit.serving.split(v.get_raw_value(), who, f"layers.{_show(p)}"))
    return new


def from_serving(module: nnx.Module, path: Any = None) -> nnx.Module:
    """The inverse of :func:`to_serving`: a new model with the Stack stacked, bit for bit.

    The new state the served calls wrote (caches, statistics, RNG counts, set back with
    ``nnx.update``) is stacked with the rest. The given model, and any module sharing its
    Variables, is not changed.

    >>> import jax.numpy as jnp, stackwise.nnx
    >>> from flax import nnx
    >>> stack = stackwise.nnx.Stack(lambda rngs: nnx.Linear(2, 2, rngs=rngs), n=3,
    ...                             rngs=nnx.Rngs(0))
    >>> back = stackwise.nnx.from_serving(stackwise.nnx.to_serving(stack))
    >>> bool(jnp.array_equal(back.layers.kernel[...], stack.layers.kernel[...]))
    True

    Args:
      module: a served :class:`Stack`, or an ``nnx.Module`` holding one.
      path: as for :func:`to_serving`.

    Returns:
      A new model of ``module``'s type, its Stack's Variables stacked.

    Raises:
      TypeError: the Stack is not in the serving layout, one of its Variables is stacked
        while others are served, a served layer's buffer changed shape or dtype (named),
        or a bad ``module`` or ``path``.
      ValueError: a served Variable holds another number of layers (named), or no Stack
        at ``path``.
    """
    who = "stackwise.nnx.from_serving"
    new, stack = _clone_at(module, path, who)
    who = f"{who}: {stack._who()}"
    if not served(stack):
        raise TypeError(
            f"{who}: the Stack is not in the serving layout (its Variables are stacked); "
            "`stackwise.nnx.to_serving(module, path)` converts it."
        )
    check(stack, who)
    for vs in variables(stack):
        for p, v in vs:
            v.set_raw_value(_kit.serving.join(v.get_raw_value(), who, f"layers.{_show(p)}"))
    return new


def _clone_at(module: Any, path: Any, who: str) -> tuple[nnx.Module, Any]:
    """``(new, stack)``: an ``nnx.clone`` of ``module`` (new Variables, nothing shared with
    the given model's) and the Stack at ``path`` in it, which the caller converts."""
    from stackwise.nnx._stack import Stack  # (the Stack's module imports this one)

    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"{who}: `module` must be an `nnx.Module` (a stackwise.nnx.Stack, or a model "
            f"holding one), got {type(module).__name__}. For an `nnx.State`, `nnx.merge` it "
            "with its graphdef first."
        )
    new = nnx.clone(module)
    stacks = [(tuple(p), m) for p, m in nnx.iter_graph(new) if isinstance(m, Stack)]
    return new, _kit.serving.stack_at(new, path, stacks, Stack, who)[1]


def gather(positions: list, stack: Any, who: str, what: str) -> Any:
    """The core's ``stackwise.Serving`` of per-layer States from each position's State
    (checked beforehand by :func:`check`)."""
    return _kit.serving.gather(positions, stack.n, stack.pattern, who, what)


def take(state: Any, j: int) -> Any:
    """Layer ``j`` of a position's State, stacked or served (``stackwise.Serving`` s)."""
    return jax.tree.map(
        lambda a: a.layers[j] if _kit.serving.is_serving(a) else _kit.take(a, j),
        state,
        is_leaf=_kit.serving.is_serving,
    )
