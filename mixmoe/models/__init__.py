"""Whole models with mixmoe MoE layers (L5): Hugging Face integrations and model code.

Nothing is imported here: transformers is an optional extra (``pip install mixmoe[models]``),
loaded lazily by the modules that need it. Import what you use, e.g.
``from mixmoe.models.moefy import moefy, moe_aux_loss``.
"""
