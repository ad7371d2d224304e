"""A real Hugging Face transformers model, in both directions, when transformers and torch are
installed (the suite does not install them; each test skips without them).

`save_pretrained`'s files load into stacked params (torch's `(out, in)` weights transposed to
`(in, out)`, as a JAX model keeps them), bitwise; saved back with `save_safetensors` in torch's
layout, next to the model's `config.json`, `from_pretrained` reads them and the model gives the
same logits as the original. Checked with transformers 5.25 and torch 2.13 (CPU)."""

import json

import numpy as np
import pytest

import stackwise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # (transformers' own)

N, E, F, V = 3, 16, 32, 64
#: Each per-layer weight of a Llama block, by the name of its leaf in the stacked tree.
LAYER = {
    "q": "model.layers.{}.self_attn.q_proj.weight",
    "k": "model.layers.{}.self_attn.k_proj.weight",
    "v": "model.layers.{}.self_attn.v_proj.weight",
    "o": "model.layers.{}.self_attn.o_proj.weight",
    "gate": "model.layers.{}.mlp.gate_proj.weight",
    "up": "model.layers.{}.mlp.up_proj.weight",
    "down": "model.layers.{}.mlp.down_proj.weight",
}
NORMS = {
    "attn_norm": "model.layers.{}.input_layernorm.weight",
    "mlp_norm": "model.layers.{}.post_attention_layernorm.weight",
}
OUTSIDE = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
           "head": "lm_head.weight"}


def _model():
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=N,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _names_and_target(model):
    state = model.state_dict()
    names, target = {}, {}
    for leaf, template in LAYER.items():
        out, in_ = state[template.format(0)].shape
        names[leaf] = stackwise.Tensor(template, transpose=(1, 0))
        target[leaf] = jax.ShapeDtypeStruct((N, in_, out), np.float32)
    for leaf, template in NORMS.items():
        names[leaf] = template
        target[leaf] = jax.ShapeDtypeStruct((N, E), np.float32)
    for leaf, name in OUTSIDE.items():
        names[leaf] = name
        target[leaf] = jax.ShapeDtypeStruct(tuple(state[name].shape), np.float32)
    return names, target


def test_save_pretrained_loads_into_stacked_params_bitwise(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    names, target = _names_and_target(model)
    params = stackwise.load_checkpoint(tmp_path, target, names)
    state = model.state_dict()
    for leaf, template in LAYER.items():
        for i in range(N):
            want = state[template.format(i)].numpy().T
            assert np.array_equal(np.asarray(params[leaf][i]), want), (leaf, i)
    for leaf, template in NORMS.items():
        for i in range(N):
            assert np.array_equal(np.asarray(params[leaf][i]), state[template.format(i)].numpy())
    for leaf, name in OUTSIDE.items():
        assert np.array_equal(np.asarray(params[leaf]), state[name].numpy()), leaf


def test_save_safetensors_loads_in_from_pretrained_with_the_same_logits(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "hf")
    names, target = _names_and_target(model)
    params = stackwise.load_checkpoint(tmp_path / "hf", target, names)
    out = tmp_path / "back"
    stackwise.save_safetensors(params, names, out, max_file_bytes=20_000)  # several files
    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with an index, as HF shards
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    tokens = torch.arange(12).reshape(2, 6) % V
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)
