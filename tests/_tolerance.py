"""How far a float32 result may be from its reference when only the order of the sums differs.

A stack's scan and a Python loop, a pipeline's microbatches and one batch, 8 devices and one:
each pair does the same arithmetic, but may add the same terms in another order (a matmul's
blocking, a gradient summed per microbatch then across them, an all-reduce's tree, the CPU's
vector width and fused multiply-adds), and the order decides the last bits. How many bits is a
property of what is summed, not of the machine, so every comparison here is relative, leaf by
leaf::

    max|got - want| <= bound * eps * scale

with ``eps`` float32's machine epsilon (2**-23), ``scale`` the leaf's largest ``|want|`` (for a
leaf that is 0 in exact arithmetic, whose computed values are rounding noise, the whole tree's
largest: ``zero=``), and ``bound`` from ``reassociation_bound``: what is summed, chained.

The bound. A k-term float32 sum (or dot product) in any order is within (k - 1) u sum|terms|
of the exact sum (u = eps / 2; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
section 4.2), but that worst case needs every rounding to err the same way: with rounding errors
of independent sign, it is within lambda sqrt(k) u sum|terms| with probability at least
1 - 2k exp(-lambda**2 / 2) (Higham and Mary, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 41(5), 2019, theorems 2.4 and 3.1), and two orders are within
lambda sqrt(k) eps sum|terms| of each other. A model of ``depth`` layers, each summing ``width``
products (or running sums of several widths one after another, as a transformer block),
runs ``depth`` such sums one after another in the forward pass and as many in the backward
pass; to first order their errors add, each carried on with a gain about 1 (the tests' residual
layers), and in the worst case all in one direction: 2 * depth * lambda sqrt(width).
A gradient's sum over the rows of the batch (or microbatches, or devices), or a loss's over its
elements, adds lambda sqrt(summed). So::

    bound = lambda * (2 * depth * sqrt(width) + sqrt(summed)),    lambda = 6

(each sum strays past its share with probability below 2 * 128 * exp(-18) = 4e-6 for widths up
to 128, and the shares are added as if all erred one way). For 16 layers of width 8 whose
gradient sums 16 rows: 6 * (2 * 16 * sqrt(8) + sqrt(16)) = 568 eps, 6.8e-5 of the scale; the
measured errors are 1-50 eps (50: a 12-layer pattern whose gradients grow 10-20 times through
its layers). The scale is the leaf's largest ``|want|``, not the sum|terms| of each of its
entries' sums: stricter for a sum that cancels (a loss of ``sin`` s), and the measured errors
stay well within.

What the checks still catch: a relative error of 1e-3 in any leaf is 8,389 eps * scale, over
2.5 times every float32 bound in the suite (the largest, 3,326, for the multi-process
example's step: 8 transformer blocks of 9 chained sums each; most are 300-1,000); an error in
the code (a layer skipped, a microbatch counted twice, params of the wrong layer) is far
larger.
tests/test_tolerance.py shows it on a stack and its loop.

Narrow dtypes. Two programs computing in bfloat16 also differ in where they round: the source
rounds after each bfloat16 operation, but a backend may run an elementwise chain in float32 and
round once at the end of its fusion, and fuse a scan's body otherwise than a loop's (on a v5e, a
bfloat16 Stack and its loop differed by 1.2 bfloat16 eps of the scale, where XLA:CPU kept them
within 1; benchmarks/results/tpu_tier.md). A rounding one program makes and the other skips
moves a value by at most u |v| (u = eps_bfloat16 / 2 = 2**-8); to first order these add through
the chain with a gain about 1 (residual layers, values within the output's scale), all in one
direction in the worst case: ``rounding_bound`` counts them. (The probabilistic form, lambda
sqrt(k) u, is looser for the few tens of roundings of a small model, since lambda = 6.) Such a
bound is loose, 14 eps_bfloat16 for 28 roundings, 11% of the scale: it checks the dtypes and the
structure; a float32 run of the same model checks the arithmetic.

Where the code promises bitwise equality (checkpoint round trips, conversions), compare exactly
instead (tests/_trees.py: ``assert_trees_bitwise``).

The workers of tests/distributed run in a subprocess and send JSON back: they return the
report of ``compare`` (a dict), and the test checks it with ``check``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: float32's machine epsilon, 2**-23: the spacing of float32 numbers at 1.0.
EPS = float(np.finfo(np.float32).eps)
#: Higham and Mary's lambda: a k-term sum's rounding exceeds lambda sqrt(k) u sum|terms| with
#: probability below 2k exp(-lambda**2 / 2), 3e-8 k.
LAMBDA = 6


def reassociation_bound(*, depth: int, width: int | Sequence[int], summed: int = 1) -> int:
    """How many ``eps * scale`` two float32 evaluations of a model may differ by, when they
    differ only in the order of their sums (the module's docstring derives it).

    Args:
      depth: the layers chained from the input to the output (the backward pass runs the
        same chain back).
      width: the terms of a layer's sum (a matmul's contraction length), or of each of its
        sums that run one after another (a transformer block's projections, attention, MLP).
      summed: the terms of the outer sums on top of the chain (a gradient's sum over the
        batch's rows, a loss's over its elements).

    Returns:
      ``LAMBDA * (2 * depth * sqrt(width) + sqrt(summed))``, rounded up (with several widths,
      the sum of their square roots).
    """
    widths = [width] if isinstance(width, int) else list(width)
    chain = depth * sum(math.sqrt(w) for w in widths)
    return math.ceil(LAMBDA * (2 * chain + math.sqrt(summed)))


def rounding_bound(*, roundings: int, dtype=jnp.bfloat16) -> int:
    """How many float32 ``eps * scale`` two evaluations in ``dtype`` may differ by, when they
    differ in which of their ``roundings`` to ``dtype`` they make (the module's docstring).

    Args:
      roundings: the operations the source rounds to ``dtype`` along the chain from the input
        to the output (per layer, times the layers).
      dtype: the narrow dtype (bfloat16 by default).

    Returns:
      ``roundings * u / eps`` with ``u`` half ``dtype``'s epsilon, ``eps`` float32's:
      ``roundings * 2**15`` for bfloat16.
    """
    u = float(jnp.finfo(dtype).eps) / 2
    return math.ceil(roundings * u / EPS)


def compare(got, want, scale: float | None = None, zero: tuple[str, ...] = ()) -> dict:
    """The leaf where ``got`` is farthest from ``want``, relative to that leaf's scale.

    Args:
      got, want: pytrees of one structure (``got``'s leaves may hold ``want``'s in another
        shape of the same size, as a circular pipeline's ``(repeats, n / repeats, ...)``).
      scale: the magnitude of what was summed (``sum|terms|`` of a loss), for every leaf; by
        default each leaf's largest ``|want|``.
      zero: parts of the paths of leaves that are 0 in exact arithmetic (a bias before a
        normalisation, a key bias under softmax: what the programs compute there is rounding
        noise of terms as large as the others), whose scale is the whole tree's largest.

    Returns:
      A JSON-able report ``{"leaf", "err", "scale", "in_eps"}``: the leaf's path, its largest
      ``|got - want|``, its scale, and that error in units of ``eps * scale``.
    """
    got_leaves, tree = jax.tree_util.tree_flatten(got)
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    if tree != jax.tree_util.tree_structure(want):
        raise AssertionError(f"the trees differ: {tree} against {jax.tree.structure(want)}")
    largest = max(float(np.max(np.abs(np.asarray(b, np.float64)), initial=0.0))
                  for _, b in want_leaves)
    reports = []
    for a, (path, b) in zip(got_leaves, want_leaves):
        b = np.asarray(b, np.float64)
        a = np.asarray(a, np.float64).reshape(b.shape)
        err = float(np.max(np.abs(a - b))) if b.size else 0.0
        s = float(scale) if scale is not None else float(np.max(np.abs(b), initial=0.0))
        if any(z in jax.tree_util.keystr(path) for z in zero):
            s = largest
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


def assert_close(got, want, bound: float, scale: float | None = None, what: str = "",
                 zero: tuple[str, ...] = ()) -> None:
    """``check(compare(got, want, scale, zero), bound, what)``."""
    check(compare(got, want, scale, zero), bound, what)
