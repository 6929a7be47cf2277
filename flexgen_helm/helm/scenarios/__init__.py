"""Scenarios that read their data from a local path (offline) or, when online, a hub."""

# How a missing data file is pointed to from a HELM run entry: the scenario's `path` argument
RUN_ENTRY_HINT = "pass path=... in the run entry"
