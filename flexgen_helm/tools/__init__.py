"""Tools that drive the engine to measure or report (the layer below the command line):
bench, compare (against HF accelerate, ablations), report and demo, cost-model validation
and refit, the accuracy sweep. Nothing in the runtime imports them."""
