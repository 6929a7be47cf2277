"""What one GPU batch's layer holds while it computes, beside the tiers' homes: the
schedule keeps that much freed memory resident for the next layers to reuse
(memory/host_allocator.py), and the cost model counts it in the memory a block needs."""

from __future__ import annotations

import math

import torch

from flexgen_helm.compression.int4 import DEQUANTIZE_CHUNK_ELEMENTS
from flexgen_helm.compression.quantize import should_compress
from flexgen_helm.executor.expert_weights import expert_of
from flexgen_helm.models.config import ModelConfig

# freed memory kept resident, in what a layer frees (kept_freed_bytes): one is what the next
# layer reuses, the other room for the heap's fragmentation between two releases
KEPT_WORKING_SETS = 2
# a dequantization's working copies of one piece (compression/int4.py): its codes' nibble
# halves and uint8 codes (1 + 1), their float32 copy (4) and a bf16 copy to transpose (2)
DEQUANTIZE_WORKING_BYTES = DEQUANTIZE_CHUNK_ELEMENTS * (1 + 1 + 4 + 2)


def batch_working_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """Intermediate activations of a block layer over `rows` positions at its widest point:
    the hidden state, q/k/v (or the attention output and the residual) and the MLP's two
    widest tensors (its input projection and the activation of it), live together."""
    elt = torch.empty((), dtype=dtype).element_size()
    return rows * (4 * cfg.hidden_size + 2 * cfg.ffn_size) * elt


# A decode step's head multiplies the live GPU batches' rows together, consecutive batches
# of at most this many rows a call (a larger batch alone: BlockSchedule._merged_decode_head).
# Merging pays most for small batches (SmolLM2's head in float32 on the AVX2 EPYC: 8+8 rows
# 26 ms merged against 32 apart, 16+17 rows 42 against 57; 50+50 rows 115 against 104;
# runs/bench/merged_head), and its working set, kept resident between steps, grows with the
# rows (head_working_bytes: rows x vocabulary x 12 bytes in float32), so the cap.
MERGED_HEAD_ROWS = 64


def head_calls(rows: list[int]) -> list[list[int]]:
    """The GPU batches (indices into `rows`, each batch's live rows) each call of a decode
    step's head multiplies: consecutive batches while their rows sum to at most
    MERGED_HEAD_ROWS, a batch of more alone."""
    calls: list[list[int]] = []
    total = 0
    for i, n in enumerate(rows):
        if calls and total + n <= MERGED_HEAD_ROWS:
            calls[-1].append(i)
            total += n
        else:
            calls.append([i])
            total = n
    return calls


def decode_head_rows(gpu_batch_size: int, num_gpu_batches: int) -> int:
    """The most rows a call of a decode step's head may multiply (head_calls: batches of up to
    `gpu_batch_size` rows, thinned as sequences finish)."""
    return max(gpu_batch_size, min(gpu_batch_size * num_gpu_batches, MERGED_HEAD_ROWS))


def decode_head_work(gpu_batch_size: int, num_gpu_batches: int) -> tuple[int, int]:
    """(rows a call on average, calls) of a decode step's head, every GPU batch computing all
    of its rows: head_calls' full calls and the rest."""
    calls = len(head_calls([gpu_batch_size] * num_gpu_batches))
    return math.ceil(gpu_batch_size * num_gpu_batches / calls), calls


def head_working_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """What the head holds while it turns `rows` positions into log-probabilities: their
    vocabulary-wide logits in the compute dtype, the float32 copy log_softmax makes of them
    and its float32 output."""
    elt = torch.empty((), dtype=dtype).element_size()
    return rows * cfg.vocab_size * (elt + 4 + 4)


def kept_freed_bytes(cfg: ModelConfig, gpu_batch_size: int, prompt_len: int, dtype: torch.dtype,
                     dense_weight_numel: int = 0, largest_load: int = 0, head_rows: int = 0) -> int:
    """Freed host memory a block keeps resident for reuse: KEPT_WORKING_SETS times what a
    layer frees when it ends - the prefill working set (the widest the block has) of its
    largest GPU batch, and the dense copy a layer makes of its compressed weights
    (`dense_weight_numel` elements, the largest) with the dequantization's working copies -
    and the buffers of its largest layer's weight load (`largest_load` bytes: read off disk,
    assembled), which the next layer's load reuses. Without the dense copy, every check of a
    4-bit SmolLM2 prefill handed a layer's copy back and the next layer faulted its own in
    again (float and copy_ of its dequantization ~5x slower, thread CPU time under load);
    without the load buffers, every disk read would fault in fresh pages (~half the read
    speed, memory/direct_io.py). And the head's working set over `head_rows` positions
    (head_working_bytes), which its next call reuses: without it, scoring 1024-token
    SmolLM2 windows (256 positions a call, ~125 MB) handed the head's memory back once a
    window and faulted its logits in again."""
    elt = torch.empty((), dtype=dtype).element_size()
    dense = dense_weight_numel * elt + (DEQUANTIZE_WORKING_BYTES if dense_weight_numel else 0)
    # the layers' and the head's working sets are never live together, yet both stay in the
    # heap's free lists between steps (fragments of one do not serve the other): with only the
    # larger of the two kept, 1024-token SmolLM2 windows still handed memory back each window
    freed = (batch_working_bytes(cfg, gpu_batch_size * prompt_len, dtype) + dense
             + head_working_bytes(cfg, head_rows, dtype))
    return KEPT_WORKING_SETS * freed + largest_load


def dense_weight_numel(layers, compression) -> int:
    """Elements of the largest dense copy a block layer makes of its compressed weights (0
    without weight compression). A sparse MoE block dequantizes its experts one at a time,
    each copy dropped once the expert's rows are done (models/moe.expert_mlp): its copy is
    the other weights' and one expert's, the largest."""
    if compression is None:
        return 0
    return max((_block_dense_numel(layer) for layer in layers if layer.kind == "block"), default=0)


def _block_dense_numel(layer) -> int:
    rest, experts = 0, {}
    for t in layer.tensors:
        if not should_compress(t.shape):
            continue
        e = expert_of(t.key)
        if e is None:
            rest += t.numel
        else:
            experts[e] = experts.get(e, 0) + t.numel
    return rest + max(experts.values(), default=0)
