"""Train a character-level transformer whose blocks are one stackwise stack, then sample.

    python examples/transformer_lm.py                      # pure JAX: 111 s on 2 idle CPU cores
    python examples/transformer_lm.py --steps 200          # a first sample sooner
    python examples/transformer_lm.py --framework flax     # or haiku, nnx, equinox: the same
    python examples/transformer_lm.py --pattern local,local,global --window 16  # local attention
    python examples/transformer_lm.py --resume             # continue an interrupted run
    python examples/transformer_lm.py --restore            # sample from the saved checkpoint
    python examples/transformer_lm.py --restore --export out/lm_hf  # as per-layer safetensors
    python examples/transformer_lm.py --load-safetensors out/lm_hf  # sample from them
    python examples/transformer_lm.py --remat --layers 24  # remat each block; any depth
    python examples/transformer_lm.py --lora 8             # fine-tune the checkpoint with LoRA
    python examples/transformer_lm.py --lora 8 --quantize nf4  # QLoRA, on an nf4 base

What it shows:
  * the blocks' params are stacked (a leading layer axis) and run as ONE scanned layer, so the
    compile time does not grow with ``--layers``;
  * a pattern of kinds of block (``--pattern local,local,global``: sliding-window attention
    over the last ``--window`` tokens, and attention over the whole context), repeated over
    the ``--layers`` blocks as one pattern stack, ``--layers`` need not be a multiple of it;
  * training with optax on the embedded text (``examples/data/shakespeare.txt``, or ``--text``),
    reporting the loss in nats, bits per character and perplexity;
  * sampling token by token with a stacked per-layer KV cache (the stack's per-layer state),
    checked against the full forward pass (within a bound derived from the precision the
    backend's matmuls run at, relative to the logits' size), with prefill and decode
    speeds; the pure-JAX model (and every ``--lora`` run) samples in the serving layout
    (``stackwise.to_serving``: one buffer per layer for the weights and the cache, run as a
    loop of layers);
  * checkpoints of the stacked params, restored and converted to the layout of the same model
    written as a plain Python loop over separate blocks (``stackwise.unstack_layers``,
    ``stackwise.haiku.to_loop``, ``stackwise.flax.to_loop`` or Equinox's
    ``Stack.to_layers()``), giving the same logits.

Checkpoints: orbax's ``CheckpointManager`` in the folder ``examples/checkpoints/lm_<framework>``
unless ``--checkpoint DIR``, one subfolder per saved step (``state``: the arrays, ``meta``: the
run as JSON), the last ``--keep`` (3) kept. Training saves every ``--save-every`` steps (by
default at every validation, every ``--steps``/8), at the last step and on Ctrl-C; orbax writes
a step to a temporary folder, then renames it, so a save is never half-written. A checkpoint
belongs to one run: the framework, the model's sizes and pattern, the text (its SHA-256), the
seed, batch, learning rate, optimizer and number of steps. Training never replaces an existing
checkpoint unless asked: ``--resume`` continues the run it holds from its last save (params,
optimizer state, step and RNG are saved, so a resumed run computes exactly what an
uninterrupted one does), ``--overwrite`` trains a new run over it. The same command again, once
its run has finished, samples from the checkpoint (and says so) instead of training. ``--resume``
and ``--restore`` take every run flag you leave out from the checkpoint; one you give must agree.

``--export DIR`` also saves the params as a per-layer safetensors checkpoint with Hugging
Face-style names (``model.layers.{i}.self_attn.qkv_proj.weight``, torch's ``(out, in)`` layout,
through ``stackwise.save_safetensors``) and the run (``transformer_lm.json``);
``--load-safetensors DIR`` samples from it (``stackwise.load_checkpoint``), as ``--restore``
does: the same samples. The names are the same for every ``--framework`` (``hf_names`` reads
them off each framework's params: Haiku's ``lm/blocks/block/qkv`` ``w``, linen's and NNX's
``kernel``, Equinox's ``weight``, which alone keeps torch's layout).

``--lora RANK`` fine-tunes the checkpoint's run (its frozen base) with LoRA adapters on every
linear layer of the blocks, for ``--steps`` (default 200) steps, saves them in Hugging Face
PEFT's layout (``--adapters DIR``, default ``<checkpoint>_lora``) and samples with them merged;
``--quantize int8|int4|nf4`` quantizes the base first (QLoRA) and samples from it with the
adapters; ``--lora-dropout RATE`` drops the adapters' input while training (PEFT's
``lora_dropout``), and ``--modules-to-save lm_head,norm,embed_tokens`` trains those modules
whole beside the adapters and saves them with them (PEFT's ``modules_to_save``).
``examples/lm/finetune.py`` says how.
"""
