"""The adapter contract: what every adapter shares beyond the core's options (jax only).

Each adapter (``adapters/<framework>/_stack.py``) uses these so that the same failure reads
the same everywhere: one storage for the running layer's index and one exception type
outside a Stack, one way to name a block in messages, one check of ``Stack.from_layers``'
arguments, and one walk to where two blocks first differ. The stack's own options are
checked by :mod:`stackwise._core.options`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stackwise._core import checks, convert, serving, trees
from stackwise._core.options import stack_options

__all__ = [
    "Prebuilt",
    "at_layer",
    "block_name",
    "check_built",
    "check_built_options",
    "current_layer_index",
    "first_difference",
    "hold_options",
    "same_value",
    "stack_name",
]

# --------------------------------------------------------------------------
# The running layer's index, for `stackwise.<framework>.layer_index()`.

_LAYER_INDEX: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "stackwise_layer_index", default=None
)


@contextlib.contextmanager
def at_layer(index: Any) -> Iterator[None]:
    """Runs the body with ``index`` as the running layer's index (innermost wins)."""
    token = _LAYER_INDEX.set(index)
    try:
        yield
    finally:
        _LAYER_INDEX.reset(token)


def current_layer_index(framework: str) -> jax.Array:
    """The index set by the innermost :func:`at_layer`; RuntimeError outside one."""
    index = _LAYER_INDEX.get()
    if index is None:
        raise RuntimeError(
            f"stackwise.{framework}.layer_index() was called outside a block run by "
            f"`stackwise.{framework}.Stack`: it only has a value while a stacked block "
            "runs. Call it inside the block's `__call__`, or pass the index as an "
            "argument where the block runs on its own."
        )
    return index


# --------------------------------------------------------------------------
# The user's arguments of a Stack call, as one argument of `Stacked.apply`.


# --------------------------------------------------------------------------
# Names in messages.


def block_name(block: Any) -> str:
    """``Block``, ``partial(Block, ...)``, ``Block(...)`` for a template, ``<lambda>``."""
    if isinstance(block, Prebuilt):
        return block.name
    if isinstance(block, functools.partial):
        return f"partial({block_name(block.func)}, ...)"
    if isinstance(block, (list, tuple)):
        return "[" + ", ".join(block_name(b) for b in block) + "]"
    name = getattr(block, "__name__", None)
    if name is not None and callable(block):
        return name
    return type(block).__name__  # an instance


def stack_name(framework: str, block: Any, n: Any) -> str:
    """``stackwise.haiku.Stack(Block, n=4)``: how messages name an adapter's stack."""
    return f"stackwise.{framework}.Stack({block_name(block)}, n={n!r})"


def hold_options(module: Any, who: str, n: Any, arguments: Mapping[str, Any]) -> None:
    """Checks a Stack's options among its constructor's ``arguments`` (its ``locals()``),
    then sets ``n`` and each of :data:`~stackwise._core.options.OPTION_NAMES` on ``module``:
    how a Stack that is its own pytree (Equinox's static fields, NNX's static attributes)
    keeps them."""
    checked = stack_options(who, n, dict(arguments))
    module.n = n
    for name, value in checked.items():
        setattr(module, name, value)


# --------------------------------------------------------------------------
# A Stack of blocks built elsewhere: `Stack.from_layers(blocks, pattern=k)`.


class Prebuilt:
    """What ``Stack.from_layers`` gives the constructor in place of the block: the
    stacked layers (a list of k for a pattern) and the name messages call them by."""

    __slots__ = ("layers", "name")

    def __init__(self, layers: Any, name: str):
        self.layers, self.name = layers, name


def refuse_serving(who: str, loop: str, **values: Any) -> None:
    """Refuses a ``stackwise.Serving`` (the core's serving layout) in an adapter's params or
    state, named by keyword: a Stack runs its framework's stacked variables only. ``loop``
    is the adapter's exact conversion to a loop of blocks (each layer its own buffers)."""
    serving.refuse(
        who,
        "a Stack runs its framework's stacked variables only",
        f"For per-layer buffers, convert the Stack to a loop of the same blocks with "
        f"`{loop}` (exact), or serve the block's apply in the core: "
        "`stackwise.stack(None, apply, n, with_state=True)` over `stackwise.to_serving(stacked)`.",
        **values,
    )


