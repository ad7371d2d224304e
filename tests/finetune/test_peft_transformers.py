"""Adapters against Hugging Face PEFT on a real transformers model, when torch, transformers and
peft are installed (the suite does not install them; each test skips without them).

A tiny random Llama (``LlamaConfig``) is saved with ``save_pretrained`` and loaded into stacked
params with ``stackwise.load_checkpoint``; a stacked Llama in JAX (RMSNorm, rotary attention,
SwiGLU) runs it with ``stackwise.lora.stack``. Adapters exported with
``stackwise.lora.save_peft`` and loaded by ``peft.PeftModel.from_pretrained`` give the stacked
model's logits; a folder that PEFT itself wrote (``PeftModel.save_pretrained``) loads with
``stackwise.lora.load_peft`` bitwise, and gives PEFT's logits; PEFT's files for a Llama of
another depth or width are refused. A tiny Qwen2 (a Llama with biases on q, k and v) gives the
same both ways, as do a tiny Mistral and a tiny Gemma (norms by 1 + w, GELU, scaled embeddings),
and PEFT's files holding its trained biases (``bias="all"``) are refused by
name. Checked with transformers 5.25, peft 0.21.2 and torch 2.13 and 2.14.1 (CPU)."""

from __future__ import annotations

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

# transformers 5 and PEFT warn of their own deprecations while PEFT wraps a model.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning",
                                        "ignore::DeprecationWarning", "ignore::UserWarning")

N, E, F, V, HEADS, KV = 3, 16, 32, 64, 4, 2  # layers, width, MLP width, vocab, heads, kv heads
DH = E // HEADS
LAYER = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
         "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
         "down": "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
#: The adapted leaves and their modules within a transformers layer (the ``modules`` argument).
MODULES = {"['q']": "self_attn.q_proj", "['v']": "self_attn.v_proj",
           "['down']": "mlp.down_proj"}
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 attention and MLP of 3 layers, torch against XLA


#: Each architecture's config and model classes (Qwen2: biases on q, k and v).
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
         "mistral": ("MistralConfig", "MistralForCausalLM"),
         "gemma": ("GemmaConfig", "GemmaForCausalLM")}


