"""Accuracy evaluation outside HELM: LAMBADA and WikiText through the engine's scoring API
(`flexgen-helm eval`), and the report that tabulates the runs."""
