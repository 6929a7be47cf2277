"""Validation of the cost model against measured runs (runs/policy) and the refit of a
profile's terms to bench results (`flexgen-helm profile --refit`)."""
