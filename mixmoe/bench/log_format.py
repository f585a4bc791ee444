"""Writer of the layer benchmark log (FORMATS.md section 1), typos included on purpose
(``foward_time``): existing scripts parse exactly this."""

from __future__ import annotations


def header_line(
    *,
    world_size: int,
    dtype: str,
    model_dim: int,
    hidden_size: int,
    samples: int,
    num_local_experts: int,
    top_k: int,
    device: str,
    overlap_degree: int = 1,
) -> str:
    return (
        f"[Benchmark] world_size = {world_size}, dtype = {dtype}, model_dim = {model_dim}, "
        f"hidden_size = {hidden_size}, samples = {samples}, num_local_experts = "
        f"{num_local_experts}, topK = {top_k}, a2a_ffn_overlap_degree = {overlap_degree}, "
        f"device = `{device}`"
    )


def step_line(step: int, step_ms: float, fwd_ms: float, bwd_ms: float, tflops: float) -> str:
    return (
        f"STEP-{step}: step_time = {step_ms:.6f} ms, foward_time = {fwd_ms:.6f}, "
        f"backward_time = {bwd_ms:.6f}, perf = {tflops:.2f} tflops."
    )


def summary_line(
    system: str, num_local_experts: int, step_ms: float, fwd_ms: float, bwd_ms: float
) -> str:
    """Starts with a newline (the blank line) and a space, as in the wild."""
    return (
        f"\n {system} {num_local_experts} [Summary] Average synchronized step_time = "
        f"{step_ms:g} ms, forward = {fwd_ms:g} , backward = {bwd_ms:g} ."
    )


def nominal_tflops(
    samples: int, model_dim: int, hidden_size: int, top_k: int, step_ms: float
) -> float:
    """samples * D * F * 4 * K * 3 / step time: two GEMMs at 2 FLOPs per MAC, fwd + bwd = 3x fwd."""
    if step_ms <= 0:
        return 0.0
    return samples * model_dim * hidden_size * 4 * top_k * 3 / (step_ms * 1e-3) / 1e12
