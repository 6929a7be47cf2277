"""What one GPU batch's layer holds while it computes, beside the tiers' homes: the
schedule keeps that much freed memory resident for the next layers to reuse
(memory/host_allocator.py), and the cost model counts it in the memory a block needs."""

from __future__ import annotations

import torch

from flexgen_helm.models.config import ModelConfig

# freed memory kept resident, in working sets of the block's widest GPU batch: one is what
# the next layer reuses, the other room for the heap's fragmentation between two releases
KEPT_WORKING_SETS = 2


def batch_working_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """Intermediate activations of a block layer over `rows` positions at its widest point:
    the hidden state, q/k/v (or the attention output and the residual) and the MLP's two
    widest tensors (its input projection and the activation of it), live together."""
    elt = torch.empty((), dtype=dtype).element_size()
    return rows * (4 * cfg.hidden_size + 2 * cfg.ffn_size) * elt


def kept_freed_bytes(cfg: ModelConfig, gpu_batch_size: int, prompt_len: int, dtype: torch.dtype) -> int:
    """Freed host memory a block keeps resident for reuse: KEPT_WORKING_SETS prefill working
    sets (the widest the block has) of its largest GPU batch."""
    return KEPT_WORKING_SETS * batch_working_bytes(cfg, gpu_batch_size * prompt_len, dtype)
