"""The figure: compile time, step time and temp memory of every variant, per block.

A block measured at several depths gets three log-log panels against n (one line per
variant); a block measured at one depth gets three dot charts (one row per variant).
Colour says the family (Python loop, hand-written scan, stackwise, each framework), its
shade and the marker the variant within it (darkest first), and line style the kind (solid
with filled markers: stackwise; dashed with open markers: a framework's tool or the
hand-written scan; dotted: a loop). In the memory panel (exact sizes, not noisy timings),
series with equal values at every depth are drawn side by side, shifted left and right a
little around each n, and the panel says so.
matplotlib is imported when a plot is written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax

from stackwise.bench.config import Result
from stackwise.bench.report import FRAMEWORK_NAMES, machine

__all__ = ["family", "write_plot"]

# Okabe-Ito: distinct for colour-blind readers and in greyscale print.
_COLOURS = {
    "Python loop": "#000000",
    "hand-written lax.scan": "#E69F00",
    "stackwise.stack": "#0072B2",
    "Haiku": "#009E73",
    "Flax linen": "#D55E00",
    "Flax NNX": "#CC79A7",
    "Equinox": "#882255",  # (Paul Tol's wine: Okabe-Ito's sky blue is too near stackwise's)
}
_SPARE_COLOURS = ("#56B4E9", "#999999", "#F0E442")
#: How far the lightest shade of a family's colour goes towards white.
_LIGHTEST = 0.45
#: Series within this relative difference at every depth are drawn side by side.
_SAME = 0.005
#: The x factor between side-by-side series (log scale: the same gap at every n).
_DODGE = 1.03
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_PANELS = (  # (title, unit, value of a result, exact: equal values are drawn side by side)
    ("cold compile", "s", lambda r: r.compile_s, False),
    ("step time (median)", "ms", lambda r: r.step_s * 1e3, False),
    ("compiled temp memory", "MiB", lambda r: r.temp_bytes / 2**20, True),
)


def family(r: Result) -> str:
    """The family a result is coloured by: its framework, or for pure JAX rows whether it
    is a Python loop, a hand-written ``lax.scan`` or ``stackwise.stack``.

    >>> family(Result("mlp", 8, "jax", "stackwise remat", "layer"))
    'stackwise.stack'
    >>> family(Result("transformer", 8, "haiku", "hk.layer_stack", "off"))
    'Haiku'
    """
    if r.framework != "jax":
        return FRAMEWORK_NAMES.get(r.framework, r.framework)
    for prefix, name in (("loop", "Python loop"), ("lax.scan", "hand-written lax.scan"),
                         ("stackwise", "stackwise.stack")):
        if r.variant.startswith(prefix):
            return name
    return FRAMEWORK_NAMES["jax"]


def write_plot(results: Sequence[Result], path: str, *, title: str | None = None) -> str | None:
    """Writes the figure as a PNG at ``path``. Returns a note if nothing was written.

    Args:
      results: what :func:`~stackwise.bench.run_benchmark` returned (or ``read_csv``).
      path: the PNG's path.
      title: the figure's title (default: jax's version and this machine).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib not installed: no plot written (pip install matplotlib)."
    blocks = list(dict.fromkeys(r.block for r in results))
    if not blocks:
        return "no results to plot."
    styles = _styles(results)
    mine = {b: [r for r in results if r.block == b] for b in blocks}
    lines = {b: len({r.n for r in mine[b]}) > 1 for b in blocks}
    heights = [3.8 if lines[b] else 1.2 + 0.24 * len({r.variant for r in mine[b]})
               for b in blocks]
    fig = Figure(figsize=(15, sum(heights) + 0.4), layout="constrained")
    subfigs = fig.subfigures(len(blocks), 1, height_ratios=heights, squeeze=False).flat
    for sub, block in zip(subfigs, blocks):
        (_lines if lines[block] else _dots)(sub, block, mine[block], styles)
    fig.suptitle(title or f"stackwise-bench: jax {jax.__version__}, {machine()}", fontsize=10)
    fig.savefig(path, dpi=110)
    return None


def _styles(results: Sequence[Result]) -> dict[str, dict[str, Any]]:
    """Per variant: colour by family, marker by order within the family, line (and open
    or filled marker) by kind: stackwise, a framework's tool, a loop."""
    spare = itertools.cycle(_SPARE_COLOURS)
    colours = dict(_COLOURS)
    members: dict[str, list[str]] = {}
    for r in results:
        if r.variant not in members.setdefault(family(r), []):
            members[family(r)].append(r.variant)
    out = {}
    for fam, variants in members.items():
        if fam not in colours:
            colours[fam] = next(spare)
        for i, (variant, marker) in enumerate(zip(variants, itertools.cycle(_MARKERS))):
            kind = ":" if "loop" in variant else "-" if "stackwise" in variant else "--"
            shade = _LIGHTEST * i / max(len(variants) - 1, 1)
            out[variant] = dict(color=_lighter(colours[fam], shade), marker=marker,
                                linestyle=kind, fillstyle="none" if kind == "--" else "full",
                                family=fam)
    return out


