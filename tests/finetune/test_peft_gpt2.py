"""Adapters against Hugging Face PEFT on a transformers GPT-2, when torch, transformers and peft
are installed (the suite does not install them; each test skips without them).

GPT-2 is not a Llama: its checkpoint names its layers ``transformer.h.{i}``, its projections
are ``Conv1D`` modules storing their weights ``(in, out)`` (PEFT's ``fan_in_fan_out``), and its
attention's q, k and v are one fused ``attn.c_attn`` of ``(E, 3E)``. A tiny random GPT-2 is
saved with ``save_pretrained``, loaded with ``stackwise.load_checkpoint`` (no transposes), and
``stackwise.lora.peft_modules`` gives ``save_peft`` / ``load_peft`` their modules and layers
from the same names. Adapters stackwise trained load in ``peft.PeftModel.from_pretrained`` with
the stacked model's logits, and a folder PEFT made on the model (``fan_in_fan_out=True``, as
PEFT sets it for ``Conv1D``) loads with ``load_peft`` bitwise and gives PEFT's logits. Checked
with transformers 5.25.0, peft 0.21.2 and torch 2.14.1 (CPU)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _peft import (
    assert_each_module_as_peft_built,
    assert_loaded_bitwise,
    assert_the_adapters_matter,
    ours,
    peft_as_if_trained,
    torch_logits,
)

import stackwise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

# PEFT warns that it sets fan_in_fan_out for Conv1D; transformers of its deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::UserWarning")

N, E, V, HEADS, T = 3, 16, 64, 4, 32  # layers, width, vocab, heads, positions
DH = E // HEADS
#: Each layer leaf and its tensor in GPT-2's checkpoint (Conv1D weights are (in, out): no
#: transpose).
LAYER = {"ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias", "qkv": "attn.c_attn.weight",
         "qkv_b": "attn.c_attn.bias", "proj": "attn.c_proj.weight",
         "proj_b": "attn.c_proj.bias", "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias",
         "fc": "mlp.c_fc.weight", "fc_b": "mlp.c_fc.bias", "out": "mlp.c_proj.weight",
         "out_b": "mlp.c_proj.bias"}
NAMES = {"layers": {leaf: f"transformer.h.{{}}.{t}" for leaf, t in LAYER.items()},
         "wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight",
         "lnf_w": "transformer.ln_f.weight", "lnf_b": "transformer.ln_f.bias"}
#: Every Conv1D of a layer adapted: the fused qkv, and two modules whose last names are alike
#: (attn.c_proj, mlp.c_proj).
TARGETS = ["['qkv']", "['proj']", "['fc']", "['out']"]
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 attention and MLP of 3 layers, torch against XLA
TOKENS = (np.arange(14).reshape(2, 7) * 5 % V).astype(np.int64)


def _model():
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=E, n_layer=N,
                                     n_head=HEADS, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # norms and biases off their ones and zeros, so that a slip shows
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _load(model, folder):
    model.save_pretrained(folder)
    state = model.state_dict()
    target = {"layers": {leaf: jax.ShapeDtypeStruct(
        (N, *state[f"transformer.h.0.{t}"].shape), jnp.float32) for leaf, t in LAYER.items()}}
    for leaf in ("wte", "wpe", "lnf_w", "lnf_b"):
        target[leaf] = jax.ShapeDtypeStruct(tuple(state[NAMES[leaf]].shape), jnp.float32)
    return stackwise.load_checkpoint(folder, target, NAMES)


def _ln(x, w, b, eps):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w[None, :] + b[None, :]


def _block(eps):
    def apply(p, x):  # one GPT-2 layer on x (T, E), causal
        t = x.shape[0]
        qkv = _ln(x, p["ln1_w"], p["ln1_b"], eps) @ p["qkv"] + p["qkv_b"][None, :]
        q, k, v = (a.reshape(t, HEADS, DH) for a in jnp.split(qkv, 3, -1))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(DH)
        scores = jnp.where(jnp.tril(jnp.ones((1, t, t), bool)), scores, -jnp.inf)
        attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v).reshape(t, E)
        x = x + attn @ p["proj"] + p["proj_b"][None, :]
        h = _ln(x, p["ln2_w"], p["ln2_b"], eps) @ p["fc"] + p["fc_b"][None, :]
        return x + jax.nn.gelu(h, approximate=True) @ p["out"] + p["out_b"][None, :]

    return apply


def _logits(model, params, adapters, tokens):
    eps = model.config.layer_norm_epsilon
    layers = stackwise.lora.stack(_block(eps), N)
    out = []
    for row in tokens:
        x = params["wte"][jnp.asarray(row)] + params["wpe"][: len(row)]
        x = layers.apply(stackwise.lora.attach(params["layers"], adapters), x)
        out.append(_ln(x, params["lnf_w"], params["lnf_b"], eps) @ params["wte"].T)
    return np.stack(out)


def test_the_stacked_gpt2_is_the_transformers_model(tmp_path):
    """The reference the PEFT tests stand on: without adapters, the same logits."""
    model = _model()
    params = _load(model, tmp_path / "hf")
    none = jax.tree.map(lambda _: None, params["layers"])
    np.testing.assert_allclose(_logits(model, params, none, TOKENS),
                               torch_logits(model, TOKENS), **TOL)


def test_the_names_give_peft_s_modules_of_gpt2():
    adapters = stackwise.lora.init(
        jax.random.key(0), jax.eval_shape(lambda: {
            leaf: jnp.zeros((N, E, 3 * E) if leaf == "qkv" else (N, E, E))
            for leaf in ("qkv", "proj", "fc", "out")}), rank=2, targets=TARGETS)
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], adapters)
    assert modules == {"['qkv']": "attn.c_attn", "['proj']": "attn.c_proj",
                       "['fc']": "mlp.c_fc", "['out']": "mlp.c_proj"}
    assert layers == "base_model.model.transformer.h.{i}"


def test_stackwise_s_adapters_give_peft_the_stacked_model_s_logits(tmp_path):
    model = _model()
    params = _load(model, tmp_path / "hf")
    adapters = stackwise.lora.init(jax.random.key(0), params["layers"], rank=4, alpha=8.0,
                                   targets=TARGETS)
    keys = iter(jax.random.split(jax.random.key(1), 16))
    adapters = jax.tree.map(lambda v: v + 0.2 * jax.random.normal(next(keys), v.shape),
                            adapters)  # as if trained: b off its zeros
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], adapters)
    stackwise.lora.save_peft(tmp_path / "adapter", adapters, modules, layers=layers)
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS), theirs, **TOL)
    assert_the_adapters_matter(peft_model, TOKENS, theirs, TOL["atol"])
    # PEFT put an adapter on each of the four Conv1D of every layer, of stackwise's tensors.
    for i in range(N):
        c_attn = peft_model.base_model.model.transformer.h[i].attn.c_attn
        np.testing.assert_array_equal(c_attn.lora_B["default"].weight.detach().numpy().T,
                                      np.asarray(adapters["qkv"].b[i]))
        assert "default" in peft_model.base_model.model.transformer.h[i].mlp.c_proj.lora_A


def test_a_folder_peft_made_on_gpt2_loads_bitwise_with_peft_s_logits(tmp_path):
    model = _model()
    params = _load(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                             fan_in_fan_out=True, init_lora_weights=False, lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config).eval()
    peft_model.save_pretrained(str(tmp_path / "peft"))
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert written["fan_in_fan_out"] is True  # what PEFT writes for GPT-2's Conv1D
    base = params["layers"]
    like = stackwise.lora.init(jax.random.key(0), base, rank=4, targets=TARGETS)
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], like)
    adapters = stackwise.lora.load_peft(tmp_path / "peft", base, modules, layers=layers)
    assert all(adapters[path[2:-2]].scale == 4.0 for path in modules)
    assert_loaded_bitwise(adapters, modules, peft_model.base_model.model.transformer.h)
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS), theirs, **TOL)
    assert_the_adapters_matter(peft_model, TOKENS, theirs, TOL["atol"])


# --------------------------------------------------------------------------
# PEFT's LoraConfig fields on GPT-2's names, both ways (the Llama's are in
# test_peft_transformers.py): GPT-2's layers are `transformer.h.{i}`, not `model.layers.{i}`,
# and two of its modules share the last name `c_proj`.

#: LoraConfig settings PEFT makes adapters on GPT-2 with.
PEFT_CONFIGS = {
    "use_dora": dict(use_dora=True),
    "rank_pattern, alpha_pattern on one c_proj": dict(rank_pattern={"attn.c_proj": 2},
                                                      alpha_pattern={"mlp.c_proj": 4}),
    "use_rslora": dict(use_rslora=True),
    "layers_to_transform": dict(layers_to_transform=[0, 2]),
    "layers_to_transform, layers_pattern h": dict(layers_to_transform=[1], layers_pattern="h"),
    "exclude_modules": dict(exclude_modules=["transformer.h.1.attn.c_attn"]),
}


@pytest.mark.parametrize("extra", list(PEFT_CONFIGS.values()), ids=list(PEFT_CONFIGS))
def test_a_peft_config_on_gpt2_loads_with_peft_s_logits(tmp_path, extra):
    model = _model()
    params = _load(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                             init_lora_weights=False, **extra)
    peft_model = peft.get_peft_model(model, config).eval()
    peft_as_if_trained(peft_model)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    like = stackwise.lora.init(jax.random.key(0), params["layers"], rank=4, targets=TARGETS)
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], like)
    adapters = stackwise.lora.load_peft(tmp_path / "peft", params["layers"], modules,
                                        layers=layers)
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS), theirs, **TOL)
    assert_the_adapters_matter(peft_model, TOKENS, theirs, TOL["atol"])
    assert_each_module_as_peft_built(adapters, modules,
                                     peft_model.base_model.model.transformer.h)


#: Adapters stackwise makes on GPT-2, and the config fields save_peft writes for them.
OURS = {
    "DoRA": (dict(dora=True), dict(use_dora=True)),
    "a rank per module, one c_proj": (dict(ranks={"proj": 2}),
                                      dict(r=4, rank_pattern={r"attn\.c_proj": 2})),
    "layers without adapters": (dict(zero_layers=(1,)), dict(layers_to_transform=[0, 2])),
}


@pytest.mark.parametrize("kw, fields", list(OURS.values()), ids=list(OURS))
def test_a_config_stackwise_saved_gives_peft_on_gpt2_the_stacked_model_s_logits(
        tmp_path, kw, fields):
    model = _model()
    params = _load(model, tmp_path / "hf")
    adapters = ours(params["layers"], TARGETS, **kw)
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], adapters)
    stackwise.lora.save_peft(tmp_path / "adapter", adapters, modules, layers=layers)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in fields} == fields
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS),
                               torch_logits(peft_model, TOKENS), **TOL)
    if "layers_to_transform" in fields:  # PEFT put no adapter on layer 1
        assert not hasattr(peft_model.base_model.model.transformer.h[1].attn.c_attn, "lora_A")
    back = stackwise.lora.load_peft(tmp_path / "adapter", params["layers"], modules,
                                    layers=layers)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


def test_peft_s_trained_biases_of_gpt2_are_refused_by_name(tmp_path):
    """GPT-2's Conv1D have biases: with `bias="all"` PEFT trains and saves them (and the
    norms'), which stackwise's adapters (A and B alone) cannot hold: refused, naming one."""
    model = _model()
    params = _load(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn"], bias="all")
    peft.get_peft_model(model, config).save_pretrained(str(tmp_path / "peft"))
    like = stackwise.lora.init(jax.random.key(0), params["layers"], rank=4, targets=["['qkv']"])
    modules, layers = stackwise.lora.peft_modules(NAMES["layers"], like)
    with pytest.raises(ValueError) as info:
        stackwise.lora.load_peft(tmp_path / "peft", params["layers"], modules, layers=layers)
    words = ["bias='all'", "trained biases (e.g. base_model.model.transformer.",
             "stackwise's adapters are LoRA's A and B alone"]
    assert all(w in str(info.value) for w in words), str(info.value)
