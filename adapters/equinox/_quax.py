"""quax values (``quax.examples.lora.LoraArray`` and the like) in a :class:`Stack`.

quax dispatches on its values only inside ``quax.quaxify``, and it has no rule for
``jax.checkpoint``: a stack's remat sees a ``LoraArray`` and quax refuses to materialise
it. So the stack quaxifies each layer itself, inside the scan and the remat: the
``LoraArray`` s in its params are plain pytrees of stacked arrays to the scan and the
remat (sliced per layer like any array), and only the layer's own call sees them as quax
values. quax is imported only when a stack's params hold a quax value, so only once the
user has imported quax.

Under an outer ``quax.quaxify`` the stack's params are quax's tracers instead, which the
stack cannot open: :func:`quaxify` keeps the stacks out of the outer one. Telling those
tracers' values apart (to refuse them under remat with that fix) reads quax's private
types: the one tie to quax, dated (:data:`QUAX_MIRRORS`), probed on first use (:func:`tie`)
and refused with :class:`QuaxChanged`, naming both releases, if it no longer holds.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

__all__ = [
    "QUAX_MIRRORS",
    "QuaxChanged",
    "Tie",
    "check_outer",
    "holds_values",
    "layer",
    "quaxify",
    "tie",
]


def _quax() -> Any:
    """The quax module if it is loaded, else None (a quax value cannot exist without it)."""
    return sys.modules.get("quax")


def _is_value(quax: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, quax.Value)


def holds_values(tree: Any) -> bool:
    """Whether ``tree`` holds a quax value (a ``LoraArray``), without importing quax."""
    quax = _quax()
    if quax is None:
        return False
    is_value = _is_value(quax)
    return any(is_value(v) for v in jax.tree.leaves(tree, is_leaf=is_value))


def layer(block: Any) -> Any:
    """The block as the layer calls it: quaxified, so its quax values dispatch."""
    return _quax().quaxify(block)


# --------------------------------------------------------------------------
# The one tie to quax's internals, dated and guarded as stackwise/_upstream/ does.

#: The quax release the tie below was read from and checked against.
QUAX_MIRRORS = "0.4.6"


#: Where the tie's private types live in quax 0.4.6: (module, name).
NAMES = {"tracer": ("quax._trace", "_QuaxTracer"), "dense": ("quax._values", "_DenseArrayValue")}


class Tie(NamedTuple):
    """quax's private types that tell an outer ``quax.quaxify``'s values apart."""

    tracer: type  # quax._trace._QuaxTracer: the leaf quaxify passes, its quax value at `.value`
    dense: type  # quax._values._DenseArrayValue: the `.value` of a plain array's tracer


class QuaxChanged(RuntimeError):
    """The tie to quax's internals no longer holds with the installed quax."""

    def __init__(self, detail: str):
        version = getattr(_quax(), "__version__", "of unknown version")
        super().__init__(
            f"stackwise.equinox: quax changed under stackwise: the tie to quax's tracer "
            f"(`quax._trace._QuaxTracer`, `.value`, `quax._values._DenseArrayValue`; "
            f"adapters/equinox/_quax.py, written against quax {QUAX_MIRRORS}; quax "
            f"{version} is installed) no longer holds: {detail}. It tells a Stack run with "
            "remat under `quax.quaxify` which values it can run; call "
            "`stackwise.equinox.quaxify(model)(x)` in place of `quax.quaxify(model)(x)`, "
            "which needs no tie, or pin quax to the release named."
        )


@functools.cache
def _probed() -> Tie | str:
    """The tie's types, checked on a probe (traced only); a str says why it fails."""
    quax = _quax()
    try:
        tie = Tie(**{k: getattr(importlib.import_module(m), n) for k, (m, n) in NAMES.items()})
        zero = quax.zero.Zero((2,), jnp.float32)
        seen = []

        def probe(x, z):
            seen.extend([z, z + x])  # a quax value's tracer; a plain result's tracer
            return x

        shape = jax.ShapeDtypeStruct((2,), jnp.float32)
        jax.eval_shape(lambda x: quax.quaxify(probe)(x, zero), shape)
    except Exception as e:  # a name moved, or quaxify no longer runs the probe
        return f"its probe raised {type(e).__name__}: {e}"
    kinds = [(type(t).__name__, type(getattr(t, "value", None)).__name__) for t in seen]
    ok = (
        all(isinstance(t, tie.tracer) for t in seen)
        and seen[0].value is zero
        and type(seen[1].value) is tie.dense
    )
    return tie if ok else f"quaxify passed {kinds}, not its tracers of a Zero and of a plain array"


