"""How far a float32 result may be from its reference when only the order of the sums differs.

A stack's scan and a Python loop, a pipeline's microbatches and one batch, 8 devices and one:
each pair does the same arithmetic, but may add the same terms in another order (a matmul's
blocking, a gradient summed per microbatch then across them, an all-reduce's tree, the CPU's
vector width and fused multiply-adds), and the order decides the last bits. How many bits is a
property of what is summed, not of the machine, so every comparison here is relative, leaf by
leaf::

    max|got - want| <= bound * eps * scale

with ``eps`` float32's machine epsilon (2**-23), ``scale`` the leaf's largest ``|want|`` (or,
where the leaf is a sum that may cancel, as a loss of ``sin`` s, the magnitude of what was
summed: ``sum|terms|``), and ``bound`` from ``reassociation_bound``: what is summed, chained.

The bound. A k-term float32 sum (or dot product) in any order is within (k - 1) u sum|terms|
of the exact sum in the worst case (u = eps / 2; Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 4.2); but that case needs every rounding to err the same way.
Rounding errors of independent sign give, with probability at least 1 - 2k exp(-lambda**2 / 2),
at most lambda sqrt(k) u sum|terms| (Higham and Mary, "A new approach to probabilistic rounding
error analysis", SIAM J. Sci. Comput. 41(5), 2019, theorems 2.4 and 3.1): two orders are then
within lambda sqrt(k) eps of each other. A chain of ``depth`` layers, each summing ``width``
products, carries each layer's error on into the next (to first order, with gain about 1 for
the tests' residual layers): one long sum of ``depth * width`` terms, and a gradient or loss adds
its ``summed`` per-row (per-microbatch, per-device) contributions on top. With lambda = 8 (the
bound fails by chance with probability below 1e-10 for the tests' k), a 16-layer width-8 stack
whose gradient sums 16 rows may differ by 8 sqrt(144) = 96 eps * scale, 1.1e-5 of the scale. The
worst case, 2 (k - 1) = 286 eps here, grows past what a check must catch for the larger sums (a
loss over 64 x 64 outputs: 2 x 4,600 eps, over 1e-3 of the scale).

What the checks still catch: a relative error of 1e-3 in any leaf is 8,389 eps * scale, over 10
times every bound in the suite; an error in the code (a layer skipped, a microbatch counted twice,
params of the wrong layer) is far larger.

Where the code promises bitwise equality (checkpoint round trips, conversions), compare exactly
instead (tests/_trees.py: ``assert_trees_bitwise``).

The workers of tests/distributed run in a subprocess and send JSON back: they return the
report of ``compare`` (a dict), and the test checks it with ``check``.
"""

from __future__ import annotations

import math

import jax
import numpy as np

#: float32's machine epsilon, 2**-23: the spacing of float32 numbers at 1.0.
EPS = float(np.finfo(np.float32).eps)
#: Higham and Mary's lambda: a k-term sum's rounding exceeds lambda sqrt(k) u sum|terms| with
#: probability below 2k exp(-lambda**2 / 2), 1e-10 for k up to 10,000.
LAMBDA = 8


def reassociation_bound(*, depth: int, width: int, summed: int = 1) -> int:
    """How many ``eps * scale`` two float32 evaluations of a model may differ by, when they
    differ only in the order of their sums (the module's docstring derives it).

    Args:
      depth: the layers chained from the input to the output (the backward pass runs the
        same chain back).
      width: the terms of each layer's sums (a matmul's contraction length).
      summed: the terms of the outer sums on top of the chain (a gradient's sum over the
        batch's rows, a loss's over its elements).

    Returns:
      ``LAMBDA * sqrt(depth * width + summed)``, rounded up.
    """
    return math.ceil(LAMBDA * math.sqrt(depth * width + summed))


def compare(got, want, scale: float | None = None) -> dict:
    """The leaf where ``got`` is farthest from ``want``, relative to that leaf's scale.

    Args:
      got, want: pytrees of one structure (``got``'s leaves may hold ``want``'s in another
        shape of the same size, as a circular pipeline's ``(repeats, n / repeats, ...)``).
      scale: the magnitude of what was summed (``sum|terms|`` of a loss), for every leaf; by
        default each leaf's largest ``|want|``.

    Returns:
      A JSON-able report ``{"leaf", "err", "scale", "in_eps"}``: the leaf's path, its largest
      ``|got - want|``, its scale, and that error in units of ``eps * scale``.
    """
    got_leaves, tree = jax.tree_util.tree_flatten(got)
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    if tree != jax.tree_util.tree_structure(want):
        raise AssertionError(f"the trees differ: {tree} against {jax.tree.structure(want)}")
    reports = []
    for a, (path, b) in zip(got_leaves, want_leaves):
        b = np.asarray(b, np.float64)
        a = np.asarray(a, np.float64).reshape(b.shape)
        err = float(np.max(np.abs(a - b))) if b.size else 0.0
        s = float(scale) if scale is not None else float(np.max(np.abs(b), initial=0.0))
        in_eps = err / (EPS * s) if s else (0.0 if err == 0 else float("inf"))
        reports.append({"leaf": jax.tree_util.keystr(path) or "<root>", "err": err, "scale": s,
                        "in_eps": in_eps})
    return worst(*reports)


def worst(*reports: dict) -> dict:
    """The report with the largest error in units of ``eps * scale``."""
    return max(reports, key=lambda r: r["in_eps"])


def check(report: dict, bound: float, what: str = "") -> None:
    """Fails unless the report's error is within ``bound * eps * scale``, naming the leaf,
    the error and the bound."""
    if not report["in_eps"] <= bound:
        raise AssertionError(
            f"{what + ': ' if what else ''}leaf {report['leaf']} differs by {report['err']:.4g}"
            f" = {report['in_eps']:.1f} eps * scale (scale {report['scale']:.4g}), over the"
            f" bound {bound} eps * scale = {bound * EPS * report['scale']:.4g}"
        )


def assert_close(got, want, bound: float, scale: float | None = None, what: str = "") -> None:
    """``check(compare(got, want, scale), bound, what)``."""
    check(compare(got, want, scale), bound, what)
