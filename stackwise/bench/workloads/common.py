"""What every workload module shares: the :class:`Case` it returns, the skeleton of a
framework's rows (:func:`framework_cases`) and the pieces of the two blocks."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import stackwise
from stackwise.bench.config import BenchConfig

#: ``build(n) -> (params, x, loss)``, with ``loss(params, x) -> scalar``.
Build = Callable[[int], tuple[Any, Any, Callable]]

#: The reference rows of every block: each row's ``/loop`` and ``/scan`` ratios are to these.
LOOP = "loop (separate params)"
SCAN = "lax.scan (hand)"

#: The remat settings every framework's tool and adapter rows run at, in table order:
#: none, the default policy (``stackwise.DEFAULT_REMAT``), full per-layer remat.
REMATS = ("off", "dots", "layer")


class Case(NamedTuple):
    """One variant (one row per depth): ``build(n)`` makes its params, input and loss."""

    name: str
    framework: str  # jax | haiku | flax | nnx
    remat: str  # off | dots | layer | nested
    build: Build
    tool: str = ""  # the row this one's /tool ratios are to (an adapter's tool, a control)


def tool_policy(remat: str) -> Callable | None:
    """The ``policy`` a tool's remat (``hk.remat``, ``nn.remat``, ``nnx.remat``) gets for
    ``remat`` ``"dots"`` (stackwise's default policy) or ``"layer"`` (none: full remat)."""
    return stackwise.DEFAULT_REMAT if remat == "dots" else None


def stack_remat(remat: str) -> Any:
    """The ``remat=`` an adapter's ``Stack`` gets for ``remat`` ``"off"``, ``"dots"``,
    ``"layer"``: ``False``, ``stackwise.DEFAULT_REMAT`` (its default), ``True``."""
    return {"off": False, "dots": stackwise.DEFAULT_REMAT, "layer": True}[remat]


def framework_cases(
    framework: str,
    *,
    loop: tuple[str, Build],
    tools: dict[str, str],
    tool: Callable[[str], Build],
    adapter: str,
    stack: Callable[[Any, str], Build],
    notes: list[str],
) -> list[Case]:
    """A framework's rows, the same for every framework, in this order:

    1. ``loop``: ``(name, build)`` of a Python loop over n blocks, in the framework.
    2. The framework's own tool (``hk.layer_stack``, ``nn.scan``...) at each remat of
       :data:`REMATS`: ``tools`` maps the remat to the row's name, ``tool(remat)`` gives
       its build. The ``off`` row runs a second time as ``"<name> (control)"``, compared
       with the first: its ratios are the run's noise floor.
    3. The adapter, module ``adapter`` (e.g. ``"stackwise.haiku"``), rows named
       ``"<adapter>.Stack"``, ``"... default"`` and ``"... remat"``: ``stack(module,
       remat)`` gives the build, and each row is compared with the tool's row of the same
       remat. An adapter that cannot be imported is skipped with a note.
    """
    off = tools["off"]
    cases = [
        Case(loop[0], framework, "off", loop[1]),
        Case(off, framework, "off", tool("off")),
        Case(f"{off} (control)", framework, "off", tool("off"), tool=off),
        *(Case(tools[r], framework, r, tool(r)) for r in REMATS[1:]),
    ]
    try:
        module = importlib.import_module(adapter)
    except ImportError as e:
        notes.append(f"{adapter}: not importable ({e}); its rows skipped.")
        return cases
    name = f"{adapter}.Stack"
    names = {"off": name, "dots": f"{name} default", "layer": f"{name} remat"}
    return cases + [Case(names[r], framework, r, stack(module, r), tool=tools[r]) for r in REMATS]


# ==========================================================================
# Pieces of the blocks.


def mean_square(y: jax.Array) -> jax.Array:
    """The loss of every variant: ``mean(y**2)``."""
    return jnp.mean(jnp.square(y))


def device(tree: Any) -> Any:
    """numpy -> device arrays without running a jax op (so without compiling one)."""
    return jax.tree.map(jax.device_put, tree)


def unstack(stacked: Any) -> list[Any]:
    """Per-layer params, as separate device arrays, sliced in numpy (no compiles)."""
    host = jax.tree.map(np.asarray, stacked)
    n = jax.tree.leaves(host)[0].shape[0]
    return [device(jax.tree.map(lambda a, i=i: a[i], host)) for i in range(n)]


def attend(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention from fused ``qkv [batch, seq, 3 * d]``: the
    transformer block's attention, the same function in every framework."""
    b, t, three_d = qkv.shape
    q, k, v = (a.reshape(b, t, heads, three_d // 3 // heads) for a in jnp.split(qkv, 3, -1))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, three_d // 3)


def python_loop(make_block: Callable, n: int, x: Any) -> Any:
    """``n`` blocks made by ``make_block()``, applied in a Python loop: the body of a Haiku
    or linen model written as the loop the stack replaces."""
    for _ in range(n):
        x = make_block()(x)
    return x


def initialised(init: Callable, apply: Callable, cfg: BenchConfig) -> tuple[Any, Any, Callable]:
    """``(params, x, loss)`` of a transformer model given as ``init(key, x) -> params`` and
    ``apply(params, x) -> y`` (a Haiku or linen model's ``init`` and ``apply``)."""
    x = transformer_input(cfg)
    return init(jax.random.key(cfg.seed), x), x, lambda p, h: mean_square(apply(p, h))


def transformer_input(cfg: BenchConfig) -> jax.Array:
    """The transformer block's input ``[tf_batch, tf_seq, tf_d]``, the same for every row."""
    rng = np.random.default_rng(cfg.seed + 1)
    return device(rng.standard_normal((cfg.tf_batch, cfg.tf_seq, cfg.tf_d), np.float32))
