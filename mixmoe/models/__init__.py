"""Whole models with mixmoe MoE layers (L5): GPT-2/BERT MoE-fication and model code (the
transformers adapters live in ``mixmoe.hf``).

``moefy``            dense FFNs of Hugging Face GPT-2 / BERT blocks -> MoE layers, in place
``moe_ffn``          the ``MoEFFN`` wrapper and the per-model aux-loss collector (``moe_aux_loss``)
``layer_selection``  ``all`` / ``every:N`` / index lists of blocks
``transformer_xl``   a compact Transformer-XL language model whose FFNs can be MoE layers

Nothing is imported here: transformers is an optional extra (``pip install mixmoe[models]``),
loaded lazily by the modules that need it. Import what you use, e.g.
``from mixmoe.models.moefy import moefy, moe_aux_loss``.
"""
