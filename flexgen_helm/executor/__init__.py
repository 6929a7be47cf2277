"""Runs a model under a policy: the zig-zag block schedule with I/O overlapped with compute,
the KV cache and activation homes on each tier, attention (CPU delegation, sparse),
sampling, and the generation and scoring loop over blocks. Layer: below the engine and the
planner; uses memory, weights, compression and models."""
