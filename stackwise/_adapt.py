"""What the core and every adapter share: the layer index, names, checks, options.

Framework-free (jax only). Each adapter (``adapters/<framework>/_stack.py``)
uses these so that the same failure reads the same everywhere: one storage for
the running layer's index, one exception type outside a Stack, one depth check
and message, one validation of the stack's options (also used by
:func:`stackwise.stack` itself), one check of ``Stack.from_layers``' arguments, one
way to name a block in messages, and one walk to where two blocks first differ.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stackwise import _check

__all__ = [
    "OPTION_NAMES",
    "CallArgs",
    "Options",
    "Prebuilt",
    "at_layer",
    "block_name",
    "check_bool",
    "check_built",
    "check_built_options",
    "check_depth",
    "check_layer_axis_name",
    "check_layers",
    "check_options",
    "current_layer_index",
    "first_difference",
    "same_value",
    "stack_name",
    "stack_options",
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


@jax.tree_util.register_pytree_with_keys_class
class CallArgs:
    """A Stack call's ``(*args, **kwargs)``, passed on to ``Stacked.apply`` whole.

    Adapters call ``layers.apply(params, state, x, extras, CallArgs(args,
    kwargs))``; per-layer markers inside resolve as usual, and the core's
    messages name them as the user wrote them (``argument *args[0]``).
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = tuple(args), dict(kwargs)

    ARGS = jax.tree_util.GetAttrKey("_stackwise_call_args")
    KWARGS = jax.tree_util.GetAttrKey("_stackwise_call_kwargs")

    def tree_flatten_with_keys(self):
        return ((self.ARGS, self.args), (self.KWARGS, self.kwargs)), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


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


# --------------------------------------------------------------------------
# A Stack of blocks built elsewhere: `Stack.from_layers(blocks, pattern=k)`.


class Prebuilt:
    """What ``Stack.from_layers`` gives the constructor in place of the block: the
    stacked layers (a list of k for a pattern) and the name messages call them by."""

    __slots__ = ("layers", "name")

    def __init__(self, layers: Any, name: str):
        self.layers, self.name = layers, name


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
        pattern = _check.integer(pattern, who, "pattern", minimum=1)
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


check_depth = _check.check_depth  # one depth check for the core and every adapter
tree_leaves = _check.named_leaves  # ``(keystr path, leaf)`` pairs, for check_depth


# --------------------------------------------------------------------------
# The stack's options, validated once (by `stack()` and by each adapter's
# constructor) and normalised.


class Options(NamedTuple):
    """Validated options of a stack (see :func:`stackwise.stack`)."""

    remat: bool  # rematerialise each layer
    policy: Callable[..., Any] | None  # the jax.checkpoint policy (None: save nothing)
    nested: bool | int
    unroll: int | bool  # a positive int, or True for a Python loop
    reverse: bool
    has_aux: bool
    fsdp: tuple[str, ...] | None  # mesh axes each layer's params are gathered over


_POLICY_FACTORIES = tuple(
    getattr(jax.checkpoint_policies, name)
    for name in (
        "save_only_these_names",
        "save_any_names_but_these",
        "save_anything_except_these_names",
        "save_and_offload_only_these_names",
        "save_from_both_policies",
        "offload_dot_with_no_batch_dims",
    )
    if hasattr(jax.checkpoint_policies, name)
)


def check_bool(value: Any, arg: str, who: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"{who}: `{arg}` must be True or False, got {type(value).__name__} {value!r}."
        )
    return value


def _remat(remat: Any, who: str) -> tuple[bool, Callable[..., Any] | None]:
    if remat is False or remat is None:
        return False, None
    if remat is True:
        return True, None
    example = "e.g. `jax.checkpoint_policies.dots_saveable`"
    if remat in (jax.checkpoint, jax.remat):
        raise TypeError(
            f"{who}: `remat` takes True or a checkpoint policy, not `jax.checkpoint` "
            f"itself: stackwise applies `jax.checkpoint` to each layer. Pass "
            f"`remat=True`, or a policy ({example})."
        )
    if any(remat is f for f in _POLICY_FACTORIES):
        raise TypeError(
            f"{who}: `remat={remat.__name__}` is a policy factory, not a policy: call "
            f"it, e.g. `remat=jax.checkpoint_policies.{remat.__name__}(...)` (with "
            "`stackwise.CARRY_NAME` among the names to save the carry between layers)."
        )
    if not callable(remat):
        raise TypeError(
            f"{who}: `remat` must be False, True or a policy from "
            f"`jax.checkpoint_policies` ({example}), got {type(remat).__name__} {remat!r}."
        )
    return True, remat


