"""Group HELM requests into engine batches.

FlexGen's throughput comes from large batches, but HELM sends one request at a time.
Two ways in, one batching core:
  * `BatchQueue` (plain `helm-run -n N`): the N request threads submit jobs; one worker
    thread per engine waits a few milliseconds for the others to arrive and runs what
    it has collected as batches.
  * `plan_batches` + `run_batches` with every request of a scenario (the BatchingExecutor,
    which plain `helm-run` uses too, see plugin.py): the batches then follow from the
    request list alone, not from thread timing.

A batch only mixes requests with the same generation parameters (the engine decodes a
whole batch for max_tokens steps, and one sampling setting per batch keeps results
independent of who shared the batch). Jobs are sorted by length and cut into the fewest
batches of at most the engine's block. The engine runs a batch as one block, whose GPU
batches it cuts where their padding would pass its tolerance, each padded to its own
longest prompt (executor/length_buckets.py): a layer's weights are loaded (and, compressed,
dequantized) once for all of a batch's lengths. A scoring batch may therefore mix any
lengths. A batch that generates is kept within `pad_tolerance` of padding as if padded to
its longest: its decode steps attend over (and its KV cache holds) the longest prompt's
positions for every sequence. A scenario planned whole also caps its batches' work at a
share of its requests' (`batch_cap`): a killed run loses the batch in progress, and a
smaller batch is less to compute again; not where all of them are predicted within five minutes
(UNCAPPED_BLOCK_S), and elsewhere a batch holds at least the requests whose share of the
prediction is five minutes.

A batch that fails (out of memory, a full offload disk, or one bad request) is split in
halves and retried, down to single requests; a single request that still fails gets its
own error, except on a full disk, which stops the run (no request could run).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from flexgen_helm.errors import DiskFullError
from flexgen_helm.executor.length_buckets import cut_by_length
from flexgen_helm.executor.sampling import GenerationResult, RunStats, SamplingParams, ScoreResult
from flexgen_helm.helm.accounting import BatchRecord
from flexgen_helm.helm.engines import EngineHandle

SCORE, GENERATE, SCORE_AND_GENERATE = "score", "generate", "score+generate"


@dataclass
class Job:
    """One HELM request as the engine sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    mode: str  # SCORE, GENERATE or SCORE_AND_GENERATE
    group: tuple  # jobs with equal `group` may share a batch
    future: Future = field(default_factory=Future)


@dataclass
class JobOutput:
    score: ScoreResult | None
    generation: GenerationResult | None
    batch: BatchRecord  # the whole batch, with what the engine reported for it (see accounting.py)
    batch_started: float  # time.time() when the batch's engine calls began


_batch_ids = itertools.count(1)
# Batch ids must stay unique across processes: HELM's cache replays old results.
_PROCESS_TAG = f"{os.getpid():x}-{int(time.time()):x}"


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    return "out of memory" in str(exc).lower()


