"""Pipeline parallelism (FlexGen Section 4.4): the layers are split into stages, one
process each (launched by torchrun), every stage running the single-device offloading
runtime with its own policy on its own device.

A block's GPU batches are split into as many groups as there are stages, and groups
travel through the stages like micro-batches: while stage s runs group g, stage s+1 runs
group g-1. The last stage samples and sends the new tokens back to the first. Sends are
asynchronous, so that a stage sending forward and a stage sending back never wait on
each other.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flexgen_helm.dist.partition import balanced_bounds, layer_costs
from flexgen_helm.engine import Engine, build_runtime
from flexgen_helm.memory.offload_dir import default_offload_dir
from flexgen_helm.errors import FlexGenError
from flexgen_helm.executor.generation import BlockRunner, RunStats, plan_blocks
from flexgen_helm.executor.schedule import BlockSchedule
from flexgen_helm.memory.devices import pick_devices
from flexgen_helm.models import family_of
from flexgen_helm.weights.registry import resolve
from flexgen_helm.policy.policy import Policy


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group torchrun describes (NCCL between GPUs, gloo on CPUs)."""
    if "RANK" not in os.environ:
        raise FlexGenError("--pipeline needs to be launched by torchrun (e.g. torchrun --nproc-per-node 2 ...)")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if not torch.cuda.is_available():
        # stages on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return dist.get_rank(), dist.get_world_size()


class PipelineEngine(Engine):
    """An Engine whose runtime holds one stage's layers. Every rank calls generate() with
    the same prompts and gets the same results."""

    @classmethod
    def load(cls, model: str, policy: Policy | None = None, path: str | None = None, dummy: bool = False,
             offload_dir=None, device: str | None = None, dtype: str | None = None, progress: bool = True,
             timeout_s: float = 300.0) -> "PipelineEngine":
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
        offload = Path(offload_dir or default_offload_dir()) / f"stage-{rank}"
        runtime = build_runtime(resolved, policy, devices, offload, progress and rank == 0,
                                layers=layers[bounds[rank]:bounds[rank + 1]])
        engine = cls(resolved, runtime, policy, offload)
        engine.rank, engine.world, engine.bounds = rank, world, bounds
        return engine

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world - 1

    def describe_stage(self) -> str:
        names = [layer.name for layer in self.runtime.layers]
        return f"stage {self.rank}/{self.world}: {names[0]} .. {names[-1]} ({len(names)} layers)"

    def _run_blocks(self, seqs, stats: RunStats, workdir: Path) -> None:
        runner = BlockRunner(self.runtime, self.policy, self.decode, workdir, stats)
        for block in plan_blocks([len(s.prompt) for s in seqs], self.policy):
            self._run_block(runner, [[seqs[i] for i in group] for group in block], stats)
        # Every rank returns what the last stage sampled, and its timings, which are the
        # pipeline's: it is the last to finish each step.
        outputs = [{k: v for k, v in s.__dict__.items() if k != "generator"} for s in seqs]
        shared = [(outputs, stats.__dict__) if self.is_last else None]
        dist.broadcast_object_list(shared, src=self.world - 1)
        outputs, last_stats = shared[0]
        for mine, theirs in zip(seqs, outputs):
            mine.__dict__.update(theirs)
        stats.__dict__.update(last_stats)

    def _run_block(self, runner: BlockRunner, block, stats: RunStats) -> None:
        steps = max(s.params.max_new_tokens for g in block for s in g)
        if steps == 0:
            for s in (s for g in block for s in g):
                s.finish_reason = "length"
            return
        n_groups = min(self.world, len(block))
        groups = [block[i::n_groups] for i in range(n_groups)]
        longest = max(len(s.prompt) for g in block for s in g)
        scheds = [runner.schedule([[s.prompt for s in batch] for batch in group], longest + steps, name=f"group-{i}")
                  for i, group in enumerate(groups)]
        pending: list = []
        try:
            t0 = time.perf_counter()
            for step in range(steps):
                for g, (group, sched) in enumerate(zip(groups, scheds)):
                    out = self._stage_step(sched, group, step, runner)
                    if self.is_last:
                        tokens = [runner.choose(batch, lp) for batch, lp in zip(group, out)]
                        stats.padded_generated_tokens += sum(len(b) for b in group)
                        if step + 1 < steps and self.world > 1:
                            pending += [self._send(t, 0) for t in tokens]
                        sched.next_tokens = tokens
                    else:
                        pending += [self._send(h, self.rank + 1) for h in out]
                if step == 0:
                    stats.prefill_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
            stats.decode_s += time.perf_counter() - t0
        finally:
            for p in pending:
                p.wait()
            for sched in scheds:
                stats.add_timers(sched.timers)
                sched.close()
        for s in (s for g in block for s in g):
            if not s.done:
                s.finish_reason = "length"

    def _stage_step(self, sched: BlockSchedule, group, step: int, runner: BlockRunner) -> list:
        """One token step of one group through this stage's layers."""
        head = runner.last_position_head if self.is_last else None
        if self.is_first and step == 0:
            return sched.prefill(head)
        if self.is_first:
            tokens = sched.next_tokens if self.world == 1 else [self._recv((len(b),), torch.long, self.world - 1) for b in group]
            return sched.decode(tokens, head)
        length = sched.batches[0].ids.shape[1] if step == 0 else 1
        dtype, hidden = self.runtime.devices.dtype, self.config.hidden_size
        xs = [self._recv((len(b), length, hidden), dtype, self.rank - 1) for b in group]
        return sched.prefill(head, hidden=xs) if step == 0 else sched.decode(xs, head)

    def _send(self, t: torch.Tensor, dst: int):
        # NCCL moves GPU tensors only; gloo, CPU ones
        device = self.runtime.devices.compute if self.runtime.devices.is_cuda else "cpu"
        return dist.isend(t.to(device).contiguous(), dst=dst)

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        device = self.runtime.devices.compute if self.runtime.devices.is_cuda else "cpu"
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        return t

    def close(self) -> None:
        super().close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
