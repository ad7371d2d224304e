"""The serving layout: each layer's params and state (a KV cache) in buffers of their own.

The stacked layout is what training wants: one scan, one array per leaf. Decoding a token
costs it a per-layer slice of every stacked weight (a copy inside the scan) and a write
back into the stacked cache. A Python loop over separate per-layer buffers costs neither:
layer i reads its own weights and writes its own cache in place when the cache is
donated. :class:`Serving` holds that layout (n per-layer trees, in layer order);
:func:`to_serving` converts once (the whole tree, or the stacked part at a ``path``, as
every adapter's ``to_serving(tree, path)`` does), :func:`from_serving` converts back, and the same
``Stacked.apply`` runs a :class:`Serving` tree as a Python loop of the layers
(:meth:`stackwise._core.stack.Run.serve`), returning the state as a :class:`Serving` too.
"""

from __future__ import annotations

from typing import Any

from stackwise._core import layout, places, trees
from stackwise._core.options import Options
from stackwise._core.served import Serving, in_use, refuse
from stackwise._core.served import found as _found

__all__ = ["Serving", "from_serving", "in_use", "layers_of", "refuse", "to_serving"]


def to_serving(tree: Any, path: Any = None, *, pattern: int | None = None) -> Any:
    """Stacked params or state in the serving layout: n per-layer buffers, converted once.

    ``Stacked.apply`` takes the result in place of the stacked tree and runs the layers as
    a Python loop over the separate buffers, as a loop model does: no layer slices a
    stacked weight, and each layer's cache is written in place in its own buffer when the
    state is donated (``jax.jit(apply, donate_argnums=1)``). It returns the state in the
    serving layout, so a decoding loop converts once, before the first token. The outputs
    equal the scanned apply's. :func:`from_serving` gives the stacked tree back.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> def attend(p, cache, x, pos):          # one layer: write the cache, read it back
    ...     cache = jax.lax.dynamic_update_slice(cache, x @ p["w"], (pos, 0))
    ...     return x + cache.sum(0, keepdims=True), cache
    >>> layers = stackwise.stack(None, attend, 3, with_state=True)
    >>> params = {"w": jnp.ones((3, 4, 4)) / 8}
    >>> cache = jnp.zeros((3, 5, 4))           # 3 layers, 5 positions
    >>> x = jnp.ones((1, 4))
    >>> y, new = layers.apply(params, cache, x, 0)                     # scanned
    >>> served, served_cache = stackwise.to_serving(params), stackwise.to_serving(cache)
    >>> served
    Serving(3 layers)
    >>> step = jax.jit(layers.apply, donate_argnums=1)                 # the cache reused
    >>> y_served, served_cache = step(served, served_cache, x, 0)      # a Python loop
    >>> bool((y_served == y).all()), served_cache.layers[2].shape
    (True, (5, 4))
    >>> bool((stackwise.from_serving(served_cache) == new).all())
    True

    A model's params that hold the stacked blocks beside other parts convert at the
    blocks' place, ``path``, as every adapter's ``to_serving(tree, path)`` does; the rest
    is kept as it is:

    >>> model = {"embed": jnp.ones((8, 4)), "blocks": params}
    >>> served_model = stackwise.to_serving(model, "blocks")
    >>> served_model["blocks"], served_model["embed"] is model["embed"]
    (Serving(3 layers), True)
    >>> back = stackwise.from_serving(served_model, "blocks")
    >>> bool((back["blocks"]["w"] == params["w"]).all())
    True

    Everything ``Stacked.apply`` takes works the same: ``has_aux``, patterns (pass
    ``pattern=k``: the layers come in layer order), :func:`stackwise.per_layer` and
    :func:`stackwise.layer_index` arguments, ``reverse``, :func:`stackwise.lora.stack`
    over quantized codes (each layer's codes stay quantized until the layer dequantizes
    them) or attached or merged adapters. ``unroll`` changes nothing (the layers always
    run as a loop); ``remat`` applies per layer as with ``unroll=True``, so the loop is
    differentiable, though the layout is meant for inference. A stack built with
    ``fsdp`` or ``nested`` refuses it (build the serving stack without them).

    Converting holds the stacked and the per-layer copies at once for a moment: drop the
    stacked tree afterwards (``del params``) to free it. Nothing given is changed.

    Args:
      tree: stacked params or state: every leaf has the layer axis first (``Stacked.init``,
        :func:`stackwise.stack_layers`, :func:`stackwise.quant.quantize`,
        :func:`stackwise.lora.merge` or :func:`stackwise.lora.attach` give such trees);
        with ``pattern=k``, a tuple of k stacked trees. With ``path``, a tree holding
        them (dicts, lists and tuples on the way).
      path: None (the whole ``tree`` is stacked), or the place of the stacked part in
        ``tree``: a key (``"blocks"``), keys joined by ``/`` (``"model/blocks"``), or a
        tuple of keys (``("model", "blocks")``, list indices as ints).
      pattern: None, or the pattern's length k (as ``Stacked.init`` made the tuple); with
        ``path``, the k-tuple is the value at ``path``.

    Returns:
      A :class:`Serving` of the n per-layer trees, in layer order, every leaf exact; with
      ``path``, a new ``tree`` holding it at ``path`` (the containers on the way copied,
      the rest shared).

    Raises:
      TypeError: the part to convert already in (or holding a part in) the serving layout,
        a bad ``pattern``, or a ``path`` that names no place or goes through a value
        that is neither a dict, a list nor a tuple.
      ValueError: leaves without a common leading layer axis (listed), or a ``path`` not
        in ``tree`` (the keys there listed).
    """
    who = "stackwise.to_serving"
    keys = None if path is None else places.parts(path, who)
    part = tree if keys is None else places.get(tree, keys, who)
    at = "`tree`" if keys is None else f"`tree` at {places.show(keys)}"
    found = _found(part)
    if found:
        where = "it is" if found == [""] else f"it holds one at {', '.join(found)}"
        raise TypeError(
            f"{who}: {at} must be stacked (every leaf with the layer axis first), but "
            f"{where} already in the serving layout (a `stackwise.Serving`). Convert a "
            "stacked tree once; `stackwise.from_serving(tree)` gives the stacked one back."
        )
    served = Serving(layout.unstack(part, pattern, who), pattern)
    return served if keys is None else places.replace(tree, keys, served)


