"""PEFT's LoraConfig fields without torch: folders written by hand as PEFT writes them (torch's
layout, the config's fields as PEFT's docs define them) load as a loop over layers applying
``W + scale * (B A)^T`` by hand says, and ``save_peft`` writes them back. The same fields against
real PEFT on a transformers Llama: ``test_peft_transformers.py`` (where torch is installed)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import trained

import stackwise

safetensors_numpy = pytest.importorskip("safetensors.numpy")

N, D, F = 3, 8, 12
MODULES = {"['q']": "self_attn.q_proj", "['down']": "mlp.down_proj"}
SHAPES = {"q": (D, F), "down": (F, D)}  # (in, out) per layer
PREFIX = "base_model.model.model.layers"
TOL = dict(rtol=1e-5, atol=1e-5)
_is_lora = lambda v: isinstance(v, stackwise.lora.LoraWeights)  # noqa: E731


def _base(n=N):
    rng = np.random.default_rng(0)  # (NumPy's: JAX compiles its sampler anew for each shape)
    return {"q": jnp.asarray(rng.standard_normal((n, D, F), np.float32) / D),
            "down": jnp.asarray(rng.standard_normal((n, F, D), np.float32) / F)}


def _apply(p, x):
    return x + jnp.tanh(x @ p["q"]) @ p["down"]


def _config(**fields):
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
            "target_modules": ["q_proj", "down_proj"], "lora_dropout": 0.0, "bias": "none",
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "init_lora_weights": True, **fields}


def _write(folder, config, ranks):
    """A PEFT folder: `ranks[(i, leaf)]` is layer i's module rank (absent: no adapter there),
    random torch-layout tensors lora_A (r, in), lora_B (out, r)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {}
    for (i, leaf), r in ranks.items():
        d_in, d_out = SHAPES[leaf]
        name = f"{PREFIX}.{i}.{MODULES[f'[{leaf!r}]']}"
        tensors[f"{name}.lora_A.weight"] = rng.normal(size=(r, d_in)).astype(np.float32) / d_in
        tensors[f"{name}.lora_B.weight"] = rng.normal(size=(d_out, r)).astype(np.float32) / r
    safetensors_numpy.save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def _loop(base, tensors, scales, x, n=N):
    """The model by hand: layer i adds scales[(i, leaf)] * (B A)^T for each module the file
    holds at layer i, PEFT's `W x + s B A x` written for x @ W."""
    for i in range(n):
        p = {}
        for leaf, w in base.items():
            p[leaf] = w[i]
            name = f"{PREFIX}.{i}.{MODULES[f'[{leaf!r}]']}"
            if f"{name}.lora_A.weight" in tensors:
                a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
                p[leaf] = p[leaf] + scales[(i, leaf)] * (a.T @ b.T)
        x = _apply(p, x)
    return x


@jax.jit  # (one program per structure of the adapters: an eager apply compiles its scan anew)
def _stacked(base, adapters, x):
    return stackwise.lora.stack(_apply, N).apply(stackwise.lora.attach(base, adapters), x)


X = jnp.asarray(np.random.default_rng(5).standard_normal((2, D), np.float32))


def _every(r):
    return {(i, leaf): r for i in range(N) for leaf in SHAPES}


# --------------------------------------------------------------------------
# use_rslora


def test_rslora_scales_by_alpha_over_sqrt_r():
    base = _base()
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=4, alpha=8.0,
                                           rslora=True))
    assert adapters["q"].rslora and adapters["q"].scale == 8.0 / math.sqrt(4) == 4.0
    y = X
    for i in range(N):  # the loop, the scale written out
        y = _apply({k: base[k][i] + 4.0 * adapters[k].a[i] @ adapters[k].b[i] for k in base}, y)
    np.testing.assert_allclose(_stacked(base, adapters, X), y, **TOL)
    merged = stackwise.lora.merge(base, adapters)
    np.testing.assert_allclose(merged["q"][1], base["q"][1] + 4.0 * adapters["q"].a[1]
                               @ adapters["q"].b[1], **TOL)

    def loss_stacked(ad):
        return jnp.sum(_stacked(base, ad, X) ** 2)

    def loss_loop(ad):
        y = X
        for i in range(N):
            y = _apply({k: base[k][i] + 4.0 * ad[k].a[i] @ ad[k].b[i] for k in base}, y)
        return jnp.sum(y**2)

    jax.tree.map(lambda g, h: np.testing.assert_allclose(g, h, **TOL),
                 jax.jit(jax.grad(loss_stacked))(adapters), jax.jit(jax.grad(loss_loop))(adapters))


