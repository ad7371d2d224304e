"""What the tests against Hugging Face PEFT share (test_peft_transformers.py on the Llama
family, test_peft_gpt2.py on GPT-2): the logits of a torch model, the torch module PEFT built
for a dotted name, the checks that loaded adapters hold PEFT's weights and settings, PEFT's
adapters and stackwise's set off their starting values as if trained. torch is imported
where it is used: the test files skip, by ``pytest.importorskip``, before they call these."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import stackwise


def torch_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """The logits of a transformers (or PEFT) model for integer ``tokens``, as NumPy."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def assert_the_adapters_matter(peft_model: Any, tokens: np.ndarray, theirs: np.ndarray,
                               atol: float) -> None:
    """Without its adapters the model's logits are far from ``theirs``: a comparison of
    logits with PEFT's can fail."""
    with peft_model.disable_adapter():
        plain = torch_logits(peft_model, tokens)
    assert np.abs(plain - theirs).max() > 100 * atol


def torch_module(layer: Any, module: str) -> Any:
    """The submodule of a torch ``layer`` at the dotted name ``module``."""
    for part in module.split("."):
        layer = getattr(layer, part)
    return layer


def _tensor(parameter: Any) -> np.ndarray:
    """A PEFT adapter's weight in stackwise's layout: ``(in, out)``."""
    return parameter.weight.detach().numpy().T


def assert_loaded_bitwise(adapters: dict, modules: dict[str, str], layers: Sequence) -> None:
    """Each loaded adapter's A and B are, layer by layer, PEFT's (``layers``: the torch
    model's layers, ``modules``: leaf path -> dotted module name in a layer), bitwise."""
    for path, module in modules.items():
        leaf = adapters[path[2:-2]]
        for i, layer in enumerate(layers):
            built = torch_module(layer, module)
            np.testing.assert_array_equal(np.asarray(leaf.a[i]), _tensor(built.lora_A["default"]))
            np.testing.assert_array_equal(np.asarray(leaf.b[i]), _tensor(built.lora_B["default"]))


def assert_each_module_as_peft_built(adapters: dict, modules: dict[str, str],
                                     layers: Sequence) -> None:
    """Each loaded adapter has, layer by layer, the rank, scale, dropout rate, DoRA magnitude
    and A that PEFT built for its module; a layer where PEFT put no adapter loads as zeros."""
    for path, module in modules.items():
        leaf = adapters[path[2:-2]]
        for i, layer in enumerate(layers):
            built = torch_module(layer, module)
            if "default" not in getattr(built, "lora_A", {}):  # PEFT left it out
                assert not np.asarray(leaf.a[i]).any() and not np.asarray(leaf.b[i]).any()
                continue
            assert leaf.rank == built.r["default"]
            assert leaf.scale == built.scaling["default"]
            assert leaf.dropout == getattr(built.lora_dropout["default"], "p", 0.0)
            if leaf.dora:
                np.testing.assert_array_equal(
                    np.asarray(leaf.magnitude[i]),
                    built.lora_magnitude_vector["default"].weight.detach().numpy())
            np.testing.assert_array_equal(np.asarray(leaf.a[i]), _tensor(built.lora_A["default"]))


def peft_as_if_trained(peft_model: Any, gaussian: bool = False) -> None:
    """PEFT's adapters off their starting values, in place: a DoRA magnitude off the norms
    (where it starts, m / n = 1), and with ``gaussian`` (``init_lora_weights="gaussian"``) B
    off its zeros."""
    import torch

    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name and gaussian:
                p.copy_(0.1 * torch.randn_like(p))
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))


def ours(layers: Any, targets: Iterable[str], ranks: dict | None = None,
         alphas: dict | None = None, rslora: bool = False, dora: bool = False,
         zero_layers: Sequence[int] = (), dropout: float = 0.0) -> dict:
    """stackwise's adapters on the stacked ``layers`` at each target path (``"['q']"``), as
    if trained, with a rank and alpha per leaf (a DoRA magnitude off the base's norms too);
    the layers in ``zero_layers`` all zero (what a layer without an adapter loads as)."""
    ranks, alphas = ranks or {}, alphas or {}
    n = jax.tree.leaves(layers)[0].shape[0]
    keys = iter(jax.random.split(jax.random.key(1), 16))
    keep = jnp.asarray([i not in zero_layers for i in range(n)])[:, None, None]
    adapters = {}
    for j, path in enumerate(targets):
        leaf = path[2:-2]
        lw = stackwise.lora.init(
            jax.random.key(j), layers, rank=ranks.get(leaf, 4), alpha=alphas.get(leaf, 8.0),
            rslora=rslora, dora=dora, targets=[path])[leaf]
        a, b = (jnp.where(keep, v + 0.2 * jax.random.normal(next(keys), v.shape), 0.0)
                for v in (lw.a, lw.b))
        magnitude = None if not dora else lw.magnitude * (
            1 + 0.2 * jax.random.normal(next(keys), lw.magnitude.shape))
        adapters[leaf] = stackwise.lora.LoraWeights(a, b, lw.alpha, lw.rslora, magnitude,
                                                    dropout)
    return {**jax.tree.map(lambda _: None, layers), **adapters}
