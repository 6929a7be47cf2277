"""Accuracy evaluation outside HELM: LAMBADA and WikiText through the engine's scoring API
(`flexgen-helm eval`), a frontend beside the HELM plugin. The sweep and report over many
runs are tools (flexgen_helm/tools/accuracy_sweep)."""
