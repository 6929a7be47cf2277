"""flexgen-helm: a FlexGen-style offloading inference engine, usable as a HELM plugin."""

__version__ = "0.1.0"
