"""The evaluation data sets (LAMBADA, WikiText-2): where their files live and how they are
read, shared by the HELM scenarios and `flexgen-helm eval`."""