def test_an_rslora_file_loads_as_its_meaning_and_saves_back(tmp_path):
    base = _base()
    tensors = _write(tmp_path / "a", _config(use_rslora=True, lora_alpha=16), _every(4))
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert adapters["q"].rslora and adapters["q"].scale == 8.0
    want = _loop(base, tensors, {k: 16 / math.sqrt(4) for k in _every(4)}, X)
    np.testing.assert_allclose(_stacked(base, adapters, X), want, **TOL)
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert (config["use_rslora"], config["r"], config["lora_alpha"]) == (True, 4, 16.0)
    back = safetensors_numpy.load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert back.keys() == tensors.keys()
    assert all((back[k] == tensors[k]).all() for k in back)


# --------------------------------------------------------------------------
# rank_pattern, alpha_pattern


def test_rank_and_alpha_patterns_load_per_module(tmp_path):
    """PEFT's keys match a module's name from its end, at a dot (`q_proj` matches every
    layer's `self_attn.q_proj`), the first key that matches deciding."""
    base = _base()
    config = _config(rank_pattern={"down_proj": 2}, alpha_pattern={r"self_attn\.q_proj": 16,
                                                                   "q_proj": 1})
    ranks = {(i, leaf): 2 if leaf == "down" else 4 for i in range(N) for leaf in SHAPES}
    tensors = _write(tmp_path / "a", config, ranks)
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert (adapters["q"].rank, adapters["q"].alpha) == (4, 16.0)
    assert (adapters["down"].rank, adapters["down"].alpha) == (2, 8.0)
    scales = {(i, leaf): 16 / 4 if leaf == "q" else 8 / 2 for i in range(N) for leaf in SHAPES}
    np.testing.assert_allclose(_stacked(base, adapters, X), _loop(base, tensors, scales, X),
                               **TOL)


def test_a_rank_and_alpha_per_leaf_save_as_patterns(tmp_path):
    base = _base()
    q = stackwise.lora.init(jax.random.key(1), base, rank=2, alpha=3.0, targets=["['q']"])
    down = stackwise.lora.init(jax.random.key(2), base, rank=4, alpha=8.0, targets=["['down']"])
    adapters = trained({"q": q["q"], "down": down["down"]})
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (2, 3.0)  # a tie: the smaller
    assert config["rank_pattern"] == {r"mlp\.down_proj": 4}
    assert config["alpha_pattern"] == {r"mlp\.down_proj": 8.0}
    tensors = safetensors_numpy.load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    # The file's meaning, by hand: the module's rank from its tensors, its alpha as PEFT's
    # keys give it (each key names one module whole here).
    scales = {}
    for i in range(N):
        for leaf, module in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
            key = module.replace(".", r"\.")
            alpha = config["alpha_pattern"].get(key, config["lora_alpha"])
            r = config["rank_pattern"].get(key, config["r"])
            assert r == tensors[f"{PREFIX}.{i}.{module}.lora_A.weight"].shape[0]
            scales[(i, leaf)] = alpha / r
    np.testing.assert_allclose(_loop(base, tensors, scales, X), _stacked(base, adapters, X),
                               **TOL)
    back = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert jax.tree.structure(back) == jax.tree.structure(adapters)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_a_pattern_s_positions_of_one_module_and_two_ranks_save_per_layer(tmp_path):
    """Two pattern positions adapt `self_attn.q_proj` with ranks 2 and 4: the file's
    rank_pattern names each layer of the rank other than `r` whole
    (`model.layers.0.self_attn.q_proj`), and reads back bitwise."""
    loop = [{"q": jax.random.normal(jax.random.key(i), (D, D)) / D} for i in range(4)]
    base = stackwise.stack_layers(loop, pattern=2)
    one = stackwise.lora.init(jax.random.key(1), base[0], rank=4)
    two = stackwise.lora.init(jax.random.key(2), base[1], rank=2, alpha=8.0)
    adapters = trained((one, two))
    modules = {"[0]['q']": "self_attn.q_proj", "[1]['q']": "self_attn.q_proj"}
    stackwise.lora.save_peft(tmp_path / "a", adapters, modules, pattern=2)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["rank_pattern"] == {
        r"model\.layers\.0\.self_attn\.q_proj": 4, r"model\.layers\.2\.self_attn\.q_proj": 4}
    assert config["lora_alpha"] == 4.0 and config["alpha_pattern"] == {
        r"model\.layers\.1\.self_attn\.q_proj": 8.0, r"model\.layers\.3\.self_attn\.q_proj": 8.0}
    back = stackwise.lora.load_peft(tmp_path / "a", base, modules, pattern=2)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


