"""LoRA for stacked layers, without a framework: stacked per-layer adapters on a shared,
frozen base (see ``docs/finetune.md``).

>>> import jax, jax.numpy as jnp, stackwise
>>> base = {"w": jnp.ones((4, 8, 8))}
>>> adapters = stackwise.lora.init(jax.random.key(0), base, rank=2)
>>> layers = stackwise.lora.stack(lambda p, x: x @ p["w"], 4)
>>> layers.apply(stackwise.lora.attach(base, adapters), jnp.ones((1, 8))).shape
(1, 8)
"""

from stackwise._checkpoint.peft_names import peft_modules as peft_modules
from stackwise._finetune.batch import stack_adapters as stack_adapters
from stackwise._finetune.layer import stack_adapted as stack
from stackwise._finetune.layer import wrap as wrap
from stackwise._finetune.lora import Adapted as Adapted
from stackwise._finetune.lora import LoraWeights as LoraWeights
from stackwise._finetune.lora import attach as attach
from stackwise._finetune.lora import init as init
from stackwise._finetune.merge import merge as merge
from stackwise._finetune.merge import unmerge as unmerge
from stackwise._finetune.peft import load_peft as load_peft
from stackwise._finetune.peft_save import save_peft as save_peft
from stackwise._finetune.train import combine as combine
from stackwise._finetune.train import layer_axes as layer_axes
from stackwise._finetune.train import mask as mask
from stackwise._finetune.train import split as split

__all__ = [
    "Adapted",
    "LoraWeights",
    "attach",
    "combine",
    "init",
    "layer_axes",
    "load_peft",
    "mask",
    "merge",
    "peft_modules",
    "save_peft",
    "split",
    "stack",
    "stack_adapters",
    "unmerge",
    "wrap",
]
