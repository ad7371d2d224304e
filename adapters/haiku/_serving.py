"""A Haiku :class:`~stackwise.haiku.Stack`'s params and state in the serving layout.

Haiku keeps a Stack's variables in the model's own dicts, ``{module_name: {name: value}}``,
and ``hk.lift`` rebuilds those dicts (``dict(bundle)``) on every call, so only the leaves
are free to change: in the serving layout each stacked leaf ``(n, ...)`` under the Stack
is a ``stackwise.Serving`` of its n per-layer arrays (:func:`to_serving`; a LoRA or
quantized node's own arrays each one), which ``jax.jit`` donates buffer by buffer. Given
such params and state, the Stack regroups them into the core's per-layer trees
(``_kit.serving.gather``) and runs the core's serving loop, whose layer i is the block's
``transform_with_state`` apply on layer i's own arrays: no ``hk.get_parameter`` ever sees a
``stackwise.Serving``. The new state comes back in the same leaf-wise layout.
:func:`from_serving` stacks both back, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

import stackwise
from stackwise import _kit
from stackwise.haiku._convert import Tree, check_paths, check_tree, positions_of

__all__ = ["from_serving", "gather", "refuse_whole", "to_serving"]


def _fix(paths: list[str]) -> str:
    """What a depth error says to do: with one path, how to convert a pattern."""
    if len(paths) > 1:
        return ""  # (the kit's own: stacked variables come from the Stack's `init`)
    return (
        "Stacked variables come from the Stack's `init`. For a pattern of blocks (whose "
        "positions may hold different numbers of layers), pass `path` as the list of the "
        "positions' module names, e.g. ['stack/local', 'stack/local_1', 'stack/global'] "
        "(`Stack.position_names` under the Stack's name)."
    )


def _each_position(
    tree: Tree, path: str | Sequence[str], who: str, one: Callable[[dict, str], tuple[dict, int]]
) -> dict[str, dict[str, Any]]:
    """``tree`` with ``one(position's modules, fix) -> (new modules, layers)`` applied to
    each position under ``path``; the positions' layer counts checked against a pattern."""
    check_tree(tree, who)
    paths = check_paths(path, who)
    new, counts = {}, {}
    for p, inside in enumerate(positions_of(tree, paths, who)[0]):
        if inside:  # (with a pattern: a kind of block with nothing in this tree)
            named = {paths[p] + rest: bundle for rest, bundle in inside.items()}
            new_inside, counts[p] = one(named, _fix(paths))
            new.update(new_inside)
    if len(paths) > 1:
        _kit.pattern_depths(counts, len(paths), who)
    return {key: new.get(key, bundle) for key, bundle in tree.items()}


def _layers(tree: Any) -> int:
    """The number of layers the ``stackwise.Serving`` leaves of ``tree`` hold (one each)."""
    is_serving = _kit.serving.is_serving
    leaves = [v for v in jax.tree.leaves(tree, is_leaf=is_serving) if is_serving(v)]
    return len(leaves[0]) if leaves else 0


def to_serving(tree: Tree, path: str | Sequence[str]) -> dict[str, dict[str, Any]]:
    """A :class:`Stack`'s stacked params or state → its serving layout, converted once.

    Every leaf under the Stack, ``(n, ...)``, becomes a ``stackwise.Serving`` of its n
    per-layer arrays (exact; a LoRA or quantized node keeps its place, each of its arrays
    served: 4-bit codes stay packed per layer). The same model's ``apply`` takes the
    result in place of the stacked params and state: the Stack then runs its layers as a
    Python loop over the separate buffers, as a loop of blocks does (no per-layer slice of
    a stacked weight), and returns its new state in the serving layout, so a decoding loop
    converts once, before the first token; each layer's cache is written in place in its
    own buffer when the state is donated (``jax.jit(f.apply, donate_argnums=1)``).

    >>> import haiku as hk, jax, jax.numpy as jnp, stackwise.haiku
    >>> class Cached(hk.Module):               # one layer: writes its cache, reads it back
    ...     def __call__(self, x, pos):
    ...         cache = hk.get_state("cache", (5, 4), init=jnp.zeros)
    ...         cache = jax.lax.dynamic_update_slice(cache, hk.Linear(4)(x), (pos, 0))
    ...         hk.set_state("cache", cache)
    ...         return x + cache.sum(0, keepdims=True)
    >>> f = hk.transform_with_state(lambda x, pos: stackwise.haiku.Stack(Cached, n=3)(x, pos))
    >>> x = jnp.ones((1, 4))
    >>> params, state = f.init(jax.random.key(0), x, 0)
    >>> y, new = f.apply(params, state, None, x, 0)                     # scanned
    >>> served = stackwise.haiku.to_serving(params, "stack")
    >>> served["stack/cached/linear"]["w"]
    Serving(3 layers)
    >>> step = jax.jit(f.apply, donate_argnums=1)                       # the cache reused
    >>> y_served, served_state = step(served, stackwise.haiku.to_serving(state, "stack"),
    ...                               None, x, 0)
    >>> bool(jnp.allclose(y_served, y)), served_state["stack/cached"]["cache"].layers[2].shape
    (True, (5, 4))
    >>> back = stackwise.haiku.from_serving(served_state, "stack")
    >>> bool(jnp.allclose(back["stack/cached"]["cache"], new["stack/cached"]["cache"]))
    True

    Everything the Stack's call takes works the same: patterns, ``has_aux``,
    ``stackwise.per_layer`` inputs, ``hk.next_rng_key`` (layer i's key as in the scan),
    ``reverse``; ``unroll`` changes nothing (the layers always run as a loop) and ``remat``
    applies per layer. A Stack built with ``fsdp`` or ``nested`` refuses the serving layout.
    Converting holds the stacked and the per-layer copies at once for a moment: drop the
    stacked tree afterwards.

    Args:
      tree: a Haiku params or state dict holding the Stack's stacked variables (other
        modules are kept as they are).
      path: the Stack's module name, e.g. ``"stack"`` or ``"model/~/stack"`` (or its
        block's, ``"stack/block"``): every leaf under it is converted, and all must hold
        the same number of layers. For a pattern whose positions hold different numbers
        of layers, the list of the k positions' names in the pattern's order, e.g.
        ``["stack/local", "stack/local_1", "stack/global"]``.

    Returns:
      A new dict: the Stack's leaves each a ``stackwise.Serving``, the rest as given.

    Raises:
      TypeError: a leaf under ``path`` already in the serving layout (convert once), or a
        bad argument.
      ValueError: nothing under ``path``; leaves under it (a position) without a common
        leading layer axis (listed); a pattern's positions of depths no ``n`` gives.
    """
    who = "stackwise.haiku.to_serving"

    def one(inside: dict, fix: str) -> tuple[dict, int]:
        served = _kit.serving.split(inside, who, "tree", fix)
        return served, _layers(served)

    return _each_position(tree, path, who, one)


def from_serving(tree: Tree, path: str | Sequence[str]) -> dict[str, dict[str, Any]]:
    """A :class:`Stack`'s params or state in the serving layout → stacked, bit for bit.

    The inverse of :func:`to_serving` (``path`` as given to it), also for the state a
    served ``apply`` returned:

    >>> import jax.numpy as jnp, stackwise.haiku
    >>> tree = {"stack/linear": {"w": jnp.arange(6.0).reshape(3, 2)}, "head": {"b": jnp.ones(2)}}
    >>> served = stackwise.haiku.to_serving(tree, "stack")
    >>> served["stack/linear"]["w"].layers[1].tolist(), served["head"]["b"].shape
    ([2.0, 3.0], (2,))
    >>> stackwise.haiku.from_serving(served, "stack")["stack/linear"]["w"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]

    Args:
      tree: a Haiku params or state dict whose leaves under ``path`` are in the serving
        layout.
      path: as for :func:`to_serving`.

    Returns:
      A new dict: the Stack's leaves stacked (dtypes kept), the rest as given.

    Raises:
      TypeError: a leaf under ``path`` that is not in the serving layout (named), or a
        bad argument.
      ValueError: nothing under ``path``; served leaves (of a position) holding different
        numbers of layers, or layers of different shapes or dtypes.
    """
    who = "stackwise.haiku.from_serving"

    def one(inside: dict, fix: str) -> tuple[dict, int]:
        del fix  # (join names the leaves of other depths itself)
        return _kit.serving.join(inside, who, "tree"), _layers(inside)

    return _each_position(tree, path, who, one)


# --------------------------------------------------------------------------
# At the Stack's call.


def refuse_whole(params: Mapping[str, Any], prefix: str, who: str) -> None:
    """Refuses a module of the Stack's whose params are not a dict (a whole module put in
    the core's serving layout, ``{module: stackwise.Serving}``): Haiku's lift takes dicts.
    (Haiku's own ``apply`` refuses such state before the Stack runs.)"""
    for module, bundle in params.items():
        if module.startswith(prefix) and not isinstance(bundle, Mapping):
            raise TypeError(
                f"{who}: `params[{module!r}]` is a {type(bundle).__name__} where Haiku keeps "
                "the module's dict of params, so the Stack's serving layout is leaf-wise "
                "(each stacked leaf a `stackwise.Serving`), not the core's (a whole "
                "module's tree per layer). Convert the stacked dict with "
                f"`stackwise.haiku.to_serving(params, {prefix[:-1]!r})`."
            )


def gather(
    positions: Sequence[dict], n: int, pattern: bool, module_name: str, who: str, what: str
) -> stackwise.Serving:
    """The core's per-layer trees of a served Stack's lifted ``positions`` (keyed below the
    Stack), checked with the leaves named as in the model's dict."""
    prefix = f"{module_name}/"
    named = [{prefix + m: b for m, b in tree.items()} for tree in positions]
    layers = _kit.serving.gather(named, n, pattern, who, what)
    cut = len(prefix)
    return stackwise.Serving(
        [{m[cut:]: b for m, b in layer.items()} for layer in layers.layers], layers.pattern
    )