def check_layers(init: Any, apply: Any, who: str) -> tuple[tuple | None, tuple, bool]:
    """``stack``'s ``init`` and ``apply`` (functions, or a pattern of k each), checked.

    Returns ``(inits or None, applies, is_pattern)`` with ``inits`` and ``applies`` tuples.
    """
    pattern = isinstance(apply, (list, tuple))
    applies = tuple(apply) if pattern else (apply,)
    if init is None:
        inits = None
    elif pattern != isinstance(init, (list, tuple)):
        raise TypeError(
            f"{who}: for a pattern, `init` and `apply` are both sequences of k "
            f"functions (or `init=None`); got init of type {type(init).__name__} and "
            f"apply of type {type(apply).__name__}."
        )
    else:
        inits = tuple(init) if pattern else (init,)
        if all(i is None for i in inits):
            inits = None
        elif len(inits) != len(applies):
            raise ValueError(
                f"{who}: the pattern has {len(inits)} `init` functions but "
                f"{len(applies)} `apply` functions; give one of each per position."
            )
    if not applies:
        raise ValueError(f"{who}: a pattern needs at least one layer; `apply` is empty.")
    for arg, fns in (("init", inits or ()), ("apply", applies)):
        for i, fn in enumerate(fns):
            if not callable(fn):
                where = f"`{arg}[{i}]`" if pattern else f"`{arg}`"
                raise TypeError(
                    f"{who}: {where} must be callable, got {type(fn).__name__} {fn!r}. "
                    "Call it as `stackwise.stack(init, apply, n)`."
                )
    return inits, applies, pattern


def check_options(
    who: str,
    n: Any,
    *,
    remat: Any,
    nested: Any,
    unroll: Any,
    reverse: Any,
    has_aux: Any,
    fsdp: Any = None,
) -> Options:
    """Validates a stack's options; raises TypeError/ValueError naming the argument."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(
            f"{who}: `n` must be a Python int (the number of layers), got "
            f"{type(n).__name__} {n!r}. The depth is static: for a data-dependent number "
            "of iterations use `jax.lax.while_loop`."
        )
    if n < 1:
        raise ValueError(f"{who}: `n` must be at least 1, got {n}.")
    rematted, policy = _remat(remat, who)
    if unroll is False:
        unroll = 1  # as in lax.scan: no unrolling
    positive_int = isinstance(unroll, int) and not isinstance(unroll, bool) and unroll >= 1
    if unroll is not True and not positive_int:
        raise TypeError(
            f"{who}: `unroll` must be a positive int (passed to `lax.scan`) or True (a "
            f"Python loop), got {unroll!r}."
        )
    if not (isinstance(nested, bool) or (isinstance(nested, int) and nested >= 1)):
        raise TypeError(
            f"{who}: `nested` must be a bool or a positive int group size, got {nested!r}."
        )
    fsdp = _check.axis_names(fsdp, who, "fsdp", optional=True)
    return Options(
        remat=rematted,
        policy=policy,
        nested=nested,
        unroll=unroll,
        reverse=check_bool(reverse, "reverse", who),
        has_aux=check_bool(has_aux, "has_aux", who),
        fsdp=fsdp,
    )


def check_layer_axis_name(value: Any, who: str) -> str | None:
    """A Stack's ``layer_axis_name``: the logical name of the layer axis, a str or None."""
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{who}: `layer_axis_name` must be None or the logical name of the layer axis "
            f"(a str, e.g. 'layers', mapped to mesh axes by the logical rules), got "
            f"{type(value).__name__} {value!r}."
        )
    return value


#: The options every adapter's Stack takes and passes on to :func:`stackwise.stack`.
OPTION_NAMES = ("remat", "nested", "unroll", "reverse", "has_aux", "fsdp")


def stack_options(who: str, n: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The :data:`OPTION_NAMES` among a Stack's ``arguments``, checked now.

    An adapter's constructor passes its ``locals()``; the result is what it gives
    ``stackwise.stack``, so every adapter forwards the same options the same way.
    """
    options = {name: arguments[name] for name in OPTION_NAMES}
    check_options(who, n, **options)
    return options


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


def _describe(a: Any) -> str:
    return f"{_check.leaf_dtype(a).name}{list(jnp.shape(a))}"


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
    if not _check.same_array_kind(a, b):
        return where, f"{type(a).__name__} vs {type(b).__name__}"
    if _check.is_abstract(a) or isinstance(a, (jax.Array, np.ndarray, np.generic)):
        same = jnp.shape(a) == jnp.shape(b) and _check.leaf_dtype(a) == _check.leaf_dtype(b)
        return None if same or not arrays else (where, f"{_describe(a)} vs {_describe(b)}")
    children = expand(a, b, path)
    if isinstance(children, tuple):
        return children
    if children is None and isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where, f"{len(a)} vs {len(b)} entries"
        children = [(f"[{i}]", u, v) for i, (u, v) in enumerate(zip(a, b))]
    elif children is None and isinstance(a, dict):
        if set(a) != set(b):
            return where, f"keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
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
