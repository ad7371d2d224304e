"""What :func:`stackwise.stack` returns: a :class:`Stacked` ``(init, apply, n, decode)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Stacked"]


def _no_decode(*args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        "this Stacked has no `decode`: it was put together by hand or by a pipeline. "
        "`stackwise.stack(...)` makes one; for a pipeline's params, decode with "
        "`stackwise.stack(..., unroll=True).apply`."
    )


class Stacked(NamedTuple):
    """A pure pair of functions for n stacked layers, returned by :func:`stack`.

    Attributes:
      init: ``params = init(key, *args, **kwargs)``; every leaf gains a leading
        axis of length ``n``. With ``with_state=True``: ``(params, state)``.
        With a pattern of k layers: a tuple of k stacked trees (see
        :func:`stack`).
      apply: ``x = apply(params, x, *args, **kwargs)``, the layers run in
        order. With ``has_aux=True`` it returns ``(x, aux)``, aux stacked
        along a leading ``n`` axis; with ``with_state=True`` it is
        ``out, state = apply(params, state, x, *args, **kwargs)``.
      n: the number of layers.
      decode: the same call as ``apply``, compiled as a loop model's program:
        a Python loop over static layer indices of the same stacked params
        (``unroll=True``; ``nested`` off). A layer that writes its state with
        ``dynamic_update_slice`` (a KV cache) reads and writes its own row of
        the stacked state, in place when the state is donated. For inference
        steps, where a step's speed matters more than its compile time (which
        grows with ``n``): on a TPU v5e a decode step takes 1.01-1.09x the
        loop's in 16 of 19 cases measured, where the scanned ``apply`` takes
        1.4-6x; 1.13-1.20x in three where a step reads mostly weights (D
        1,536 with batch 2, D 2,048 with batch 1 in bfloat16: XLA:TPU
        prefetches the loop's per-layer weights, not slices of a stacked
        one; the serving layout, below, is the loop's program)
        (benchmarks/results/tpu_decode.md). A generate that runs its token
        loop inside one jitted program can convert there instead, before the
        loop (:func:`stackwise.to_serving` on the stacked params and cache):
        1.01-1.05x the loop at 128 tokens a call where ``decode`` took
        1.08-1.20x (docs/finetune.md, "Serving"). On the CPU it is slower than both
        (1.4x the loop at D=256, 4.4x at D=1024: XLA:CPU copies each layer's
        weights out of the stacked params); serve from
        :func:`stackwise.to_serving`'s per-layer buffers there
        (benchmarks/results/decode_serving.md).
        Its values and gradients are ``apply``'s.

    A decode step with a stacked KV cache, donated: ``decode`` gives ``apply``'s
    values from the loop's program.

    >>> import jax, jax.numpy as jnp, stackwise
    >>> def attend(p, cache, x, pos):  # writes this position's row of its cache
    ...     cache = jax.lax.dynamic_update_slice_in_dim(cache, x * p, pos, 0)
    ...     return x + cache.sum(0, keepdims=True), cache
    >>> layers = stackwise.stack(None, attend, 4, with_state=True)
    >>> params, x = jnp.linspace(0.5, 1.0, 12).reshape(4, 1, 3), jnp.ones((1, 3))
    >>> step = jax.jit(layers.decode, donate_argnums=1)
    >>> y, cache = step(params, jnp.zeros((4, 8, 3)), x, 0)
    >>> y_scanned, _ = layers.apply(params, jnp.zeros((4, 8, 3)), x, 0)
    >>> bool(jnp.allclose(y, y_scanned)), cache.shape
    (True, (4, 8, 3))
    """

    init: Callable[..., Any]
    apply: Callable[..., Any]
    n: int
    decode: Callable[..., Any] = _no_decode
