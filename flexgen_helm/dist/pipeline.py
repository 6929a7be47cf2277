"""Pipeline parallelism (FlexGen Section 4.4): the layers are split into stages, one
process each (launched by torchrun), every stage running the single-device offloading
runtime with its own policy on its own device.

A block's GPU batches are split into as many groups as there are stages, and groups
travel through the stages like micro-batches: while stage s runs group g, stage s+1 runs
group g-1. The last stage samples and sends the new tokens back to the first. Sends are
asynchronous, so that a stage sending forward and a stage sending back never wait on
each other.

A block whose prompts share a prefix computes it once in every stage, as one process does
(executor/shared_prefix.py): each stage decides the same prefix from the prompts it holds,
runs it with the block's first group's prefill, and hands its hidden states on ahead of
that group's GPU batches, whose prefill sends only their windows (the columns after the
prefix).

Every stage runs the engine's one block driver (executor/generation.py); `PipelineStage`
is the StageLink that tells it where a step's inputs come from and where its outputs go.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from flexgen_helm.dist.partition import balanced_bounds, layer_costs
from flexgen_helm.dist.rendezvous import join_process_group, rendezvous_timeout_s
from flexgen_helm.engine import Engine, build_runtime
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.generation import Block, StageLink
from flexgen_helm.executor.sampling import Completion, RunStats, ScoreRun
from flexgen_helm.executor.schedule import BlockSchedule
from flexgen_helm.memory.devices import pick_devices
from flexgen_helm.memory.offload_dir import default_offload_dir, usable_offload_dir
from flexgen_helm.models import family_of
from flexgen_helm.policy.policy import Policy
from flexgen_helm.weights.registry import resolve


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Join the process group torchrun (or srun) describes (NCCL between GPUs, gloo on CPUs),
    waiting at most `timeout_s` for the other ranks (default: $FLEXGEN_HELM_RENDEZVOUS_TIMEOUT_S,
    else 300 s)."""
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        raise FlexGenError("--pipeline needs to be launched by torchrun (e.g. torchrun --nproc-per-node 2 ...) "
                           "or srun (srun -N 2 --ntasks-per-node 1 ...)")
    if not dist.is_initialized():
        join_process_group("nccl" if torch.cuda.is_available() else "gloo",
                           rendezvous_timeout_s() if timeout_s is None else timeout_s)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if not torch.cuda.is_available():
        # stages on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return dist.get_rank(), dist.get_world_size()


class PipelineStage:
    """A StageLink for one stage of the pipeline: a step's input arrives from the stage
    before (the first stage: the tokens the last one sampled), its output goes to the stage
    after (the last stage: the tokens it sampled go back to the first)."""

    def __init__(self, rank: int, world: int, hidden_size: int, dtype: torch.dtype, device):
        self.rank, self.world = rank, world
        self.hidden_size, self.dtype = hidden_size, dtype
        self.device = device  # NCCL moves GPU tensors only; gloo, CPU ones
        self.samples = rank == world - 1
        self.stops_early = False  # the first stages cannot know when the last one is done
        self._pending: list = []

    def micro_batches(self, block: Block) -> list[Block]:
        n_groups = min(self.world, len(block))
        return [block[i::n_groups] for i in range(n_groups)]

    def step_input(self, group: Block, sched: BlockSchedule, step: int,
                   chosen: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        if self.rank == 0 and step == 0:
            return None  # the prompts' token ids
        if self.rank == 0:
            if self.world == 1:
                return chosen
            return [self._recv((len(b),), torch.long, self.world - 1) for b in group]
        return [self._recv((len(b), window if step == 0 else 1, self.hidden_size), self.dtype, self.rank - 1)
                for b, window in zip(group, sched.window)]

    def step_output(self, outputs: list[torch.Tensor], more_steps: bool) -> None:
        if not self.samples:
            self._pending += [self._send(h, self.rank + 1) for h in outputs]
        elif more_steps and self.world > 1:
            self._pending += [self._send(t, 0) for t in outputs]

    def prefix_input(self, length: int) -> torch.Tensor | None:
        if self.rank == 0:
            return None  # the embedding is here
        return self._recv((1, length, self.hidden_size), self.dtype, self.rank - 1)

    def prefix_output(self, hidden: torch.Tensor) -> None:
        if not self.samples:
            self._pending.append(self._send(hidden, self.rank + 1))

    def drain(self) -> None:
        for p in self._pending:
            p.wait()
        self._pending = []

    def _send(self, t: torch.Tensor, dst: int):
        # asynchronous, so that a stage sending forward and one sending back never wait on each other
        return dist.isend(t.to(self.device).contiguous(), dst=dst)

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src=src)
        return t


class PipelineEngine(Engine):
    """An Engine whose runtime holds one stage's layers. Every rank calls generate() with
    the same prompts and gets the same results."""

    @classmethod
    def load(cls, model: str, policy: Policy | None = None, path: str | None = None, dummy: bool = False,
             offload_dir=None, device: str | None = None, dtype: str | None = None, progress: bool = True,
             timeout_s: float | None = None) -> "PipelineEngine":
        rank, world = init_distributed(timeout_s)
        policy = policy or Policy()
        resolved = resolve(model, path=path, dummy=dummy)
        layers = family_of(resolved.config).layer_specs(resolved.config)
        if world > len(layers):
            raise FlexGenError(f"{world} pipeline stages for {len(layers)} layers: use at most {len(layers)} processes")
        bounds = balanced_bounds(layer_costs(layers), world)
        if device is None and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        devices = pick_devices(device, dtype)
        offload = usable_offload_dir(Path(offload_dir or default_offload_dir()) / f"stage-{rank}")  # before loading
        runtime = build_runtime(resolved, policy, devices, offload, progress and rank == 0,
                                layers=layers[bounds[rank]:bounds[rank + 1]])
        engine = cls(resolved, runtime, policy, offload)
        engine.rank, engine.world, engine.bounds = rank, world, bounds
        return engine

    def stage_link(self) -> StageLink:
        devices = self.runtime.devices
        return PipelineStage(self.rank, self.world, self.config.hidden_size, devices.dtype,
                             devices.compute if devices.is_cuda else "cpu")

    def gather(self, completions: list[Completion], stats: RunStats) -> tuple[list[Completion], RunStats]:
        """What the last stage sampled, and its timings, which are the pipeline's: it is the
        last to finish each step."""
        shared = [(completions, stats) if self.rank == self.world - 1 else None]
        dist.broadcast_object_list(shared, src=self.world - 1)
        return shared[0]

    def score(self, prompts, top_logprobs: int = 0, as_decode: bool = False,
              first_scored: list[int] | None = None) -> ScoreRun:
        raise FlexGenError("scoring is not pipelined: run it with the single-process engine (no --pipeline)")

    def close(self) -> None:
        super().close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
