"""Several processes: pipeline parallelism over layers under torchrun (FlexGen Section 4.4),
each stage running the single-device engine on its share of the layers. Layer: above the
engine, below the frontends."""
