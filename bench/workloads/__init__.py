"""The workloads of ``stackwise-bench``: what each block's rows are and where they come from.

:data:`BLOCKS` is the one list to edit. A block names the workload modules of this
package that give its rows, in table order; each of them has a function named after the
block, ``<block>(cfg, notes) -> list[Case]``. A module is imported only when its block is
run, so the framework modules (``haiku``, ``flax``, ``nnx``, ``equinox``: the only modules of
``stackwise.bench`` that import a framework or an adapter) load only when asked for, and
one whose framework is missing is skipped with a note.

To add a framework to a block: a module ``<framework>.py`` whose ``<block>`` function
returns :func:`~stackwise.bench.workloads.common.framework_cases` (see ``haiku.py``), and
its name in the block's ``modules``. To add a block: its sizes and a ``<block>_ns`` field
of depths in :class:`~stackwise.bench.BenchConfig`, a function named after it in
``core.py`` (and in the framework modules that have it), and an entry here; the command
line gets ``--<block>-n`` from it.

The blocks: ``mlp`` (the core comparison), ``transformer`` (the adapters against the
frameworks' tools), ``decode`` and ``prefill`` (a KV-cache attention layer, inference:
one token, or a whole prompt, per call, with the cache donated and updated), ``pattern``
(a repeating pattern of two kinds of block, ``[a, a, b]``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from stackwise.bench.config import BenchConfig

if TYPE_CHECKING:
    from stackwise.bench.workloads.common import Case

#: ``common``'s names, re-exported on first use (``common`` imports JAX; the command line's
#: parser reads this registry without it).
_COMMON = ("LOOP", "REMATS", "SCAN", "Build", "Case", "framework_cases")


def __getattr__(name: str):
    if name in _COMMON:
        return getattr(importlib.import_module(f"{__name__}.common"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BLOCKS",
    "LOOP",
    "REMATS",
    "SCAN",
    "Block",
    "Build",
    "Case",
    "cases",
    "depths",
    "frameworks",
    "framework_cases",
    "select",
    "title",
]


class Block(NamedTuple):
    """A block: ``title`` (formatted with the config's fields), the config field with its
    depths, the workload modules that give its rows, in table order (a framework's module
    is named after its ``Case.framework``), and how a step runs:

    * ``grad``: a step is ``jit(grad(fn))`` (else ``jit(fn)``, e.g. for inference);
    * ``state``: a step threads state, e.g. a KV cache: its cases' builds give
      ``(params, state, x, step)`` with ``step(params, state, x) -> (y, state)``, jitted
      with the state donated, and each call is given the state the previous call
      returned (see :data:`~stackwise.bench.workloads.common.Build`);
    * ``warmup_n``: the depth of the warm-up compiles (small, but one that every row
      accepts);
    * ``min_n``: the smallest depth every row accepts (a pattern of k layers needs k).
    """

    title: str
    depths: str
    modules: tuple[str, ...]
    grad: bool = True
    state: bool = False
    warmup_n: int = 2
    min_n: int = 1


# The decode and prefill blocks: one layer and one harness, fed one token or a whole prompt.
_CACHED_ATTENTION = (
    "attention layer over a KV cache of {dec_cache} positions: D={dec_d}, heads={dec_heads}, "
    "batch={dec_batch}, {dec_dtype}; jit(step) with the cache donated"
)
_DECODING = dict(modules=("core", "haiku", "flax", "nnx", "equinox"), grad=False, state=True)

BLOCKS: dict[str, Block] = {
    "mlp": Block(
        "mlp block h + gelu(h @ w1) @ w2: D={d}, hidden={hidden}, batch={batch}"
        "; jit(grad(mean(y**2)))",
        "ns",
        ("core", "equinox"),
    ),
    "transformer": Block(
        "transformer block (pre-LN causal attention + MLP): D={tf_d}, hidden={tf_hidden}, "
        "heads={tf_heads}, seq={tf_seq}, batch={tf_batch}",
        "transformer_ns",
        ("core", "haiku", "flax", "nnx", "equinox"),
    ),
    "decode": Block(
        "decode: one token at position {dec_prompt} per call, " + _CACHED_ATTENTION
        + " (step ms = ms/token)",
        "decode_ns",
        **_DECODING,
    ),
    "prefill": Block(
        "prefill: a prompt of {dec_prompt} tokens in one call, " + _CACHED_ATTENTION,
        "prefill_ns",
        **_DECODING,
    ),
    "pattern": Block(
        "pattern [a, a, b] of mlp blocks h + gelu(h @ w1) @ w2: D={d}, hidden {hidden} (a) "
        "and {pattern_hidden} (b), batch={batch}; jit(grad(mean(y**2)))",
        "pattern_ns",
        ("core",),
        warmup_n=3,
        min_n=3,
    ),
}


def title(block: str, cfg: BenchConfig) -> str:
    """The block's title with ``cfg``'s sizes (and how it was measured, if one variant at a
    time).

    >>> title("mlp", BenchConfig())
    'mlp block h + gelu(h @ w1) @ w2: D=256, hidden=512, batch=64; jit(grad(mean(y**2)))'
    """
    text = BLOCKS[block].title.format(**dataclasses.asdict(cfg))
    if cfg.one_at_a_time:
        text += "; one variant at a time (its rounds not interleaved with the others')"
    return text


def depths(block: str, cfg: BenchConfig) -> tuple[int, ...]:
    """The depths ``n`` the block runs at."""
    return getattr(cfg, BLOCKS[block].depths)


def frameworks() -> list[str]:
    """Every framework with rows: ``jax`` (``core``) and the framework modules' names.

    >>> frameworks()
    ['jax', 'equinox', 'haiku', 'flax', 'nnx']
    """
    modules = dict.fromkeys(m for block in BLOCKS.values() for m in block.modules)
    return ["jax", *(m for m in modules if m != "core")]


def cases(block: str, cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """Every row of ``block``, in table order. What cannot be imported is skipped, and a
    note saying what and why (and how to install it) is added to ``notes``."""
    if block not in BLOCKS:
        raise ValueError(f"unknown block {block!r}; the blocks are {', '.join(BLOCKS)}")
    out: list[Case] = []
    for name in BLOCKS[block].modules:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError as e:
            if (e.name or "").startswith(__name__):
                raise  # a module named in BLOCKS is missing: a bug, not a missing framework
            top = (e.name or "").split(".")[0]
            if isinstance(e, ModuleNotFoundError) and top:
                why = f"{top}: not installed (pip install 'stackwise[{top}]')"
            else:
                why = f"{name}: not importable ({e})"
            notes.append(f"{why}; the {name} rows of the {block} block are skipped.")
            continue
        out += getattr(module, block)(cfg, notes)
    if BLOCKS[block].state and cfg.dec_dtype != "float32":
        from stackwise.bench.workloads.common import in_dtype

        out = [case._replace(build=in_dtype(case.build, cfg.dec_dtype)) for case in out]
    return out


def select(all_cases: Sequence[Case], wanted: Sequence[str]) -> list[Case]:
    """The cases whose name contains one of ``wanted`` (case-insensitive), or whose
    framework is one of them; all of them if ``wanted`` is empty."""
    if not wanted:
        return list(all_cases)
    wanted = [w.lower() for w in wanted]
    return [c for c in all_cases if any(w in c.name.lower() or w == c.framework for w in wanted)]