def _model(arch="llama"):
    config_class, model_class = (getattr(transformers, c) for c in ARCHS[arch])
    config = config_class(
        head_dim=DH, vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=N,
        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=32,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # norms off their ones, biases off zero, so that a slip shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _load(model, folder):
    """The model's ``save_pretrained`` files as stacked params (layers) and the rest."""
    model.save_pretrained(folder)
    state = model.state_dict()
    names, target = {"layers": {}}, {"layers": {}}
    for leaf, module in LAYER.items():
        out, in_ = state[f"model.layers.0.{module}.weight"].shape
        names["layers"][leaf] = stackwise.Tensor(f"model.layers.{{}}.{module}.weight",
                                                 transpose=(1, 0))
        target["layers"][leaf] = jax.ShapeDtypeStruct((N, in_, out), jnp.float32)
        if f"model.layers.0.{module}.bias" in state:  # Qwen2's q, k and v
            names["layers"][leaf + "_b"] = f"model.layers.{{}}.{module}.bias"
            target["layers"][leaf + "_b"] = jax.ShapeDtypeStruct((N, out), jnp.float32)
    for leaf, module in NORMS.items():
        names["layers"][leaf] = f"model.layers.{{}}.{module}.weight"
        target["layers"][leaf] = jax.ShapeDtypeStruct((N, E), jnp.float32)
    for leaf, name in {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                       "head": "lm_head.weight"}.items():
        names[leaf] = name
        target[leaf] = jax.ShapeDtypeStruct(tuple(state[name].shape), jnp.float32)
    return stackwise.load_checkpoint(folder, target, names)


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w[None, :]


def _rope(x, theta):
    """Hugging Face's rotary embedding (``rotate_half``): x ``(T, heads, DH)``."""
    inv = 1.0 / theta ** (np.arange(0, DH, 2, dtype=np.float32) / DH)
    freqs = np.arange(x.shape[0], dtype=np.float32)[:, None] * inv[None, :]
    angles = np.concatenate([freqs, freqs], -1)[:, None, :]
    cos, sin = jnp.asarray(np.cos(angles)), jnp.asarray(np.sin(angles))
    half = jnp.concatenate([-x[..., DH // 2:], x[..., : DH // 2]], -1)
    return x * cos + half * sin


def _bias(p, leaf):
    return p[leaf + "_b"][None, :] if leaf + "_b" in p else 0.0


def _gemma(config):
    """Gemma's differences from a Llama: norms scale by 1 + w, the MLP's gate is GELU (tanh),
    and the embeddings are scaled by sqrt(E)."""
    if config.model_type != "gemma":
        return 0.0, jax.nn.silu, 1.0
    return 1.0, lambda x: jax.nn.gelu(x, approximate=True), float(np.float32(np.sqrt(E)))


def _block(config):
    eps = config.rms_norm_eps
    one, act, _ = _gemma(config)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(
        config, "rope_theta", 10000.0)

    def apply(p, x):  # one Llama layer on x (T, E), causal
        t = x.shape[0]
        h = _rms(x, one + p["attn_norm"], eps)
        q = _rope((h @ p["q"] + _bias(p, "q")).reshape(t, HEADS, DH), theta)
        k = _rope((h @ p["k"] + _bias(p, "k")).reshape(t, KV, DH), theta)
        v = (h @ p["v"] + _bias(p, "v")).reshape(t, KV, DH)
        k, v = (jnp.repeat(a, HEADS // KV, axis=1) for a in (k, v))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(DH)
        scores = jnp.where(jnp.tril(jnp.ones((1, t, t), bool)), scores, -jnp.inf)
        attn = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, -1), v).reshape(t, E)
        x = x + attn @ p["o"]
        h = _rms(x, one + p["mlp_norm"], eps)
        return x + (act(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

    return apply


def _logits(model, params, adapters, tokens):
    layers = stackwise.lora.stack(_block(model.config), N)
    eps = model.config.rms_norm_eps
    one, _, embed_scale = _gemma(model.config)
    out = []
    for row in tokens:
        x = params["embed"][jnp.asarray(row)] * embed_scale
        x = layers.apply(stackwise.lora.attach(params["layers"], adapters), x)
        out.append(_rms(x, one + params["norm"], eps) @ params["head"].T)
    return np.stack(out)


TOKENS = (np.arange(14).reshape(2, 7) * 5 % V).astype(np.int64)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_stacked_llama_is_the_transformers_model(tmp_path, arch):
    """The reference the PEFT tests stand on: without adapters, the same logits."""
    model = _model(arch)
    params = _load(model, tmp_path / "hf")
    none = jax.tree.map(lambda _: None, params["layers"])
    np.testing.assert_allclose(_logits(model, params, none, TOKENS), torch_logits(model, TOKENS),
                               **TOL)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exported_adapters_give_peft_the_stacked_model_s_logits(tmp_path, arch):
    model = _model(arch)
    params = _load(model, tmp_path / "hf")
    adapters = stackwise.lora.init(jax.random.key(0), params["layers"], rank=4, alpha=8.0,
                                   targets=list(MODULES))
    keys = iter(jax.random.split(jax.random.key(1), 16))
    adapters = jax.tree.map(lambda v: v + 0.2 * jax.random.normal(next(keys), v.shape),
                            adapters)  # as if trained: b off its zeros
    ours = _logits(model, params, adapters, TOKENS)
    stackwise.lora.save_peft(tmp_path / "adapter", adapters, MODULES)
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(ours, theirs, **TOL)
    assert_the_adapters_matter(peft_model, TOKENS, theirs, TOL["atol"])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_folder_peft_saved_loads_bitwise_with_peft_s_logits(tmp_path, arch):
    model = _model(arch)
    params = _load(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, config).eval()
    peft_model.save_pretrained(str(tmp_path / "peft"))
    adapters = stackwise.lora.load_peft(tmp_path / "peft", params["layers"], MODULES)
    assert all(adapters[path[2:-2]].alpha == 16.0 for path in MODULES)
    assert_loaded_bitwise(adapters, MODULES, peft_model.base_model.model.model.layers)
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS),
                               torch_logits(peft_model, TOKENS), **TOL)


@pytest.mark.parametrize("other, words", [
    ({"num_hidden_layers": N - 1}, "layers.2.mlp.down_proj.lora_A.weight is missing"),
    ({"num_hidden_layers": N + 1}, "fit no layer of the base"),
    ({"hidden_size": 2 * E}, "down_proj.lora_B.weight is of shape (32, 4), expected (16, 4)"),
])
def test_a_folder_peft_saved_for_another_model_is_refused(tmp_path, other, words):
    """PEFT's own files for a Llama of another depth or width, onto this one's base."""
    params = _load(_model(), tmp_path / "hf")
    config = transformers.LlamaConfig(**{
        "vocab_size": V, "hidden_size": E, "intermediate_size": F, "num_hidden_layers": N,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, **other})
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).save_pretrained(
        str(tmp_path / "other"))
    with pytest.raises(ValueError) as info:
        stackwise.lora.load_peft(tmp_path / "other", params["layers"], MODULES)
    assert words in str(info.value) and "another model" in str(info.value), str(info.value)


# --------------------------------------------------------------------------
# PEFT's LoraConfig fields, each both ways: a folder PEFT made loads with PEFT's logits, and
# one stackwise made loads in PEFT with stackwise's. (docs/finetune.md's table names these.)

#: LoraConfig settings PEFT makes adapters with; each loads in stackwise with PEFT's logits.
PEFT_CONFIGS = {
    "use_rslora": dict(use_rslora=True),
    "rank_pattern, alpha_pattern": dict(rank_pattern={"v_proj": 2, "down_proj": 8},
                                        alpha_pattern={"down_proj": 4}),
    "rank_pattern, rsLoRA": dict(rank_pattern={r"mlp\.down_proj": 2}, use_rslora=True),
    "layers_to_transform": dict(layers_to_transform=[0, 2]),
    "layers_to_transform, an int": dict(layers_to_transform=1),
    "layers_to_transform, layers_pattern": dict(layers_to_transform=[1, 2],
                                                layers_pattern="layers"),
    "exclude_modules": dict(exclude_modules=["model.layers.1.self_attn.q_proj"]),
    "lora_dropout": dict(lora_dropout=0.25),
    "bias all (a Llama has none)": dict(bias="all"),
    "bias lora_only (a Llama has none)": dict(bias="lora_only"),
    "init gaussian": dict(init_lora_weights="gaussian"),
    "use_dora": dict(use_dora=True),
    "use_dora, rsLoRA, rank_pattern": dict(use_dora=True, use_rslora=True,
                                           rank_pattern={"v_proj": 2}),
}


def _peft_made(model, tmp_path, **extra):
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             **{"init_lora_weights": False, **extra})
    peft_model = peft.get_peft_model(model, config).eval()
    peft_as_if_trained(peft_model, gaussian=extra.get("init_lora_weights") == "gaussian")
    peft_model.save_pretrained(str(tmp_path / "peft"))
    return peft_model


@pytest.mark.parametrize("extra", list(PEFT_CONFIGS.values()), ids=list(PEFT_CONFIGS))
def test_a_peft_config_loads_with_peft_s_logits(tmp_path, extra):
    model = _model()
    params = _load(model, tmp_path / "hf")
    peft_model = _peft_made(model, tmp_path, **extra)
    adapters = stackwise.lora.load_peft(tmp_path / "peft", params["layers"], MODULES)
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS), theirs, **TOL)
    assert_the_adapters_matter(peft_model, TOKENS, theirs, TOL["atol"])
    assert_each_module_as_peft_built(adapters, MODULES, peft_model.base_model.model.model.layers)