# A batch's prompt tokens counted as if padded to its longest (what its KV cache holds).
# Batching pays for short prompts (the weights are used for many rows at once); long ones are
# compute-bound already, and there a batch only adds padding and larger intermediates: SmolLM2
# scoring prompts of 2500-4000 tokens on 2 CPU cores took 21.3 s batched by 4 and 16.2 s one
# by one (bfloat16, each batch padded to its longest, before GPU batches were cut by padding).
# Not for batches that only generate, under a block planned for their scenario's prompts
# (helm/block_planning.py: the planner bounds their memory): there a batch cut by tokens decodes
# apart, each its own steps and its own copy of a shared prefix (induction's 400 requests ran in 2
# batches, natural-easy's in 5: 13 and 38 decode steps where one batch takes 7 and 8;
# runs/bench/generate_token_cap).
MAX_BATCH_TOKENS = 8192
# A batch that generates: padding to its longest prompt may add at most this fraction to its
# real prompt tokens. Its decode steps attend over the longest prompt's positions for every
# sequence, so this bounds that waste, while a batch of several length buckets still loads
# the weights once per step where separate batches would load them once each.
PAD_TOLERANCE = 0.25
# A killed run loses the batch it was in (every finished batch is in HELM's cache): a planned
# batch holds at most the work of this share of its scenario's requests, so that a rerun
# recomputes little, but never less than the work of MIN_CAPPED_BATCH requests (smaller blocks
# make more decode steps, each bound by reading the weights; runs/padding measures what the cap
# costs). Every batch also pays a layer's fixed costs once (weight loads, a compressed layer's
# dequantization, a generating batch's decode steps), so a scenario of up to 16 requests runs
# as one batch and a killed run recomputes at most the work of 16: the README main job's engine time went
# 48-49 s -> 32-40 s (its 10-request scenarios had run as two batches each;
# runs/bench/compression/int4/dense_orientation_2026-11-25, main_job_one_batch and one_batch.py).
# Requests that share a prompt prefix (a few-shot run's examples) cost less each in a batch
# that computes the prefix once, so the same work at risk holds more of them (`batch_cap`).
MAX_BATCH_SHARE = 1 / 16
MIN_CAPPED_BATCH = 16
# ... but where the cost model predicts all of a scenario's requests (full blocks, each sequence
# to its most new tokens: an upper bound) within this many seconds, a killed run loses at most
# that much, and the batches are the blocks; where it predicts more, a batch holds at least the
# requests whose share of the prediction (pro rata: a batch smaller than a block is not
# predicted apart) is this many seconds, where the share's cap holds fewer. A batch decodes to
# its longest generation, so capped batches each decode their few long requests' tails apart.
# pattern_match, 100 requests (predicted 40 s): its engine time 34.7 s by median in 2 capped
# batches, 30.1 s in one (runs/helm_vs_hf/NOTES.md, 2026-11-26 night); 400 requests (predicted
# 142 s): 5 capped batches 141-152 s of wall time, one batch 122-124 s
# (runs/helm_vs_hf/batch_cap_400_2026-11-27). Five minutes at risk buys that for a scenario of a
# few hundred requests; a HELM suite runs for hours.
UNCAPPED_BLOCK_S = 300.0


def batch_cap(requests: int, max_batch: int, share: float = MAX_BATCH_SHARE, tokens_per_request: float = 0.0,
              shared_prefix: int = 0, sequences_per_request: float = 1.0) -> int:
    """The largest batch planned for a scenario of `requests` requests: the engine's block
    (`max_batch`), at most the work of `share` of the scenario's requests computed apart, but
    never less than the work of MIN_CAPPED_BATCH of them.

    Work is counted in tokens computed: a request computes, for each of its sequences (its
    completions), the prompt and the new tokens, `tokens_per_request` on average. Where every
    prompt starts with the same `shared_prefix` tokens, a batch computes them once and each
    sequence skips them, so that the same work holds more requests: the cap is the largest n
    with shared + n x (tokens - sequences x shared) at most the capped requests' work apart.
    (The engine computes the prefix once a block: a batch of more sequences than a block
    computes it once per block, a prefix more per extra block.)"""
    capped = max(MIN_CAPPED_BATCH, math.ceil(requests * share))
    own = tokens_per_request - sequences_per_request * shared_prefix
    if shared_prefix > 0 and own > 0:
        capped = max(capped, math.floor((capped * tokens_per_request - shared_prefix) / own))
    return min(max_batch, capped)


def mean_cost(jobs: list[Job]) -> tuple[float, float]:
    """(tokens, sequences) a job computes on average apart (batch_cap's work): each sequence
    its prompt and, generating, its new tokens; one sequence per completion generated, one to
    score (a score+generate job's scoring pass, a sequence more)."""
    def sequences(j: Job) -> int:
        return (j.params.num_completions if GENERATE in j.mode else 0) + (SCORE in j.mode)

    def tokens(j: Job) -> int:
        n = j.params.num_completions if GENERATE in j.mode else 0
        return n * (len(j.prompt_ids) + j.params.max_new_tokens) + (SCORE in j.mode) * len(j.prompt_ids)

    return sum(map(tokens, jobs)) / len(jobs), sum(map(sequences, jobs)) / len(jobs)