def from_serving(tree: Any, path: Any = None) -> Any:
    """The stacked tree of a :class:`Serving`: the inverse of :func:`to_serving`, exactly.

    >>> import jax.numpy as jnp, stackwise
    >>> served = stackwise.to_serving({"w": jnp.arange(6.0).reshape(3, 2)})
    >>> stackwise.from_serving(served)["w"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]

    A pattern's serving layout (``to_serving(..., pattern=k)``) gives back the tuple of k
    stacked trees; with ``path``, the :class:`Serving` at ``path`` is stacked back in a new
    ``tree``.

    Args:
      tree: what :func:`stackwise.to_serving` or ``Stacked.apply`` (its state) returned:
        a :class:`Serving`, or with ``path`` a tree holding one there.
      path: None, or the place of the :class:`Serving` in ``tree``, as for
        :func:`to_serving`.

    Returns:
      The stacked tree (with a pattern, a tuple of k), every leaf keeping its dtype; with
      ``path``, a new ``tree`` holding it at ``path``.

    Raises:
      TypeError: the value (at ``path``) is not a :class:`stackwise.Serving`, or a bad
        ``path``.
      ValueError: layers of different structure or shapes (hand-built ones), or a
        ``path`` not in ``tree``.
    """
    who = "stackwise.from_serving"
    keys = None if path is None else places.parts(path, who)
    part = tree if keys is None else places.get(tree, keys, who)
    if not isinstance(part, Serving):
        at = "`tree`" if keys is None else f"`tree` at {places.show(keys)}"
        inside = _found(part)
        hint = (
            f"; it holds one at {', '.join(inside)}: give that place as `path`"
            if inside
            else "; a stacked tree is already in the stacked layout"
        )
        raise TypeError(
            f"{who}: {at} must be a `stackwise.Serving` (from `stackwise.to_serving`), got "
            f"{trees.describe(part)}{hint}."
        )
    stacked = layout.restack(list(part.layers), part.pattern, who)
    return stacked if keys is None else places.replace(tree, keys, stacked)


