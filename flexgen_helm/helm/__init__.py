"""The HELM plugin (a frontend): the flexgen/<model> client, tokenizer, deployments, run
specs and scenarios, and the runners that batch HELM's requests for the engine. helm-run
imports flexgen_helm.helm.plugin through the 'helm' entry point."""