def buckets(jobs: list[Job], max_batch: int, pad_tolerance: float | None = PAD_TOLERANCE,
            max_tokens: int | None = MAX_BATCH_TOKENS, shared_prefix: int = 0) -> list[list[Job]]:
    """Split same-group jobs into the fewest batches of at most `max_batch` jobs, each a run of
    the jobs sorted by length (ties in list order) whose padding to its longest adds at most
    `pad_tolerance` x its real tokens (None: no bound) and whose tokens so padded stay within
    `max_tokens` (None: no bound; a longer prompt runs alone), the `shared_prefix` tokens every
    prompt starts with counted once; of those cuts, the one that pads least."""
    ordered = sorted(jobs, key=lambda j: len(j.prompt_ids))
    cuts = cut_by_length([len(j.prompt_ids) for j in ordered], max_batch, pad_tolerance, max_tokens, shared_prefix)
    return [ordered[start:end] for start, end in cuts]


def plan_batches(jobs: list[Job], max_batch: int, pad_tolerance: float = PAD_TOLERANCE, shared_prefix: int = 0,
                 share: float | None = None, at_risk_batch: int | None = None,
                 generate_max_tokens: int | None = MAX_BATCH_TOKENS) -> list[list[Job]]:
    """The batches `run_jobs` runs: by group (in order of first appearance), then length buckets.
    shared_prefix: the tokens every generating job's prompt starts with, which the engine
    computes once a batch (0: none, or the engine does not share prefixes); share: where
    given (a scenario planned whole), each group's batches hold at most the work of that share
    of all `jobs` (batch_cap), or `at_risk_batch` jobs where that is more (the jobs whose
    share of the scenario's predicted time is what a killed run may lose: UNCAPPED_BLOCK_S);
    generate_max_tokens: the most prompt tokens a batch that only generates holds, padded, a
    shared prefix once (None: no bound, where `max_batch` is a block planned for these prompts);
    a batch that scores (score+generate too: its first pass scores whole prompts) keeps
    MAX_BATCH_TOKENS.

    A function of the job list alone, so the same requests always meet the same batchmates
    (bf16 results follow the batch: its padding and matmul shapes) whatever the thread
    timing, and a resumed run can re-form the batches of the run it resumes."""
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.group, []).append(job)
    batches = []
    for group_jobs in groups.values():
        mode = group_jobs[0].mode
        # the engine shares a prefix in generation only: scoring (a score+generate batch's
        # first pass too) computes every prompt whole
        shared = shared_prefix if mode == GENERATE else 0
        size = max_batch
        if share is not None:
            tokens, sequences = mean_cost(group_jobs)
            size = max(batch_cap(len(jobs), max_batch, share, tokens, shared, sequences),
                       min(max_batch, at_risk_batch or 0))
        # scoring alone keeps no KV cache and takes no decode step: any lengths may share its block
        max_tokens = generate_max_tokens if mode == GENERATE else MAX_BATCH_TOKENS
        batches += buckets(group_jobs, size, None if mode == SCORE else pad_tolerance, max_tokens, shared_prefix=shared)
    return batches


def run_jobs(handle: EngineHandle, jobs: list[Job], max_batch: int, pad_tolerance: float = PAD_TOLERANCE,
             progress: str | None = None) -> None:
    """Run `jobs` in batches; every job's future gets a JobOutput or an exception.
    `progress`: a tqdm bar with this description (requests done, real tokens/s)."""
    run_batches(handle, plan_batches(jobs, max_batch, pad_tolerance), progress)


def run_batches(handle: EngineHandle, batches: list[list[Job]], progress: str | None = None,
                on_batch: Callable[[list[Job]], None] | None = None) -> None:
    """Run each batch (split on failure, see _run_splitting); `on_batch(batch)` is called once
    its futures are all set, before the next batch starts (the client makes them durable)."""
    bar = _Progress(sum(map(len, batches)), progress) if progress else None
    try:
        for batch in batches:
            try:
                _run_splitting(handle, batch)
            finally:  # a fatal error (a full disk) keeps the part of the batch that finished
                if on_batch:
                    on_batch([job for job in batch if job.future.done()])
            if bar:
                bar.done(batch)
    finally:
        if bar:
            bar.close()