@pytest.mark.parametrize("bias, adapted", [("all", 3 * N), ("lora_only", 2 * N)])
def test_peft_s_trained_biases_of_a_qwen2_are_refused_by_name(tmp_path, bias, adapted):
    """Qwen2's q, k and v have biases: PEFT's `bias="all"` trains and saves all of them (every
    layer's q and k, and v), `"lora_only"` those of the adapted modules (q and v); stackwise's
    adapters are A and B alone, so such a file is refused, never loaded without them."""
    model = _model("qwen2")
    params = _load(model, tmp_path / "hf")
    _peft_made(model, tmp_path, bias=bias)
    with pytest.raises(ValueError) as info:
        stackwise.lora.load_peft(tmp_path / "peft", params["layers"], MODULES)
    words = [f"bias={bias!r}", f"the file holds {adapted} trained biases",
             "stackwise's adapters are LoRA's A and B alone"]
    assert all(w in str(info.value) for w in words), str(info.value)


#: Adapters stackwise makes, and the config fields save_peft writes for them.
OURS = {
    "rsLoRA": (dict(rslora=True), dict(use_rslora=True, r=4, lora_alpha=8.0)),
    "a rank and alpha per module": (
        dict(ranks={"v": 2, "down": 2}, alphas={"v": 3.0}),
        dict(r=2, lora_alpha=8.0, rank_pattern={r"self_attn\.q_proj": 4},
             alpha_pattern={r"self_attn\.v_proj": 3.0})),
    "ranks per module, rsLoRA": (
        dict(ranks={"q": 2}, rslora=True),
        dict(use_rslora=True, rank_pattern={r"self_attn\.q_proj": 2})),
    "layers without adapters": (dict(zero_layers=(1,)), dict(layers_to_transform=[0, 2])),
    "lora_dropout": (dict(dropout=0.25), dict(lora_dropout=0.25)),
    "DoRA": (dict(dora=True), dict(use_dora=True)),
    "DoRA, rsLoRA, ranks per module": (
        dict(dora=True, rslora=True, ranks={"down": 2}),
        dict(use_dora=True, use_rslora=True, rank_pattern={r"mlp\.down_proj": 2})),
}


