"""The example's command: ``python examples/transformer_lm.py --help`` says what it does.

It trains a character-level transformer whose blocks are one stackwise stack, then samples;
the example is the package ``examples/lm/``, one concern a file:

    lm/__init__.py        what the example does, with its commands (the --help text)
    lm/model.py           the model: its numerics, and the pure-JAX model (``stackwise.stack``)
    lm/haiku_model.py     the same model in Haiku (``stackwise.haiku.Stack``),
    lm/flax_model.py      ... Flax linen, NNX and Equinox, with their own Stack
    lm/nnx_model.py
    lm/equinox_model.py
    lm/data.py            the text as token ids, training batches, validation windows
    lm/train.py           the optimizer (per layer) and the training loop
    lm/checkpoints.py     orbax checkpoints, and the per-layer safetensors of --export
    lm/sample.py          the checks of the logits, KV-cached sampling and its speeds
    lm/precision.py       the checks' bound, from the precision the matmuls run at here
    lm/finetune.py        --lora: LoRA and QLoRA on the pre-trained checkpoint
    lm/run.py             a run: flags against the checkpoint, train, export, sample
    lm/cli.py             the flags (the standard library only: --help answers at once)
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from lm import cli  # noqa: E402  (the package beside this file)

if __name__ == "__main__":
    sys.exit(cli.cli())