# --------------------------------------------------------------------------
# layers_to_transform, layers_pattern, exclude_modules


@pytest.mark.parametrize("fields, adapted", [
    (dict(layers_to_transform=[0, 2]), {0, 2}),
    (dict(layers_to_transform=1), {1}),
    (dict(layers_to_transform=[1, 2], layers_pattern="layers"), {1, 2}),
    (dict(layers_to_transform=[]), {0, 1, 2}),   # PEFT: an empty list is every layer
], ids=["a list", "an int", "with layers_pattern", "empty"])
def test_layers_without_adapters_load_as_zeros(tmp_path, fields, adapted):
    base = _base()
    tensors = _write(tmp_path / "a", _config(**fields),
                     {(i, leaf): 4 for i in adapted for leaf in SHAPES})
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    for i in set(range(N)) - adapted:
        assert not adapters["q"].a[i].any() and not adapters["down"].b[i].any()
    np.testing.assert_allclose(_stacked(base, adapters, X),
                               _loop(base, tensors, {k: 2.0 for k in _every(4)}, X), **TOL)
    # Zeros take no gradient: the layers stay without an update as they train, as in PEFT.
    grads = jax.grad(lambda ad: jnp.sum(_stacked(base, ad, X) ** 2))(adapters)
    for i in set(range(N)) - adapted:
        assert not grads["q"].a[i].any() and not grads["q"].b[i].any()
    # Saved back: the same layers, the same tensors.
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == (sorted(adapted) if len(adapted) < N else None)
    back = safetensors_numpy.load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert back.keys() == tensors.keys() and all((back[k] == tensors[k]).all() for k in back)


def test_excluded_modules_load_as_zeros(tmp_path):
    base = _base()
    config = _config(exclude_modules=["model.layers.1.self_attn.q_proj"])
    ranks = {k: 4 for k in _every(4) if k != (1, "q")}
    tensors = _write(tmp_path / "a", config, ranks)
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert not adapters["q"].a[1].any() and adapters["down"].a[1].any()
    np.testing.assert_allclose(_stacked(base, adapters, X),
                               _loop(base, tensors, {k: 2.0 for k in _every(4)}, X), **TOL)


def test_a_layers_template_peft_reads_no_index_from_writes_the_zeros(tmp_path):
    """`layers="base_model.model.layers.{i}"` names a module `layers.1.mlp.down_proj`, whose
    layer PEFT cannot read (it wants a name before `layers`): the zero layer is written, as
    exact, and no layers_to_transform."""
    base = _base()
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=2))
    adapters = jax.tree.map(lambda v: v.at[1].set(0.0), adapters)
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES,
                             layers="base_model.model.layers.{i}")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] is None
    tensors = safetensors_numpy.load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert not tensors["base_model.model.layers.1.mlp.down_proj.lora_A.weight"].any()
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)   # the default names: left out
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [0, 2]


# --------------------------------------------------------------------------
# lora_dropout, bias, init_lora_weights


