"""Fine-tuning a stack: LoRA adapters and quantized weights, one layer at a time (jax only).

Above the core (it imports :mod:`stackwise._core` only); the public names are
``stackwise.lora`` and ``stackwise.quant``.

- :mod:`.targets`: which leaves of stacked params an adapter or a quantizer takes.
- :mod:`.quant`: int8 / int4 / nf4 stacked weights with per-layer, per-channel scales.
- :mod:`.quantizer`: which leaves :func:`stackwise.quant.quantize` takes, and how.
- :mod:`.lora`: stacked low-rank adapters on chosen leaves: made and attached; :mod:`.batch`:
  a batch of them on one base; :mod:`.merge`: merged into the base and taken back out.
- :mod:`.layer`: a layer's ``apply`` run on adapted and quantized params inside the scan.
- :mod:`.rows`: a batch whose rows each pick an adapter (multi-LoRA serving): the layer's
  one-row program run for every row, each adapted product given its low-rank term.
- :mod:`.dropout`: LoRA dropout as PEFT trains it: the layer's program run with each
  adapted product given its term on the product's dropped input.
- :mod:`.train`: the trainable/frozen split and the optimizer's masks.
- :mod:`.peft`: adapters back from Hugging Face PEFT's folder layout (:mod:`.peft_save`: out
  to it; :mod:`.peft_config`: its ``adapter_config.json``).
"""
