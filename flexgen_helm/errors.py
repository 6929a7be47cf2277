"""Errors a user can act on. Each message names the problem and what to do."""


class FlexGenError(Exception):
    """Base class of every error the engine raises on bad input or bad state."""


class PolicyError(FlexGenError, ValueError):
    """An invalid placement or batching policy."""


class ModelNotFoundError(FlexGenError, LookupError):
    """An unknown model name or a missing model path."""


class WeightStoreError(FlexGenError, IOError):
    """A missing, truncated or corrupted weight file or tensor store."""


class PromptTooLongError(FlexGenError, ValueError):
    """A prompt (plus the tokens to generate) longer than the model's context."""


class OffloadDirError(FlexGenError, IOError):
    """The offload directory is unwritable or the disk is full."""


class DataUnreachableError(FlexGenError, ConnectionError):
    """A scenario's data must be downloaded and its source cannot be reached."""


class BrowserError(FlexGenError, RuntimeError):
    """No headless browser to take a screenshot with, or the page did not render in it."""


class DiskFullError(OffloadDirError):
    """Not enough free space for what must be written (offload files, a weight store, HELM's
    outputs); the message names the path, the bytes needed and the bytes free."""


class ProfileFormatError(FlexGenError, ValueError):
    """A saved hardware profile of another format than this engine's: it lacks what the cost
    model now needs, so it must be measured again."""


class ClusterError(FlexGenError, RuntimeError):
    """The cluster manager (Slurm) or a process group's rendezvous cannot be used: the message
    names the command or address that failed and how to start or reach it."""
