"""qwix's static-range quantization (SRQ) of stacked activations, one layer at a time.

A qwix QAT rule with ``act_static_scale=True`` collects, per quantized activation, a moving
average of its calibration (``quant_stats``: a ``count`` and sums such as
``sum_of_absmax``); ``qwix.quantize_params(..., quant_stats)`` turns each into the PTQ
model's static scale ``<name>_scale`` (and ``<name>_zero_point`` for asymmetric types).
Inside a Stack these statistics are created by the scanned block, so they are stacked: one
per layer, ``count`` of shape ``(n,)``. qwix's own function reads ``count == 0`` as one
truth value and cannot take them; :func:`map_stats` gives it each layer's slice, so each
layer gets the scale its own block gets in a loop.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from stackwise._kit.layered import map_layers

__all__ = ["map_stats"]

#: What qwix derives from an activation's statistics: the PTQ param's suffix for each.
_DERIVED = {"scale": "_scale", "zero_point": "_zero_point"}


def _calibrate(quantize_params: Callable) -> Callable:
    """One layer's static scale (and zero point) from its statistics, by qwix itself."""

    def layer(stat: dict, expected: dict) -> dict:
        got = quantize_params({}, {"act_scale": expected["scale"]}, {"act": stat})
        return {k: got["act" + suffix] for k, suffix in _DERIVED.items() if "act" + suffix in got}

    return layer


def _groups(flat: dict) -> dict:
    """The flat statistics (path -> array) grouped per activation: path -> {count, sums}."""
    groups: dict = {}
    for path, value in flat.items():
        groups.setdefault(tuple(path[:-1]), {})[path[-1]] = value
    return groups


def _check_calibrated(stat: dict, name: str, who: str) -> int:
    """The number of layer axes of ``stat`` (its ``count``'s); refuses uncalibrated layers."""
    if "count" not in stat:
        raise ValueError(
            f"{who}: `quant_stats` entry `{name}` has {sorted(stat)}, not qwix's "
            "calibration statistics (`count` and sums such as `sum_of_absmax`). Give the "
            "`quant_stats` of the QAT model (linen: `variables['quant_stats']`; NNX: "
            "`nnx.to_pure_dict(nnx.state(model, qwix.QuantStat))`)."
        )
    count = np.asarray(stat["count"])
    empty = [tuple(int(i) for i in at) for at in np.argwhere(count == 0)]
    if empty:
        layers = ", ".join(str(at[0] if len(at) == 1 else at) for at in empty)
        where = f" in layer(s) {layers}" if count.ndim else ""
        raise ValueError(
            f"{who}: `quant_stats` entry `{name}` holds no calibration{where} (count 0). "
            "Run the QAT model on calibration data first, with the statistics updated "
            "(linen: `apply(..., mutable=['quant_stats'])`; NNX: call the model, outside "
            "`nnx.eval_shape`), then pass its `quant_stats`."
        )
    return count.ndim


def map_stats(
    flat: dict, expected_at: Callable, quantize_params: Callable, who: str, *, sep: str,
    where: str,
) -> dict:
    """Each activation's static scale (and zero point) from its stacked statistics.

    ``flat`` maps each statistic's path (``(..., act_name, 'count')``) to its array;
    ``expected_at(path)`` gives the quantized model's param at ``path`` (abstract or not),
    None if it has none; ``quantize_params`` is qwix's. The layer axes are those of each
    ``count`` (a scalar per layer). Returns the PTQ params, path -> value, per layer
    computed by qwix from that layer's statistics alone.

    Raises:
      ValueError: an entry is not qwix's statistics, or holds a layer never calibrated
        (count 0), or the quantized model has no static scale for it (its rule lacks
        ``act_static_scale=True``), or its depth is not the model's; naming the entry.
    """
    out = {}
    for path, stat in _groups(flat).items():
        name = sep.join(str(k) for k in path)
        axes = _check_calibrated(stat, name, who)
        paths = {k: (*path[:-1], f"{path[-1]}{suffix}") for k, suffix in _DERIVED.items()}
        expected = {k: expected_at(p) for k, p in paths.items()}
        expected = {k: v for k, v in expected.items() if v is not None}
        if "scale" not in expected:
            raise ValueError(
                f"{who}: `quant_stats` entry `{name}` has no static scale `{name}_scale` "
                f"in {where}. Give the PTQ model built with the QAT model's rules "
                "(`act_qtype` with `act_static_scale=True`), or leave out the statistics "
                "of activations it does not quantize statically."
            )
        got = map_layers(_calibrate(quantize_params), stat, expected, who, name, axes=axes)
        out |= {paths[k]: v for k, v in got.items()}
    return out
