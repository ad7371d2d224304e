"""stackwise for optax: optimizers that see the layers of stacked params.

``stackwise.optax.layerwise(tx)`` makes any ``optax.GradientTransformation`` give stacked
params the loop model's updates: LAMB's trust ratio, Adafactor's factored moments, Muon's
orthogonalisation and adaptive clipping per layer, global norms over the whole tree, and
elementwise optimizers unchanged. Per-layer controls: ``freeze=``, ``lr_scale=``
(:func:`layer_decay`), :func:`layer_mask`, on stacks and on patterns (:func:`pattern`). See
``docs/optimizers.md``.

>>> import jax.numpy as jnp, optax, stackwise.optax
>>> params = {"w": jnp.ones((4, 8, 8))}                 # 4 stacked layers
>>> tx = stackwise.optax.layerwise(optax.adafactor(1e-2, min_dim_size_to_factor=8))
>>> state = tx.init(params)                             # per layer: rows and columns
>>> state[0].v_row["w"].shape, state[0].v_col["w"].shape
((4, 8), (4, 8))
"""

try:
    import optax  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without optax
    raise ImportError("`stackwise.optax` needs optax: pip install 'stackwise[optax]'") from None

from stackwise.optax._layerwise import layer_decay as layer_decay
from stackwise.optax._layerwise import layer_mask as layer_mask
from stackwise.optax._layerwise import layerwise as layerwise
from stackwise.optax._layerwise import muon_dimensions as muon_dimensions
from stackwise.optax._stacked import stacked_in as stacked_in
from stackwise.optax._which import pattern as pattern

__all__ = [
    "layer_decay",
    "layer_mask",
    "layerwise",
    "muon_dimensions",
    "pattern",
    "stacked_in",
]