@pytest.mark.parametrize("kw, fields", list(OURS.values()), ids=list(OURS))
def test_a_config_stackwise_saved_gives_peft_the_stacked_model_s_logits(tmp_path, kw, fields):
    import json

    model = _model()
    params = _load(model, tmp_path / "hf")
    adapters = ours(params["layers"], MODULES, **kw)
    dropout = fields.get("lora_dropout", 0.0)
    stackwise.lora.save_peft(tmp_path / "adapter", adapters, MODULES)  # (the adapters' rate)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in fields} == fields
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(_logits(model, params, adapters, TOKENS),
                               torch_logits(peft_model, TOKENS), **TOL)
    if "layers_to_transform" in fields:  # PEFT put no adapter on layer 1
        assert not hasattr(peft_model.base_model.model.model.layers[1].self_attn.q_proj,
                           "lora_A")
    lora_dropout = peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout
    assert getattr(lora_dropout["default"], "p", 0.0) == dropout
    # And back, bitwise.
    back = stackwise.lora.load_peft(tmp_path / "adapter", params["layers"], MODULES)
    assert jax.tree.structure(back) == jax.tree.structure(adapters)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)


SAVED = ["lm_head", "embed_tokens", "input_layernorm"]


def _with_saved(params, saved):
    """The params with the saved modules' copies in place (their names in the model)."""
    params = jax.tree.map(lambda v: v, params)
    params["head"] = saved["lm_head.weight"]
    params["embed"] = saved["model.embed_tokens.weight"]
    params["layers"]["attn_norm"] = jnp.stack(
        [saved[f"model.layers.{i}.input_layernorm.weight"] for i in range(N)])
    return params


def test_peft_s_modules_to_save_load_with_peft_s_logits(tmp_path):
    """modules_to_save: PEFT trains full copies of the head, the embedding and every layer's
    first norm beside the adapters; `load_peft(..., modules_to_save=True)` gives them by their
    names in the model, and in place they give PEFT's logits."""
    model = _model()
    params = _load(model, tmp_path / "hf")
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, modules_to_save=SAVED)
    peft_model = peft.get_peft_model(model, config).eval()
    torch.manual_seed(2)
    with torch.no_grad():  # as if trained: the copies off the base's values
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.1 * torch.randn_like(p))
    peft_model.save_pretrained(str(tmp_path / "peft"))
    with pytest.raises(ValueError, match="Pass `modules_to_save=True`"):
        stackwise.lora.load_peft(tmp_path / "peft", params["layers"], MODULES)
    adapters, saved = stackwise.lora.load_peft(tmp_path / "peft", params["layers"], MODULES,
                                               modules_to_save=True)
    assert sorted(saved) == sorted(["lm_head.weight", "model.embed_tokens.weight"] + [
        f"model.layers.{i}.input_layernorm.weight" for i in range(N)])
    theirs = torch_logits(peft_model, TOKENS)
    np.testing.assert_allclose(_logits(model, _with_saved(params, saved), adapters, TOKENS),
                               theirs, **TOL)
    # The copies matter (can fail): with the base's own modules, other logits.
    assert np.abs(_logits(model, params, adapters, TOKENS) - theirs).max() > 100 * TOL["atol"]


def test_modules_to_save_stackwise_saved_give_peft_the_stacked_model_s_logits(tmp_path):
    model = _model()
    params = _load(model, tmp_path / "hf")
    adapters = ours(params["layers"], MODULES)
    keys = iter(jax.random.split(jax.random.key(7), 8))
    saved = {"lm_head.weight": params["head"], "model.embed_tokens.weight": params["embed"],
             **{f"model.layers.{i}.input_layernorm.weight": params["layers"]["attn_norm"][i]
                for i in range(N)}}
    saved = {k: v + 0.1 * jax.random.normal(next(keys), v.shape) for k, v in saved.items()}
    stackwise.lora.save_peft(tmp_path / "adapter", adapters, MODULES, modules_to_save=saved)
    import json

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == sorted(
        ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.input_layernorm"
                                             for i in range(N)])
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(_logits(model, _with_saved(params, saved), adapters, TOKENS),
                               torch_logits(peft_model, TOKENS), **TOL)
    back, back_saved = stackwise.lora.load_peft(tmp_path / "adapter", params["layers"],
                                                MODULES, modules_to_save=True)
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
    assert back_saved.keys() == saved.keys()
    for k in saved:
        np.testing.assert_array_equal(back_saved[k], saved[k])