def refuse_unservable(fsdp: Any, nested: Any, where: str, fix: str | None = None) -> None:
    """Refuses the options that have no serving form, naming the option and the fix
    (``fix``: what follows the reason, ``{option}`` the option's name; the core's by
    default)."""
    fix = fix or (
        ", so build the stack you serve with without it (the same init and apply), e.g. "
        "`stackwise.stack(init, apply, n, with_state=True)`, or run the stacked params "
        "(`stackwise.from_serving(params)`)."
    )
    if fsdp:
        raise ValueError(
            f"{where}: the stack was built with `fsdp={fsdp!r}`, which gathers each "
            "layer's sharded slice of stacked params inside the scan; the serving layout "
            "(`stackwise.to_serving`) keeps each layer's params whole"
            + fix.format(option="fsdp")
        )
    if nested:
        raise ValueError(
            f"{where}: the stack was built with `nested={nested!r}`, grouped remat "
            "for training over stacked params; the serving layout (`stackwise.to_serving`) "
            "runs the layers as a Python loop with no groups" + fix.format(option="nested")
        )


def layers_of(
    params: Any, state: Any, *, n: int, pattern: int | None, options: Options, where: str
) -> tuple[tuple, tuple]:
    """The per-layer params and state of a serving-layout call of ``Stacked.apply``, checked.

    ``state`` is None without ``with_state`` (or for layers without state); ``pattern`` is
    the stack's k when built with a pattern, else None. Either tree may be None (no
    params, no state); otherwise both must be :class:`Serving` s of the stack's n layers.
    """
    refuse_unservable(options.fsdp, options.nested, where)
    for what, tree in (("params", params), ("state", state)):
        found = [] if isinstance(tree, Serving) else _found(tree)
        if found:
            raise TypeError(
                f"{where}: the {what} hold a `stackwise.Serving` at {what}"
                f"{', '.join(found)}; `stackwise.to_serving` converts a whole tree: "
                f"pass `stackwise.to_serving(stacked_{what})` (a Serving at the root)."
            )
    out = []
    for what, tree in (("params", params), ("state", state)):
        if tree is None:
            out.append((None,) * n)
            continue
        if not isinstance(tree, Serving):
            other = "state" if what == "params" else "params"
            raise TypeError(
                f"{where}: the {other} are in the serving layout (a `stackwise.Serving`) "
                f"but the {what} are stacked; both go in one layout. Convert the {what} "
                f"too (`stackwise.to_serving({what})`), or both back "
                f"(`stackwise.from_serving({other})`)."
            )
        _check(tree, what, n, pattern, where)
        out.append(tree.layers)
    return out[0], out[1]


def _check(tree: Serving, what: str, n: int, pattern: int | None, where: str) -> None:
    """A :class:`Serving` of ``n`` layers, made with the stack's ``pattern``, not nested."""
    inner = [f"[{i}]{p}" for i, layer in enumerate(tree.layers) for p in _found(layer)]
    if inner:
        raise TypeError(
            f"{where}: the {what}' layers hold a `stackwise.Serving` at "
            f"{', '.join(inner)}: convert a stacked tree once, not twice."
        )
    if tree.pattern != pattern:
        made = "without `pattern`" if tree.pattern is None else f"with pattern={tree.pattern}"
        if pattern is None:
            runs, want = "one layer repeated", f"`stackwise.to_serving({what})` without `pattern`"
        else:
            runs = f"a pattern of {pattern} layers"
            want = f"`stackwise.to_serving({what}, pattern={pattern})`"
        raise ValueError(
            f"{where}: the {what} were converted {made}, but the stack runs {runs}; "
            f"convert with {want}."
        )
    if len(tree.layers) != n:
        raise ValueError(
            f"{where}: the {what} in the serving layout hold {len(tree.layers)} layers, "
            f"but the stack has n={n}; convert the stacked {what} of this model "
            "(`stackwise.to_serving`), or take its first layers before converting "
            "(`stackwise.slice_layers`)."
        )
