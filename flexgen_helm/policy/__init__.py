from flexgen_helm.policy.policy import Compression, Policy, Split

__all__ = ["Policy", "Split", "Compression"]
