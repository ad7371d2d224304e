"""The stack's options, validated once (by :func:`stackwise.stack`, the pipeline and each
adapter's constructor) and normalised into :class:`Options` (jax only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from stackwise._core import checks


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


def check_remat(remat: Any, who: str) -> tuple[bool, Callable[..., Any] | None]:
    """``remat`` (False/None, True or a checkpoint policy) as ``(rematted, policy)``, checked as
    :func:`stackwise.stack` checks it (:func:`stackwise.autostack` shares it)."""
    return _remat(remat, who)


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
    fsdp = checks.axis_names(fsdp, who, "fsdp", optional=True)
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


OPTION_NAMES = ("remat", "nested", "unroll", "reverse", "has_aux", "fsdp")


def stack_options(who: str, n: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The :data:`OPTION_NAMES` among a Stack's ``arguments``, checked now.

    An adapter's constructor passes its ``locals()``; the result is what it gives
    ``stackwise.stack``, so every adapter forwards the same options the same way.
    """
    options = {name: arguments[name] for name in OPTION_NAMES}
    check_options(who, n, **options)
    return options

