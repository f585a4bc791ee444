"""nn.Modules: the MoE layer, its experts and gate, and drop-in transformer MLPs."""