class _Progress:
    """A run can take hours (the paper's HELM suite: 21 h): show requests done and the
    engine's real (unpadded) tokens/s so far, counted once per engine batch."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="req")
        self.batches: set[str] = set()
        self.tokens, self.seconds = 0, 0.0

    def done(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.future.exception() is not None:
                continue
            b = job.future.result().batch
            if b.id not in self.batches:
                self.batches.add(b.id)
                self.tokens += b.prompt_tokens + b.generated_tokens
                self.seconds += b.time_s
        self.bar.update(len(jobs))
        if self.seconds:
            self.bar.set_postfix_str(f"{self.tokens / self.seconds:.1f} tok/s")

    def close(self) -> None:
        self.bar.close()


def _run_splitting(handle: EngineHandle, batch: list[Job]) -> None:
    try:
        outputs = _run_batch(handle, batch)
    except Exception as exc:
        if len(batch) > 1:
            # Out of memory: half the batch may fit. Any other error: isolate the culprit.
            mid = len(batch) // 2
            _run_splitting(handle, batch[:mid])
            _run_splitting(handle, batch[mid:])
            return
        if isinstance(exc, DiskFullError):
            raise  # no request can run until space is freed: the run stops, with this error
        reason = "out of memory even for a batch of one" if is_out_of_memory(exc) else "engine error"
        error = RuntimeError(f"{reason}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc  # what `raise error from exc` records: the request's error keeps its cause
        batch[0].future.set_exception(error)
        return
    for job, out in zip(batch, outputs):
        job.future.set_result(out)


def _run_batch(handle: EngineHandle, batch: list[Job]) -> list[JobOutput]:
    prompts = [j.prompt_ids for j in batch]
    mode = batch[0].mode
    scores: list[ScoreResult | None] = [None] * len(batch)
    gens: list[GenerationResult | None] = [None] * len(batch)
    runs: list[RunStats] = []
    with handle.lock:
        started = time.time()
        t0 = time.perf_counter()
        if SCORE in mode:
            scored = handle.engine.score(prompts)
            scores, runs = list(scored.results), runs + [scored.stats]
        if GENERATE in mode:
            generated = handle.engine.generate(prompts, [j.params for j in batch])
            gens, runs = list(generated.results), runs + [generated.stats]
        elapsed = time.perf_counter() - t0
    record = BatchRecord.of_runs(f"{_PROCESS_TAG}-{next(_batch_ids)}", mode, len(batch), elapsed, runs)
    return [JobOutput(score=s, generation=g, batch=record, batch_started=started) for s, g in zip(scores, gens)]


class BatchQueue:
    """Merges the requests that HELM's threads make at the same time into batches.

    The worker starts collecting at the first request, keeps collecting while new ones
    arrive less than `linger_s` apart (HELM's threads resubmit right after a batch
    returns), and never waits more than `max_wait_s` or past `max_batch` x groups.
    """

    def __init__(self, handle: EngineHandle, max_batch: int, linger_s: float = 0.02, max_wait_s: float = 0.5,
                 pad_tolerance: float = PAD_TOLERANCE):
        self.handle = handle
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.max_wait_s = max_wait_s
        self.pad_tolerance = pad_tolerance
        self._pending: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="flexgen-batcher", daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch queue is closed")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _collect(self) -> list[Job]:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return []
            start = time.monotonic()
            while True:
                seen = len(self._pending)
                if seen >= self.max_batch * 4:
                    break
                remaining = self.max_wait_s - (time.monotonic() - start)
                if remaining <= 0:
                    break
                self._cond.wait(timeout=min(self.linger_s, remaining))
                if len(self._pending) == seen:  # nobody arrived within linger_s
                    break
            jobs, self._pending = self._pending, []
            return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._collect()
            if not jobs:
                return
            try:
                run_jobs(self.handle, jobs, self.max_batch, self.pad_tolerance)
            except BaseException as exc:  # noqa: BLE001 - never leave a request thread waiting
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)


_QUEUES_LOCK = threading.Lock()


def get_batcher(handle: EngineHandle, max_batch: int, **kwargs) -> BatchQueue:
    """The engine's one request queue (created on first use)."""
    with _QUEUES_LOCK:
        if handle.batcher is None:
            handle.batcher = BatchQueue(handle, max_batch, **kwargs)
        return handle.batcher
