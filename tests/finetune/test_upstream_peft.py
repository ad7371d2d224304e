"""stackwise's mirror of PEFT's module rules (``stackwise/_upstream/peft.py``, from peft 0.21.2)
against peft's own functions, where peft is installed (the test extra does not install it;
`.ci/torch` does, at the version it pins): a change upstream fails here. Without peft, the
rules are checked against their hand-made meaning in ``test_peft_config.py``."""

from __future__ import annotations

import pytest

from stackwise._upstream import peft as peft_rules

peft = pytest.importorskip("peft")
tuners_utils = pytest.importorskip("peft.tuners.tuners_utils")
other = pytest.importorskip("peft.utils.other")

KEYS = [f"model.layers.{i}.{m}" for i in (0, 1, 2, 10, 12)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
KEYS += ["model.layers.1.block_sparse_moe.experts.3.w1", "transformer.h.2.attn.q_proj",
         "layers.1.self_attn.q_proj"]
PATTERNS = [
    {}, {"q_proj": 8}, {r"self_attn\.q_proj": 2, "q_proj": 8}, {"q_proj|v_proj": 2},
    {"model.layers.1.self_attn.q_proj": 16, "q_proj": 4}, {"^model.layers.1.*": 3},
    {r"layers\.1\d\..*": 5}, {"w1": 6, "experts.3.w1": 7}, {"proj": 2},
]


@pytest.mark.parametrize("patterns", PATTERNS, ids=str)
def test_rank_and_alpha_patterns_are_peft_s(patterns):
    for key in KEYS:
        want = patterns.get(other.get_pattern_key(patterns.keys(), key), 4)
        assert peft_rules.pattern_value(patterns, 4, key) == want, (patterns, key)


LAYER_CONFIGS = [
    dict(), dict(layers_to_transform=[0, 2]), dict(layers_to_transform=1),
    dict(layers_to_transform=[]), dict(layers_to_transform=[1, 12], layers_pattern="layers"),
    dict(layers_to_transform=[2], layers_pattern=["h", "layers"]),
    dict(layers_to_transform=[3], layers_pattern="experts"),
    dict(exclude_modules=["model.layers.1.self_attn.q_proj", "down_proj"]),
    dict(exclude_modules=r".*layers\.(0|2)\..*"),
    dict(exclude_modules=["v_proj"], layers_to_transform=[0, 1]),
    dict(modules_to_save=["model.layers.1.self_attn.q_proj", "lm_head"]),
    dict(modules_to_save=["layers.2"]),
]


@pytest.mark.parametrize("fields", LAYER_CONFIGS, ids=str)
def test_which_modules_get_an_adapter_is_peft_s(fields):
    targets = ["q_proj", "v_proj", "down_proj", "w1"]
    config = peft.LoraConfig(target_modules=targets, **fields)
    for key in KEYS:
        want = bool(tuners_utils.check_target_module_exists(config, key))
        got = peft_rules.adapted({"target_modules": targets, **fields}, key)
        assert got == want, (fields, key)


def test_the_prefix_is_the_one_peft_writes(tmp_path):
    """PEFT's files name a module `base_model.model.` + its key."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(4, 4))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["proj"]))
    names = list(peft.get_peft_model_state_dict(wrapped))
    assert names == [peft_rules.PREFIX + "proj.lora_A.weight",
                     peft_rules.PREFIX + "proj.lora_B.weight"]


def test_which_modules_peft_saves_whole_is_peft_s():
    """`modules_to_save`: PEFT wraps every module whose name ends with one of them."""
    torch = pytest.importorskip("torch")

    def block():
        inner = torch.nn.Module()
        inner.q_proj = torch.nn.Linear(4, 4)
        inner.norm = torch.nn.LayerNorm(4)
        inner.xnorm = torch.nn.LayerNorm(4)
        return inner

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([block() for _ in range(3)])
    model.lm_head = torch.nn.Linear(4, 8)
    names = ["norm", "layers.1.xnorm", "lm_head"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                         modules_to_save=names))
    got = {key[len("base_model.model."):] for key, m in wrapped.named_modules()
           if type(m).__name__ == "ModulesToSaveWrapper"}
    keys = [k for k, _ in model.named_modules() if k and ".modules_to_save" not in k
            and ".original_module" not in k and "lora_" not in k]
    installed = peft_rules.release(peft.__version__)
    want = {k for k in keys if peft_rules.saved_module(names, k, installed)}
    # (`norm` ends `xnorm` too: before peft 0.22.0 that is enough, from it not at a dot)
    assert got == want and ("layers.2.xnorm" in want) == (installed < (0, 22))


def test_every_lora_config_field_is_read_inert_or_refused():
    """A field a newer PEFT adds is refused when set, as one stackwise does not know; here
    each field of the installed PEFT's LoraConfig is one stackwise has decided on."""
    import dataclasses

    from stackwise._finetune import peft_config

    known = peft_config.READ | peft_config.INERT | set(peft_config.REFUSED)
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert fields - known == set(), f"peft {peft.__version__}'s LoraConfig"
