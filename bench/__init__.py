"""``stackwise-bench``: compile time, step time and memory of layer stacking, side by side.

Run ``stackwise-bench`` (or ``python -m stackwise.bench``; ``--help`` for the options) to
see, in one process on one machine, what n blocks cost under ``jit(grad(loss))`` (and,
for decoding, a jitted step with the KV cache donated) written as Python loops, a
hand-written :func:`jax.lax.scan`, :func:`stackwise.stack` (remat off, default, full,
nested; layer patterns; state), the adapters ``stackwise.haiku.Stack``,
``stackwise.flax.Stack``, ``stackwise.nnx.Stack``, ``stackwise.equinox.Stack``, and the
frameworks' own tools ``hk.layer_stack``, ``nn.scan``, ``nnx.scan`` (for Equinox, the
hand-written ``eqx.filter_vmap`` + ``lax.scan``). It measures and reports; the project's
pass/fail targets are checked from its CSV by ``benchmarks/targets.py``.

One job per module:

* :mod:`~stackwise.bench.barriers`: bytes of params and constants passing optimisation
  barriers, from the lowered program's text;
* :mod:`~stackwise.bench.programs`: whether two compiled programs are the same;
* :mod:`~stackwise.bench.workloads`: the blocks and their variants, one module per
  framework (the only modules here that import a framework or an adapter, when asked);
* :mod:`~stackwise.bench.measure`: cold compiles, steady-state steps, memory;
* :mod:`~stackwise.bench.stats`: paired ratios and their intervals;
* :mod:`~stackwise.bench.report` and :mod:`~stackwise.bench.plot`: tables, CSV,
  Markdown, the figure;
* :mod:`~stackwise.bench.cli`: the command line.

Only jax, numpy and the standard library are imported with it; frameworks, rich, tqdm
and matplotlib are imported when used, and missing ones are skipped with a note.

The measuring machinery on a toy program (run the command for real numbers):

>>> import jax, jax.numpy as jnp
>>> from stackwise.bench import optimization_barrier_bytes
>>> def loss(ws, x):
...     for w in ws:  # the default `prevent_cse=True` wraps params in barriers
...         x = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)
...     return x.sum()
>>> ws = [jnp.ones((4, 4)) for _ in range(3)]
>>> text = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((2, 4))).as_text()
>>> optimization_barrier_bytes(text, n_params=3).params  # 3 layers x 16 floats x 4 bytes
192
"""

from typing import TYPE_CHECKING

#: Each public name and its module, imported on first use (PEP 562): the command line answers
#: ``--help`` and refuses a bad flag before JAX is imported.
_PUBLIC = {
    "BarrierBytes": "stackwise.bench.barriers",
    "optimization_barrier_bytes": "stackwise.bench.barriers",
    "main": "stackwise.bench.cli",
    "BenchConfig": "stackwise.bench.config",
    "Result": "stackwise.bench.config",
    "run_benchmark": "stackwise.bench.measure",
    "write_plot": "stackwise.bench.plot",
    "instructions_unlike": "stackwise.bench.programs",
    "program_fingerprint": "stackwise.bench.programs",
    "program_instructions": "stackwise.bench.programs",
    "print_report": "stackwise.bench.report",
    "read_csv": "stackwise.bench.report",
    "write_csv": "stackwise.bench.report",
    "write_markdown": "stackwise.bench.report",
    "paired_interval": "stackwise.bench.stats",
    "paired_ratio": "stackwise.bench.stats",
}

if TYPE_CHECKING:
    from stackwise.bench.barriers import BarrierBytes as BarrierBytes
    from stackwise.bench.barriers import optimization_barrier_bytes as optimization_barrier_bytes
    from stackwise.bench.cli import main as main
    from stackwise.bench.config import BenchConfig as BenchConfig
    from stackwise.bench.config import Result as Result
    from stackwise.bench.measure import run_benchmark as run_benchmark
    from stackwise.bench.plot import write_plot as write_plot
    from stackwise.bench.programs import instructions_unlike as instructions_unlike
    from stackwise.bench.programs import program_fingerprint as program_fingerprint
    from stackwise.bench.programs import program_instructions as program_instructions
    from stackwise.bench.report import print_report as print_report
    from stackwise.bench.report import read_csv as read_csv
    from stackwise.bench.report import write_csv as write_csv
    from stackwise.bench.report import write_markdown as write_markdown
    from stackwise.bench.stats import paired_interval as paired_interval
    from stackwise.bench.stats import paired_ratio as paired_ratio


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})

__all__ = [
    "BarrierBytes",
    "BenchConfig",
    "Result",
    "instructions_unlike",
    "main",
    "optimization_barrier_bytes",
    "paired_interval",
    "paired_ratio",
    "print_report",
    "program_fingerprint",
    "program_instructions",
    "read_csv",
    "run_benchmark",
    "write_csv",
    "write_markdown",
    "write_plot",
]