def _lighter(colour: str, amount: float) -> str:
    """``colour`` (``#rrggbb``) moved ``amount`` (0 to 1) of the way to white."""
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _dodges(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Per series ``[(n, value), ...]``: the factor its n are drawn at, spreading the series
    with equal values (within :data:`_SAME`) side by side around n; 1 for the others."""
    out = {}
    for variant, pts in series.items():
        same = [v for v, other in series.items() if pts and _coincide(pts, other)]
        out[variant] = _DODGE ** (same.index(variant) - (len(same) - 1) / 2) if same else 1.0
    return out


def _coincide(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        abs(u - v) <= _SAME * max(abs(u), abs(v)) for (_, u), (_, v) in zip(a, b)
    )


def _log_ticks(axis: Any, values: Sequence[float]) -> None:
    """Log-scale ticks at round numbers (1, 2, 5 x 10^k; finer where ``values`` span less
    than a decade), labelled as plain numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo, hi = min(values) / 1.1, max(values) * 1.1
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), tuple(range(1, 10))):
        ticks = [m * 10.0**k for k in decades for m in mantissas if lo <= m * 10.0**k <= hi]
        if len(ticks) >= 3:
            break
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _lines(sub: Any, block: str, results: list[Result], styles: dict) -> None:
    from matplotlib.ticker import NullLocator, ScalarFormatter

    ns = sorted({r.n for r in results})
    axes = sub.subplots(1, len(_PANELS))
    for ax, (what, unit, value, exact) in zip(axes, _PANELS):
        values = [value(r) for r in results if value(r) > 0]
        series = {}
        for variant in dict.fromkeys(r.variant for r in results):
            pts = sorted((r.n, value(r)) for r in results if r.variant == variant)
            series[variant] = [(n, v) for n, v in pts if v > 0]
        dodges = _dodges(series) if exact else {}
        for variant, pts in series.items():
            dodge = dodges.get(variant, 1.0)
            style = {k: v for k, v in styles[variant].items() if k != "family"}
            ax.plot([p[0] * dodge for p in pts], [p[1] for p in pts], label=variant,
                    markersize=5, linewidth=1.4, **style)
        if any(d != 1.0 for d in dodges.values()):
            ax.text(0.02, 0.98, "equal values: drawn side by side", transform=ax.transAxes,
                    fontsize=7, color="0.35", va="top")
        ax.set(xscale="log", yscale="log", title=f"{block}: {what}", xlabel="n (layers)",
               ylabel=unit)
        ax.set_xticks(ns)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        _log_ticks(ax.yaxis, values)
        ax.grid(True, which="major", alpha=0.3)
        ax.grid(True, which="minor", alpha=0.1)
    handles, labels = axes[0].get_legend_handles_labels()
    sub.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)


def _dots(sub: Any, block: str, results: list[Result], styles: dict) -> None:
    from matplotlib.lines import Line2D

    variants = list(dict.fromkeys(r.variant for r in results))
    n = results[0].n
    y = {v: i for i, v in enumerate(variants)}
    axes = sub.subplots(1, len(_PANELS), sharey=True)
    for ax, (what, unit, value, _) in zip(axes, _PANELS):
        values = [value(r) for r in results if value(r) > 0]
        for r in results:
            style = {k: v for k, v in styles[r.variant].items() if k != "family"}
            if value(r) > 0:
                ax.plot([value(r)], [y[r.variant]], markersize=7, **{**style, "linestyle": ""})
        ax.set(xscale="log", title=f"{block}, n={n}: {what}", xlabel=unit)
        _log_ticks(ax.xaxis, values)
        ax.grid(True, axis="x", which="major", alpha=0.3)
        ax.grid(True, axis="x", which="minor", alpha=0.1)
        for i in range(1, len(variants)):  # a rule between families
            if styles[variants[i]]["family"] != styles[variants[i - 1]]["family"]:
                ax.axhline(i - 0.5, color="0.8", linewidth=0.8)
    axes[0].set_yticks(range(len(variants)), variants, fontsize=8)
    axes[0].invert_yaxis()
    for label, variant in zip(axes[0].get_yticklabels(), variants):
        label.set_color(styles[variant]["color"])
    families = dict.fromkeys(styles[v]["family"] for v in variants)
    key = [Line2D([], [], color=next(s["color"] for s in styles.values() if s["family"] == f),
                  marker="o", linestyle="none") for f in families]
    sub.legend(key, list(families), loc="outside right upper", fontsize=8, frameon=False)