def tie() -> Tie:
    """The tie's types, probed on first use; :class:`QuaxChanged` if it no longer holds."""
    found = _probed()
    if isinstance(found, str):
        raise QuaxChanged(found)
    return found


def _hidden_value(leaf: Any) -> bool:
    """A leaf that is an outer ``quax.quaxify``'s tracer of a value other than an array."""
    if not (isinstance(leaf, jax.core.Tracer) and type(leaf).__module__.startswith("quax.")):
        return False  # (only quax's tracers come from its modules: no tie is read)
    types = tie()
    if not isinstance(leaf, types.tracer):
        return False  # another quax tracer than quaxify's: quax speaks for it
    # A LoraArray made with `allow_materialise=True` is materialised by quax inside the
    # remat, one layer at a time: it runs (as the sum of the weights), so it is let through.
    allowed = getattr(leaf.value, "allow_materialise", False) is True
    return type(leaf.value) is not types.dense and not allowed


def check_outer(params: tuple, pattern: bool, remat: Any, who: str) -> None:
    """Refuses params that an outer ``quax.quaxify`` turned into its tracers, under remat.

    ``params``: each pattern position's stacked arrays (one without a pattern).
    """
    if remat is False:
        return  # quax's own scan rule runs the layers: no jax.checkpoint to refuse
    for p, sub in enumerate(params):
        found = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(sub)
                 if _hidden_value(leaf)]
        if found:
            path, leaf = found[0]
            where = "layers" + (f"[{p}]" if pattern else "") + jax.tree_util.keystr(path)
            raise TypeError(
                f"{who}: the stacked array at `{where}` is a "
                f"quax {type(leaf.value).__name__} seen through `quax.quaxify`, which has "
                "no rule for the stack's remat (`jax.checkpoint`): it would refuse to "
                "materialise it. The Stack runs quax values itself, one layer at a time, "
                "when quax's own quaxify leaves it out: call "
                "`stackwise.equinox.quaxify(model)(x)` in place of "
                "`quax.quaxify(model)(x)`, or call the Stack directly."
            )


class _Quaxified(eqx.Module):
    """``fn`` quaxified outside its stacks when called (a Module, so that ``fn``'s arrays
    stay its leaves for ``eqx.filter_jit`` and ``eqx.filter_grad``)."""

    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import quax

        from stackwise.equinox._stack import Stack  # (that module imports this one)

        is_stack = lambda v: isinstance(v, Stack)  # noqa: E731
        is_leaf = lambda v: is_stack(v) or isinstance(v, quax.Value)  # noqa: E731
        tree = (self.fn, args, kwargs)
        spec = jax.tree.map(lambda v: not is_stack(v), tree, is_leaf=is_leaf)
        return quax.quaxify(self.fn, filter_spec=spec)(*args, **kwargs)


def quaxify(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``quax.quaxify(fn)`` that leaves every :class:`Stack` to quaxify its own layers.

    The same as ``quax.quaxify(fn)`` with a ``filter_spec`` that is False on each
    :class:`~stackwise.equinox.Stack` in ``fn`` and its arguments: quax values in a stack
    reach it unwrapped, and the stack runs each layer quaxified inside its scan and
    remat (quax has no rule for ``jax.checkpoint``); every other quax value is quaxified
    as ``quax.quaxify`` would.

    >>> import jax, jax.numpy as jnp, equinox as eqx, quax, stackwise.equinox
    >>> from functools import partial
    >>> class Model(eqx.Module):
    ...     blocks: stackwise.equinox.Stack
    ...     head: eqx.nn.Linear
    ...     def __call__(self, x):
    ...         return self.head(self.blocks(x))
    >>> model = Model(stackwise.equinox.Stack(partial(eqx.nn.Linear, 4, 4), n=3,
    ...                                       key=jax.random.key(0)),
    ...               eqx.nn.Linear(4, 2, key=jax.random.key(1)))
    >>> lora = quax.examples.lora.loraify(model, rank=2, key=jax.random.key(2))
    >>> lora.blocks.layers.weight.a.shape         # one adapter per layer: (n, out, r)
    (3, 4, 2)
    >>> stackwise.equinox.quaxify(lora)(jnp.ones(4)).shape
    (2,)

    Args:
      fn: the function (or model) to call, as for ``quax.quaxify``.

    Returns:
      ``fn``, quaxified outside its stacks.
    """
    if not callable(fn):
        raise TypeError(
            f"stackwise.equinox.quaxify: `fn` must be a function or a model to call, got "
            f"{type(fn).__name__}; e.g. `stackwise.equinox.quaxify(model)(x)`."
        )
    return _Quaxified(fn)
