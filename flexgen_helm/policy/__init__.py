"""The policy as plain data: where weights, KV cache and activations live (fractions per
tier), the block shape, compression and sparsity. Code that executes or chooses a policy
lives in executor/ and planner/."""

from flexgen_helm.policy.policy import Compression, Policy, Split

__all__ = ["Policy", "Split", "Compression"]
