"""A block's compressed weights kept dense from their first use to the block's end, or for the
blocks after it too (Policy.keep_dense_weights, Policy.dense_copies_across_blocks): then all
made at once, at load (or by the first block that keeps them after one that let them go).

Without it, a layer's weights are loaded again at every step of the block, and a decode
step multiplies its few rows on the packed bytes (the int4/int8 kernels), which can be slower
than a dense matmul at those rows (runs/compression_8bit/decode_paths/: SmolLM2 at 10 rows,
decode on the int4 kernel 0.76x bf16's, on kept copies 0.95x). With it, each layer is loaded
once a block, every compressed weight it multiplies is dequantized once, and the block's
later steps reuse the same dense copies: the speed of uncompressed weights for the memory of
both (the planner turns it on only where the compute tier holds every dense copy). Where
every weight lives in the compute tier's memory, the same copies serve the blocks after it
(ModelRuntime.dense_copies), made before any block (make_all). Not for MoE models, whose
experts load as their router picks them (refused).

The layers are written on the copy thread (loads) and read on the compute thread
(count_dense_copies) without a lock: every load that adds a layer is waited for before a
step's count, and the one load still in flight then (the next step's first layer) finds its
layer kept."""

from __future__ import annotations

from typing import Callable

from flexgen_helm.compression.int4 import CompressedWeight
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.expert_weights import ExpertsOnDemand
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.models.spec import is_lookup_table


def check_keep_dense(keep: bool, cfg) -> None:
    """Keeping dense copies is for dense models: an MoE block's experts load as its router
    picks them. One error, wherever a policy asks for it (load, a later block, the search)."""
    if keep and cfg.is_moe:
        raise PolicyError(f"keep_dense_weights: {cfg.name} is a mixture of experts, whose experts load as its router "
                          "picks them; keeping every layer dense is for dense models")


class KeptDenseWeights:
    """The loaded weights of each layer of one block."""

    def __init__(self, usage: TierUsage, tier: str = "gpu"):
        self._usage = usage
        self._tier = tier  # where the dense copies live: the compute device's
        self._layers: dict[tuple[str, int], dict] = {}  # by (kind, index): the head's index is not a block's
        self._counted = 0  # bytes of dense copies in `usage` so far

    def __call__(self, load: Callable, layer, loaded: dict | None = None):
        """The layer's weights: kept ones, else `load(layer, loaded)`'s (the schedule's loading),
        kept from now on."""
        kept = self._layers.get((layer.kind, layer.index))
        if kept is not None:
            return kept
        weights = load(layer, loaded)
        if isinstance(weights, ExpertsOnDemand):  # check_keep_dense refuses MoE models before any block
            raise PolicyError("keep_dense_weights: a sparse MoE block's experts load as its router picks them")
        for w in weights.values():
            if isinstance(w, CompressedWeight):
                w.keep_dense()
        self._layers[layer.kind, layer.index] = weights
        return weights

    def make_all(self, load: Callable, layers) -> None:
        """Every layer's dense copies, made now rather than at each weight's first multiply,
        where the copies serve every block (ModelRuntime.dense_copies): made once with the
        model, as an uncompressed deployment's weights are, and not inside a block's timed
        compute (the main job's first scenario, whose prefill they made ~30% longer:
        runs/compression_8bit/main_job_fresh_2026-11-26_copies_at_load/). By row, the layout
        whose decode-sized products may take W x^T (dense_linear.py); packed, where this
        machine packs the weights it keeps (CompressedWeight.pack_dense)."""
        for layer in layers:
            for key, w in self(load, layer).items():
                # a table whose rows decode apart is looked up without a copy (CompressedWeight.embedding)
                if (isinstance(w, CompressedWeight) and not w.dense_nbytes
                        and not (is_lookup_table(layer, key) and w.rows_apart)):
                    w.dense(by_column=False)
                    w.pack_dense()
        self.count_dense_copies()

    @property
    def nbytes(self) -> int:
        """Bytes of the dense copies counted so far."""
        return self._counted

    def count_dense_copies(self) -> None:
        """Bring the dense copies made so far into the usage account (those a block keeps for
        itself are made at a weight's first multiply, inside the layer's compute)."""
        seen, total = set(), 0
        for weights in self._layers.values():
            for w in weights.values():
                if isinstance(w, CompressedWeight) and id(w) not in seen:
                    seen.add(id(w))
                    total += w.dense_nbytes
        if total != self._counted:
            self._usage.add(self._tier, total - self._counted)
            self._counted = total

    def release(self) -> None:
        self._layers.clear()
        self._usage.remove(self._tier, self._counted)
        self._counted = 0
