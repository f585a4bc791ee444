"""Model integrations (L5): Hugging Face transformers MoE families on mixmoe.

``hf_layout``   the one adapter from transformers' experts weight layouts to mixmoe's
``hf_experts``  mixmoe as a transformers experts implementation (``import mixmoe.hf`` registers it)
``hf_convert``  exact conversion of transformers sparse-MoE blocks into mixmoe ``MoE`` layers

transformers is an optional dependency (the ``models`` extra): nothing here imports it at import
time of ``mixmoe``; the modules that need it import it when called.
"""
