"""The matmul FLOPs of this setup's prefill for ours (32 x 512 tokens) from the OLMoE-1B-7B
geometry: per token and block, q/k/v/o (4 h^2), the router (h x E), and the k chosen experts'
gate, up and down (3 h f each); the scores and values over the causal prompt besides.
Run: python runs/compare/olmoe-1b-7b-p512-g32/2026-11-29_midnight/prefill_flops.py"""
from flexgen_helm.models.moe import geometry

c = geometry("olmoe-1b-7b")
h, f, n_layers = c.hidden_size, c.expert_ffn_size, c.num_layers
active = n_layers * (4 * h * h + h * c.num_experts + c.experts_per_token * 3 * h * f)
tokens, prompt = 32 * 512, 512
attention = n_layers * 2 * 2 * h * (prompt + 1) / 2 * tokens  # QK^T and PV, a causal prompt's mean length
flops = 2 * active * tokens + attention
print(f"active parameters per token {active / 1e9:.3f} G; prefill {flops:.3e} FLOPs")
for label, seconds in (("this row", 90.43), ("../2026-11-29_night", 45.88), ("the profile's prediction", 69.11)):
    print(f"{label}: {seconds} s -> {flops / seconds / 1e12:.2f} TFLOP/s")