def check_built(blocks: Iterable[Any], pattern: Any, module: type, what: str, who: str) -> list:
    """``Stack.from_layers(blocks, pattern=k)``'s arguments, checked; the blocks as a list.

    Every block must be an instance of ``module`` (``what`` names it: ``"an nnx.Module"``).
    """
    if isinstance(blocks, Mapping) or isinstance(blocks, module):
        got = "a dict" if isinstance(blocks, Mapping) else f"one {type(blocks).__name__}"
        raise TypeError(
            f"{who}: `blocks` must be a list of the built blocks in layer order, got {got}; "
            "pass e.g. `[block_0, block_1, ...]`"
            + (" (`list(blocks.values())`)." if isinstance(blocks, Mapping) else ".")
        )
    blocks = list(blocks)
    if not blocks:
        raise ValueError(f"{who}: needs at least one block, got none.")
    try:
        pattern = checks.integer(pattern, who, "pattern", minimum=1)
    except (TypeError, ValueError):
        raise TypeError(f"{who}: `pattern` must be a positive int, got {pattern!r}.") from None
    if len(blocks) < pattern:
        raise ValueError(
            f"{who}: a pattern of {pattern} kinds needs at least {pattern} blocks, got "
            f"{len(blocks)}."
        )
    for i, block in enumerate(blocks):
        if not isinstance(block, module):
            raise TypeError(f"{who}: block {i} must be {what}, got {type(block).__name__}.")
    return blocks


def check_built_options(options: dict[str, Any], allowed: Iterable[str], who: str) -> None:
    """``Stack.from_layers(blocks, **options)``: only the Stack's options, no keys/rngs.

    Built blocks already hold their params, so a key (``key=``, ``rngs=``) has nothing
    to build; an unknown name is refused before it reaches the constructor.
    """
    allowed = tuple(allowed)
    for name in options:
        if name in ("key", "rngs"):
            raise TypeError(
                f"{who}: got `{name}=`, but `from_layers` stacks blocks that are already "
                f"built (their params are kept as they are), so it takes no `{name}`; drop "
                f"it. To build new layers from a key, use `Stack(make_block, n, {name}=...)`."
            )
        if name not in allowed:
            raise TypeError(
                f"{who}: unknown option `{name}=`; the options are "
                + ", ".join(f"`{a}`" for a in allowed)
                + "."
            )


# --------------------------------------------------------------------------
# The depth check: every leaf of stacked params/state has the layer axis first.


# --------------------------------------------------------------------------
# The stack's options, validated once (by `stack()` and by each adapter's
# constructor) and normalised.


#: The options every adapter's Stack takes and passes on to :func:`stackwise.stack`.


# --------------------------------------------------------------------------
# Where two blocks first differ, for `from_layers`' messages.

#: A difference: where (``.mlp.kernel``) and how (``4 vs 5``).
Difference = tuple[str, str]
#: A framework's hook for its own nodes: ``None`` (not one of them), or the
#: difference found at the node itself, or its ``(name, child of a, child of b)``.
Expand = Callable[[Any, Any, str], "Difference | list[tuple[str, Any, Any]] | None"]


def same_value(a: Any, b: Any) -> bool | None:
    """``a == b``; None where ``==`` cannot tell (e.g. arrays inside): then only the
    one same object is the same."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- values `==` cannot compare: identity only
        return None



def first_difference(
    a: Any, b: Any, expand: Expand, *, arrays: bool = True, path: str = ""
) -> Difference | None:
    """Where and how two blocks differ in anything but their array values, or None.

    Arrays (JAX, NumPy or abstract) agree when their shapes and dtypes do, and are
    not compared at all with ``arrays=False``: a first pass over everything else
    names the cause (``.out_features: 4 vs 5``) rather than its effect (the kernel's
    shape). ``expand`` opens the framework's own nodes (NNX modules and variables,
    Equinox modules' fields); lists, tuples, dicts and other pytrees are opened
    here, and any other value must be ``==`` (or, where ``==`` cannot tell, the
    same object) in both.
    """
    where = path or "<root>"
    if not checks.same_array_kind(a, b):
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    if trees.is_abstract(a) or isinstance(a, (jax.Array, np.ndarray, np.generic)):
        same = jnp.shape(a) == jnp.shape(b) and checks.leaf_dtype(a) == checks.leaf_dtype(b)
        if same or not arrays:
            return None
        return where, f"{convert.array_text(a)} vs {convert.array_text(b)}"
    children = expand(a, b, path)
    if isinstance(children, tuple):
        return children
    if children is None and isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where, f"{len(a)} vs {len(b)} entries"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(a, b))]
    elif children is None and isinstance(a, dict):
        if set(a) != set(b):
            keys_a, keys_b = (", ".join(sorted(map(repr, d))) for d in (a, b))
            return where, f"keys [{keys_a}] vs [{keys_b}]"
        children = [(f"[{k!r}]", a[k], b[k]) for k in a]
    elif children is None:
        leaves_a, def_a = jax.tree_util.tree_flatten(a)
        leaves_b, def_b = jax.tree_util.tree_flatten(b)
        if leaves_a == [a]:  # a value that is not a pytree: shared, so it must be equal
            same = same_value(a, b)
            if same is None:
                return where, (
                    f"{a!r} vs {b!r}, which `==` cannot compare (arrays inside?), so the "
                    "blocks must share one object there"
                )
            return None if same else (where, f"{a!r} vs {b!r}")
        if def_a != def_b:
            return where, f"{def_a} vs {def_b}"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(leaves_a, leaves_b))]
    for name, u, v in children:
        found = first_difference(u, v, expand, arrays=arrays, path=path + name)
        if found:
            return found
    return None