def test_lora_dropout_loads_as_the_adapters_rate_and_saves_back(tmp_path):
    """PEFT's lora_dropout is each loaded adapter's ``dropout``, applied while training with a
    key (tests/finetune/test_dropout.py); without one (evaluation) it changes no output. It is
    saved back from the adapters, or as ``save_peft(..., lora_dropout=)`` gives it."""
    base = _base()
    tensors = _write(tmp_path / "a", _config(lora_dropout=0.1), _every(4))
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    assert {lw.dropout for lw in jax.tree.leaves(adapters, is_leaf=_is_lora)
            if _is_lora(lw)} == {0.1}
    np.testing.assert_allclose(_stacked(base, adapters, X),
                               _loop(base, tensors, {k: 2.0 for k in _every(4)}, X), **TOL)
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.1
    stackwise.lora.save_peft(tmp_path / "c", adapters, MODULES, lora_dropout=0.05)
    back = stackwise.lora.load_peft(tmp_path / "c", base, MODULES)
    assert json.loads((tmp_path / "c" / "adapter_config.json").read_text())[
        "lora_dropout"] == 0.05
    assert {lw.dropout for lw in jax.tree.leaves(back, is_leaf=_is_lora) if _is_lora(lw)} == {
        0.05}


@pytest.mark.parametrize("fields", [dict(bias="all"), dict(bias="lora_only"),
                                    dict(init_lora_weights="gaussian"),
                                    dict(init_lora_weights=False),
                                    dict(init_lora_weights="eva"),
                                    dict(fan_in_fan_out=True),
                                    dict(task_type=None, peft_version="0.21.2", revision="main",
                                         inference_mode=False, ensure_weight_tying=True,
                                         loftq_config={}, megatron_core="megatron.core",
                                         qalora_group_size=16, new_field_unset=None)],
                         ids=["bias all", "bias lora_only", "init gaussian", "init False",
                              "init eva", "fan_in_fan_out (GPT-2's Conv1D)",
                              "fields without effect"])
def test_settings_that_change_no_output_here_load(tmp_path, fields):
    """bias 'all' or 'lora_only' trains biases a Llama does not have: its files hold none,
    and load (a file that holds one is refused, tests/misuse). fan_in_fan_out says the base
    stores its weight (in, out); lora_A and lora_B are (r, in) and (out, r) either way."""
    base = _base()
    tensors = _write(tmp_path / "a", _config(**fields), _every(4))
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    np.testing.assert_allclose(_stacked(base, adapters, X),
                               _loop(base, tensors, {k: 2.0 for k in _every(4)}, X), **TOL)


def test_a_module_name_that_ends_another_s_gets_per_layer_keys(tmp_path):
    """PEFT's key `q_proj` would match `attn.q_proj` too: its rank is written per layer, by the
    module's whole name, and each module reads back its own (a wrong rank would not fit the
    tensors' shapes)."""
    base = {"q": _base()["q"], "attn_q": _base()["q"], "down": _base()["down"]}
    ranks = {"q": 4, "attn_q": 2, "down": 2}
    adapters = trained({k: stackwise.lora.init(jax.random.key(j), base, rank=ranks[k],
                                               targets=[f"['{k}']"])[k]
                        for j, k in enumerate(base)})
    modules = {"['q']": "q_proj", "['attn_q']": "attn.q_proj", "['down']": "mlp.down_proj"}
    stackwise.lora.save_peft(tmp_path / "a", adapters, modules)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 2
    assert config["rank_pattern"] == {rf"model\.layers\.{i}\.q_proj": 4 for i in range(N)}
    back = stackwise.lora.load_peft(tmp_path / "a", base, modules)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


# --------------------------------------------------------------------------
# modules_to_save


