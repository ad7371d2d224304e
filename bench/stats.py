"""Paired ratios of two variants' timings, with a distribution-free interval.

Repeat (or round) i of every variant is measured within seconds of the others, so the
ratio of two variants is taken per repeat and then summarised by its median: pairing
by i cancels the machine's slow drift, which an unpaired ratio of two medians keeps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from stackwise.bench.config import Result

__all__ = ["median_interval", "paired_interval", "paired_ratio"]

#: The probability, at most, that the true median lies below the interval (and above it).
TAIL = 0.025


def median_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """The median of ``values`` with a distribution-free ~95% interval for it.

    The interval is ``[q_(m+1), q_(k-m)]`` of the k sorted values, with the largest m such
    that ``P(Binomial(k, 1/2) <= m) <= 2.5%`` (order statistics: no assumption on the
    noise's shape). NaN bounds with fewer than 6 values.

    >>> median_interval([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    (2.5, 1.0, 4.0)
    >>> median_interval([1.0, 2.0, 3.0])
    (2.0, nan, nan)
    """
    q = sorted(values)
    k, m, tail = len(q), -1, 0.0
    while tail + math.comb(k, m + 1) / 2**k <= TAIL:
        m += 1
        tail += math.comb(k, m) / 2**k
    if m < 0:
        return statistics.median(q), math.nan, math.nan
    return statistics.median(q), q[m], q[k - 1 - m]


def paired_interval(r: Result, ref: Result, what: str) -> tuple[float, float, float]:
    """``r``'s compile or step time over ``ref``'s: the median of the per-repeat ratios,
    with :func:`median_interval`'s interval.

    Args:
      r, ref: two results of the same run (same block and depth).
      what: ``"compile"`` (the cold compiles, per repeat) or ``"step"`` (per round).

    Returns:
      ``(median, low, high)``. Without samples of equal length (rows read from a CSV
      written without them): the ratio of the summaries, and NaN bounds.
    """
    if what not in ("compile", "step"):
        raise ValueError(f"paired_interval: `what` is 'compile' or 'step', got {what!r}")
    a, b = getattr(r, f"{what}_samples"), getattr(ref, f"{what}_samples")
    if not a or len(a) != len(b):
        return getattr(r, f"{what}_s") / getattr(ref, f"{what}_s"), math.nan, math.nan
    return median_interval([x / y for x, y in zip(a, b)])


def paired_ratio(r: Result, ref: Result, what: str) -> float:
    """The median of :func:`paired_interval`: what the tables print as ``/scan`` etc.

    >>> fast = Result("mlp", 8, "jax", "a", "off", step_samples=(1.0, 2.0, 3.0))
    >>> slow = Result("mlp", 8, "jax", "b", "off", step_samples=(2.0, 2.0, 4.0))
    >>> paired_ratio(fast, slow, "step")  # the median of 0.5, 1.0, 0.75
    0.75
    """
    return paired_interval(r, ref, what)[0]
