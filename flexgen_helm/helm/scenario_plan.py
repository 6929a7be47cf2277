"""The planned batches of a scenario's requests, run ahead of HELM's executor.

Planned over the whole request list, cached requests included (`batching.plan_batches`, the
batch size capped by `batching.batch_cap` of the list's length and work, a shared prompt
prefix counted once per batch where the engine shares it; uncapped where the cost model
predicts all of the requests within `batching.UNCAPPED_BLOCK_S`, and elsewhere at least the
requests whose share of its prediction is that time): the batches of an
uninterrupted run whatever was cached, so that a resumed run gives the same results and
`-n` changes nothing. Only the batches that hold an uncached request run; a cached request
in one of them runs again to keep its batch as it was, and its new result is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexgen_helm.helm.batching import MAX_BATCH_TOKENS, Job, plan_batches


@dataclass
class PlannedRequest:
    request: Any  # the HELM Request
    raw: dict[str, Any]  # its key in HELM's cache
    job: Job
    n_prefix: int  # tokens put in front of the prompt (a BOS), not returned


@dataclass(frozen=True)
class BatchingChoice:
    """What a scenario's batches are cut by, besides its requests (plan_scenario's arguments):
    chosen once per scenario, and by rank 0 for every data-parallel rank (helm/data_parallel.py)."""

    max_batch: int  # the most requests a batch holds
    max_batch_share: float | None  # a batch's most work as a share of the scenario's (None: no cap)
    policy: Any = None  # the engine policy the batches run under; None: the loaded one
    shared_prefix: int = 0  # the tokens every generating prompt starts with, computed once a batch
    # the requests whose share of the scenario's predicted time, pro rata, is what a killed run
    # may lose (client arg uncapped_block_s): a capped batch may hold that many (None: the share
    # alone caps)
    at_risk_batch: int | None = None
    # the most prompt tokens a batch that only generates holds (batching.plan_batches): None
    # where the block was planned for these requests' prompts, which bounds their memory
    generate_max_tokens: int | None = MAX_BATCH_TOKENS


@dataclass
class ScenarioPlan:
    planned: dict[str, PlannedRequest]  # by cache key (as a string), in the scenario's order
    cached: set[str]  # the keys already in HELM's cache
    batches: list[list[Job]]  # the batches to run, in order
    key_of_job: dict[int, str]  # id(job) -> its cache key
    policy: Any = None  # the engine policy the batches were planned for (helm/block_planning.py); None: loaded

    @property
    def requests_to_run(self) -> int:
        return sum(map(len, self.batches))

    def new_results(self, batch: list[Job]) -> list[tuple[str, PlannedRequest]]:
        """The batch's requests that were not cached and whose job has finished (a batch cut
        short by a full disk has some that have not)."""
        keys = (self.key_of_job[id(job)] for job in batch if job.future.done())
        return [(key, self.planned[key]) for key in keys if key not in self.cached]


def plan_scenario(planned: dict[str, PlannedRequest], cached: set[str], max_batch: int, pad_tolerance: float,
                  max_batch_share: float | None, policy: Any = None, shared_prefix: int = 0,
                  at_risk_batch: int | None = None, generate_max_tokens: int | None = MAX_BATCH_TOKENS) -> ScenarioPlan:
    """The batches of `planned` (every request of the scenario that can run) that hold an
    uncached request; `max_batch`: the block of `policy`, the engine's for these requests;
    `max_batch_share`: a batch's most work as a share of the scenario's (None: no cap);
    `shared_prefix`: the tokens every generating prompt starts with where that engine computes
    them once a batch (helm/block_planning.scenario_workload), else 0; `at_risk_batch`: the
    requests a capped batch may hold all the same, and `generate_max_tokens` the prompt tokens a
    batch that only generates may hold (BatchingChoice)."""
    key_of_job = {id(p.job): key for key, p in planned.items()}
    jobs = [p.job for p in planned.values()]
    batches = plan_batches(jobs, max_batch, pad_tolerance, shared_prefix, max_batch_share, at_risk_batch,
                           generate_max_tokens)
    to_run = [b for b in batches if any(key_of_job[id(j)] not in cached for j in b)]
    return ScenarioPlan(planned, cached, to_run, key_of_job, policy)