def test_modules_to_save_round_trip_by_their_names_in_the_model(tmp_path):
    """Full copies of whole modules travel beside the adapters under PEFT's prefix and their
    names in the model; the config names their modules; they read back bitwise, and a file's
    copies are never dropped without a word."""
    base = _base()
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=2))
    saved = {"lm_head.weight": jax.random.normal(jax.random.key(2), (16, D)),
             "model.layers.1.input_layernorm.weight": jnp.ones((D,)) * 1.5,
             "score.bias": jnp.arange(4.0)}
    stackwise.lora.save_peft(tmp_path / "a", adapters, MODULES, modules_to_save=saved)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head", "model.layers.1.input_layernorm", "score"]
    tensors = safetensors_numpy.load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    for name, v in saved.items():
        np.testing.assert_array_equal(tensors[f"base_model.model.{name}"], v)
    back, back_saved = stackwise.lora.load_peft(tmp_path / "a", base, MODULES,
                                                modules_to_save=True)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
    assert back_saved.keys() == saved.keys()
    for name, v in saved.items():
        np.testing.assert_array_equal(back_saved[name], v)
    # bias='all' with a saved module's bias: a whole module's copy, not a trained LoRA bias.
    # (And a peft_version that names no release: the modules' own names name them in every
    # PEFT, so it does not matter which wrote the file.)
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**config, "bias": "all", "peft_version": "main"}))
    stackwise.lora.load_peft(tmp_path / "a", base, MODULES, modules_to_save=True)
    # Without modules_to_save=True the copies would be lost: refused.
    with pytest.raises(ValueError, match="holds full trained copies"):
        stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    # A file that names modules_to_save but holds no copy (PEFT then keeps the base's
    # module as it is): the adapters load, and nothing is saved.
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
    path = tmp_path / "b" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "modules_to_save": ["lm_head"]}))
    assert stackwise.lora.load_peft(tmp_path / "b", base, MODULES, modules_to_save=True)[1] == {}


@pytest.mark.parametrize("version, both", [(None, True), ("0.21.2", True),
                                            ("0.21.3.dev0@1a2b3c", True), ("0.22.0", False),
                                            ("0.22.1.dev0@UNKNOWN", False)])
def test_modules_to_save_cover_the_modules_the_writing_peft_wrapped(tmp_path, version, both):
    """`modules_to_save=["norm"]` names `model.norm` in every PEFT, and `model.layers.1.xnorm`
    (ending in "norm", not at a dot) before peft 0.22.0, whose file then holds its copy too:
    read as the version in the config says (none: older than 0.18.0, which wrote none). From
    0.22.0 PEFT neither wraps nor saves it, and a tensor of it fits no layer: refused."""
    base = _base()
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=2))
    saved = {"model.norm.weight": jnp.arange(float(D)),
             "model.layers.1.xnorm.weight": jnp.ones((D,)) * 1.5}
    folder = tmp_path / "a"
    stackwise.lora.save_peft(folder, adapters, MODULES, modules_to_save=saved)
    path = folder / "adapter_config.json"
    config = {**json.loads(path.read_text()), "modules_to_save": ["norm"]}
    path.write_text(json.dumps({**config, "peft_version": version} if version else config))
    if not both:
        with pytest.raises(ValueError, match=r"1 tensors .* fit no layer .*xnorm\.weight"):
            stackwise.lora.load_peft(folder, base, MODULES, modules_to_save=True)
        return
    back, back_saved = stackwise.lora.load_peft(folder, base, MODULES, modules_to_save=True)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
    assert back_saved.keys() == saved.keys()
    for name, v in saved.items():
        np.testing.assert_array_equal(back_saved[name], v)


# --------------------------------------------------------------------------
# use_dora


def _dora_loop_weights(base, adapters, i, stop=jax.lax.stop_gradient):
    """Layer i's DoRA weights by hand: V = W + s a b, then V * m / |V|, |V| each output
    column's norm (constant for gradients)."""
    out = {}
    for k, w in base.items():
        lw = adapters[k]
        v = w[i] + lw.scale * lw.a[i] @ lw.b[i]
        norm = stop(jnp.sqrt(jnp.sum(v * v, axis=0)))
        out[k] = v * (lw.magnitude[i] / norm)[None, :]
    return out


