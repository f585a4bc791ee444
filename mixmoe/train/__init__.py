"""Training whole models with mixmoe MoE layers (L6): ``mixmoe train`` and its Python API.

``presets``     gpt2 | bert | transformer-xl | mixtral x tiny | base, built from configs
``corpus``      the byte-level ``pydoc_data.topics`` text (ships with Python)
``data``        the byte-level pydoc corpus: train/eval split, global batches, shards
``grads``       data-parallel / expert-data-parallel gradient sums, global-norm clipping
``loop``        ``TrainConfig``, ``train(config, comm) -> TrainResult``
``checkpoint``  world-size independent checkpoints (parameters and AdamW states resharded)
``outputs``     the JSONL of every step and the loss-curve PNG
``launch``      ``--world-size N`` (spawned gloo processes) or the torchrun group

Nothing is imported here; e.g. ``from mixmoe.train.loop import TrainConfig, train``.
"""
