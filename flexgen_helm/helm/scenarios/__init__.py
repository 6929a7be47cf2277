"""Scenarios that read their data from a local path (offline) or, when online, a hub."""
