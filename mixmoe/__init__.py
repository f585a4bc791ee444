"""mixmoe: Mixture-of-Experts training for PyTorch.

``import mixmoe`` has no side effects; optional dependencies load only when used.
"""

from mixmoe.config import GateConfig, MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.layers.transformer_mlp import FMoETransformerMLP, MixMOETransformerMLP
from mixmoe.types import MoEAux, Routing

__all__ = [
    "FMoETransformerMLP",
    "GateConfig",
    "MixMOETransformerMLP",
    "MoE",
    "MoEAux",
    "MoEConfig",
    "Routing",
]
__version__ = "0.1.0"