def _as_trained_dora(adapters):
    keys = iter(jax.random.split(jax.random.key(9), 8))
    return {k: stackwise.lora.LoraWeights(
        lw.a, lw.b + 0.3 * jax.random.normal(next(keys), lw.b.shape), lw.alpha, lw.rslora,
        lw.magnitude * (1 + 0.3 * jax.random.normal(next(keys), lw.magnitude.shape)))
        for k, lw in adapters.items()}


def test_dora_is_its_loop():
    base = _base()
    fresh = stackwise.lora.init(jax.random.key(1), base, rank=4, alpha=8.0, dora=True)
    np.testing.assert_allclose(fresh["q"].magnitude, jnp.linalg.norm(base["q"], axis=1),
                               **TOL)
    plain = stackwise.lora.stack(_apply, N).apply(base, X)
    np.testing.assert_allclose(_stacked(base, fresh, X), plain, **TOL)
    adapters = _as_trained_dora(fresh)

    def loop(ad):
        y = X
        for i in range(N):
            y = _apply(_dora_loop_weights(base, ad, i), y)
        return y

    np.testing.assert_allclose(_stacked(base, adapters, X), jax.jit(loop)(adapters), **TOL)
    jax.tree.map(lambda g, h: np.testing.assert_allclose(g, h, **TOL),
                 jax.jit(jax.grad(lambda ad: jnp.sum(_stacked(base, ad, X) ** 2)))(adapters),
                 jax.jit(jax.grad(lambda ad: jnp.sum(loop(ad) ** 2)))(adapters))
    merged = stackwise.lora.merge(base, adapters)
    np.testing.assert_allclose(merged["down"][2], _dora_loop_weights(base, adapters, 2)["down"],
                               **TOL)
    # A batch of two DoRA adapters: each group its adapter alone.
    other = _as_trained_dora(fresh)
    batch = stackwise.lora.stack_adapters([adapters, other])
    both = _stacked(base, batch, jnp.stack([X, X]))
    np.testing.assert_allclose(both[1], _stacked(base, other, X), **TOL)


def test_dora_on_a_quantized_base_starts_at_its_dequantized_norms():
    base = _base()
    qbase = stackwise.quant.quantize(base, "int8")
    adapters = stackwise.lora.init(jax.random.key(1), qbase, rank=2, dora=True)
    deq = stackwise.quant.dequantize(qbase)
    np.testing.assert_allclose(adapters["q"].magnitude, jnp.linalg.norm(deq["q"], axis=1),
                               **TOL)
    plain = stackwise.lora.stack(_apply, N).apply(deq, X)
    np.testing.assert_allclose(_stacked(qbase, adapters, X), plain, **TOL)


def test_a_dora_file_loads_as_its_meaning_and_saves_back(tmp_path):
    base = _base()
    tensors = _write(tmp_path / "a", _config(use_dora=True), _every(4))
    rng = np.random.default_rng(3)
    for i in range(N):   # PEFT's magnitude per output channel, as if trained
        for leaf, module in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
            out = SHAPES[leaf][1]
            tensors[f"{PREFIX}.{i}.{module}.lora_magnitude_vector"] = (
                rng.uniform(0.5, 1.5, out).astype(np.float32))
    safetensors_numpy.save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    adapters = stackwise.lora.load_peft(tmp_path / "a", base, MODULES)
    y = X
    for i in range(N):  # PEFT's DoRA by hand, in torch's layout: (m / |W + s B A|_row) (W + s B A)
        p = {}
        for leaf, module in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
            name = f"{PREFIX}.{i}.{module}"
            w = np.asarray(base[leaf][i]).T + 2.0 * (
                tensors[f"{name}.lora_B.weight"] @ tensors[f"{name}.lora_A.weight"])
            m = tensors[f"{name}.lora_magnitude_vector"]
            p[leaf] = jnp.asarray((w * (m / np.linalg.norm(w, axis=1))[:, None]).T)
        y = _apply(p, y)
    np.testing.assert_allclose(_stacked(base, adapters, X), y, **TOL)
    stackwise.lora.save_peft(tmp_path / "b", adapters, MODULES)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    back = safetensors_numpy.load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert back.keys() == tensors.keys() and all((back[k] == tensors[k]).all() for k in back)
