"""HELM client: a HELM `Request` in, a `RequestResult` out, through the shared engine.

One client object per deployment (HELM may build several; they all share the engine
and its request queue through `engines.get_engine`). The work per request:
  1. a result computed ahead for the whole scenario by `prefetch` (the BatchingExecutor,
     which plain helm-run uses too, see plugin.py; it is in HELM's cache already);
  2. else HELM's cache (key: prompt, generation parameters, and what can change the
     numbers: checkpoint and compression, not placement) -- a finished run re-runs for
     free; else a trip through the engine's `BatchQueue`, which merges it with the
     requests of the other HELM threads (the path of clients called one by one, e.g. by
     a HELM proxy server);
  3. conversion to HELM tokens (`tokens.helm_texts`) with per-token logprobs, the text cut
     at the request's stop sequences (`flexgen_helm.text.StopStrings`, which also ends the
     engine's generation there), and the batch's accounting (`accounting.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from typing import Any, Callable, Dict, List, Optional

from helm.clients.client import CachingClient
from helm.common.cache import CacheConfig, cache_stats, create_key_value_store
from helm.common.hierarchical_logger import hlog
from helm.common.request import (
    EMBEDDING_UNAVAILABLE_REQUEST_RESULT,
    ErrorFlags,
    GeneratedOutput,
    Request,
    RequestResult,
    Token,
    wrap_request_time,
)

from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.helm import accounting
from flexgen_helm.helm.batching import (
    GENERATE,
    MAX_BATCH_SHARE,
    MAX_BATCH_TOKENS,
    PAD_TOLERANCE,
    SCORE,
    SCORE_AND_GENERATE,
    UNCAPPED_BLOCK_S,
    Job,
    JobOutput,
    get_batcher,
    run_batches,
)
from flexgen_helm.helm.block_planning import plan_block, scenario_workload
from flexgen_helm.helm.engines import EngineHandle, LoadArgs, get_engine, resolve_load_args
from flexgen_helm.helm.scenario_plan import BatchingChoice, PlannedRequest, ScenarioPlan, plan_scenario
from flexgen_helm.helm.tokens import helm_texts
from flexgen_helm.memory.disk_space import disk_full, is_disk_full
from flexgen_helm.text import StopStrings, TokenText, token_text_for

DEFAULT_MAX_BATCH = 16
# engine finish reasons -> HELM's (basic_metrics counts "length", "stop", "endoftext"); the
# engine's "stop_condition" is a stop sequence, which to_response finds itself
_FINISH = {"length": "length", "stop": "endoftext"}
# The form of the responses kept in HELM's cache (part of the cache key): responses of an
# older form are computed again instead of being read as this one.
RESPONSE_FORMAT = 3  # 3: finish_reason["flexgen"] names the precision


class RequestFailed(Exception):
    """A request that cannot succeed (reported as a non-retriable, non-fatal error)."""


class FlexGenClient(CachingClient):
    def __init__(
        self,
        cache_config: CacheConfig,
        model: str,
        model_name: Optional[str] = None,
        path: Optional[str] = None,
        dummy: bool = False,
        policy: Any = None,
        offload_dir: Optional[str] = None,
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        max_batch_size: Optional[int] = None,
        batch_linger_s: float = 0.02,
        batch_max_wait_s: float = 0.5,
        pad_tolerance: float = PAD_TOLERANCE,
        max_batch_share: float = MAX_BATCH_SHARE,
        uncapped_block_s: float = UNCAPPED_BLOCK_S,
        deployment: Optional[str] = None,
    ):
        super().__init__(cache_config=cache_config)
        self.deployment = deployment or model_name or model
        self.load_args: LoadArgs = resolve_load_args(
            model, deployment=self.deployment, path=path, dummy=dummy, policy=policy,
            offload_dir=offload_dir, device=device, dtype=dtype,
        )
        self.max_batch_size = max_batch_size
        self.queue_kwargs = {"linger_s": batch_linger_s, "max_wait_s": batch_max_wait_s,
                             "pad_tolerance": pad_tolerance}
        self.pad_tolerance = pad_tolerance
        self.max_batch_share = max_batch_share  # a planned batch's most work, as a share of its scenario's
        # ... but at least the requests whose share of the scenario's predicted time is within this
        # (seconds), pro rata; all of them, uncapped, where the whole scenario is predicted within it
        self.uncapped_block_s = uncapped_block_s
        # Responses computed ahead by `prefetch` (the BatchingExecutor), by cache key (consumed once).
        self._prefetched: Dict[str, Dict[str, Any]] = {}
        self._prefetched_lock = threading.Lock()

    # ----- engine access -------------------------------------------------------------

    @property
    def handle(self) -> EngineHandle:
        return get_engine(self.load_args)

    def max_batch(self, policy: Any) -> int:
        """The most requests a batch holds: the deployment's max_batch_size, else the block of
        the `policy` the batches run under (a scenario's, helm/block_planning.py, or the
        engine's loaded one; None for a stand-in engine without one)."""
        if self.max_batch_size:
            return int(self.max_batch_size)
        block = getattr(policy, "block_size", None)
        return int(block) if block and block > 1 else DEFAULT_MAX_BATCH

    # ----- request -> job ----------------------------------------------------------

    def raw_request(self, request: Request) -> Dict[str, Any]:
        raw = {
            "deployment": self.deployment,
            "checkpoint": self.load_args.numerics_key(),
            "prompt": request.prompt,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_tokens": request.max_tokens,
            "num_completions": request.num_completions,
            "stop_sequences": list(request.stop_sequences),
            "echo_prompt": request.echo_prompt,
            "response_format": RESPONSE_FORMAT,
        }
        return dict(CachingClient.make_cache_key(raw, request))

    def make_job(self, request: Request, raw: Dict[str, Any], handle: EngineHandle) -> tuple[Job, int]:
        """The engine job for a request, and how many tokens we prepended (a BOS)."""
        if request.messages or request.multimodal_prompt:
            raise RequestFailed("flexgen models take a plain text prompt (no chat messages, no multimodal)")
        if request.max_tokens < 0 or request.num_completions < 1:
            raise RequestFailed(f"invalid request: max_tokens={request.max_tokens}, "
                                f"num_completions={request.num_completions}")
        # HELM's semantics for the rest: an empty stop sequence stops nothing (StopStrings skips
        # it); num_completions > 1 at temperature 0 gives that many (identical) greedy
        # completions; top_k_per_token changes nothing, as HELM's Token carries no
        # alternatives (any value, even beyond the vocabulary, is accepted).
        if not request.echo_prompt and request.max_tokens == 0:
            raise RequestFailed("max_tokens=0 without echo_prompt asks for nothing")
        tt = token_text_for(handle.tokenizer)
        ids = tt.encode(request.prompt)
        n_prefix = 0
        bos = handle.tokenizer.bos_token_id
        if tt.starts_with_bos() and (not ids or ids[0] != bos):
            # The model was trained with a BOS in front (OPT's </s>); give it one, and drop it
            # from what we return so the tokens stay those of the HELM tokenizer.
            ids, n_prefix = [bos] + ids, 1
        if not ids:
            raise RequestFailed("the prompt is empty: the model needs at least one token to condition on")
        limit = handle.max_seq_len
        need = len(ids) + request.max_tokens
        if need > limit and n_prefix:
            ids, n_prefix = ids[1:], 0
            need -= 1
        if need > limit:
            raise RequestFailed(
                f"prompt of {len(ids)} tokens + max_tokens {request.max_tokens} = {need} exceeds "
                f"the model's context of {limit} tokens"
            )
        sampling = SamplingParams(
            max_new_tokens=request.max_tokens,
            temperature=float(request.temperature),
            top_p=float(request.top_p) if request.top_p else 1.0,
            stop=StopStrings(tt, tuple(request.stop_sequences)) if request.stop_sequences else None,
            num_completions=request.num_completions,
            seed=_seed(raw) if request.temperature > 0 else None,
        )
        if request.echo_prompt:
            mode = SCORE if request.max_tokens == 0 else SCORE_AND_GENERATE
        else:
            mode = GENERATE
        group = (mode, sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                 sampling.num_completions, tuple(request.stop_sequences))
        return Job(prompt_ids=ids, params=sampling, mode=mode, group=group), n_prefix

    # ----- job output -> cached response ---------------------------------------------

    def to_response(self, request: Request, job: Job, n_prefix: int, out: JobOutput, tt: TokenText
                    ) -> Dict[str, Any]:
        """A JSON-able response (what HELM's cache stores)."""
        prompt_tokens: List[List[Any]] = []
        if out.score is not None:
            ids = job.prompt_ids[n_prefix:]
            lps = out.score.logprobs[n_prefix:]
            texts = helm_texts(tt, ids)
            # No context for the first token (unless we prepended a BOS): 0.0, as HELM's
            # HuggingFaceClient does; the LM adapter treats that token as conditioning.
            prompt_tokens = [[t, _finite(lp)] for t, lp in zip(texts, lps)]
        completions = []
        generated_total = 0
        stop = StopStrings(tt, tuple(request.stop_sequences))
        n = request.num_completions
        gen_completions = out.generation.completions if out.generation is not None else [None] * n
        for comp in gen_completions[:n]:
            tokens = list(prompt_tokens)
            text = request.prompt if request.echo_prompt else ""
            reason = "length"
            if comp is not None:
                cut = stop.cut(comp.token_ids)
                reason = "stop" if cut.stopped else _FINISH[comp.finish_reason]
                ids, lps = cut.token_ids, comp.logprobs[: len(cut.token_ids)]
                generated_total += len(ids)
                tokens += [[t, float(lp)] for t, lp in zip(helm_texts(tt, ids), lps)]
                text += cut.text
            completions.append({"text": text, "tokens": tokens, "finish_reason": reason})
        record = accounting.RequestRecord(len(job.prompt_ids), generated_total, out.batch,
                                            engine=self.handle.loading)
        # RequestResult's own fields where HELM has them, the rest in finish_reason (to_result)
        return {
            "completions": completions,
            "flexgen": accounting.to_finish_reason(record, self.handle.engine.precision),
            "batch_size": out.batch.size,
            "batch_request_time": out.batch.time_s,
        }

    # ----- HELM entry points ---------------------------------------------------------

    def make_request(self, request: Request) -> RequestResult:
        if request.embedding:
            return EMBEDDING_UNAVAILABLE_REQUEST_RESULT
        raw = self.raw_request(request)
        key = _key_str(raw)
        with self._prefetched_lock:
            ready = self._prefetched.pop(key, None)
        if ready is not None:
            # computed by `prefetch` in this run (and already in HELM's cache): counted as
            # HELM's Cache.get counts a computed request, reported as not cached
            cache_stats.increment_query(self.cache.config.cache_stats_key)
            cache_stats.increment_compute(self.cache.config.cache_stats_key)
            if "error" in ready:
                return failed_result(ready["error"])
            return self.to_result(ready, cached=False)

        def compute() -> Dict[str, Any]:
            handle = self.handle
            job, n_prefix = self.make_job(request, raw, handle)
            queue = get_batcher(handle, self.max_batch(getattr(handle.engine, "policy", None)), **self.queue_kwargs)
            try:
                out = queue.submit(job).result()
            except Exception as exc:  # engine errors become request errors
                raise RequestFailed(str(exc)) from exc
            return self.to_response(request, job, n_prefix, out, token_text_for(handle.tokenizer))

        try:
            response, cached = self.cache.get(raw, wrap_request_time(compute))
        except RequestFailed as exc:
            return failed_result(str(exc))
        return self.to_result(response, cached)

    def prefetch(self, requests: List[Request]) -> int:
        """Compute every uncached request of a scenario at once, in batches (the BatchingExecutor's path).

        The batches are those of an uninterrupted run whatever was cached (scenario_plan.py),
        so a resumed run gives the same results. Each batch's responses reach HELM's cache as
        soon as the batch ends (a killed run loses at most the batch in progress), and wait in
        memory until `make_request` asks for them, so HELM's own executor stays in charge.
        Returns the number of requests computed.
        """
        unique = self.unique_requests(requests)
        with create_key_value_store(self.cache.config) as store:
            cached = {key for key, (_, raw) in unique.items() if store.contains(raw)}
            if len(cached) == len(unique):
                return 0  # everything cached: no need to load the engine
            plan = self.plan(unique, cached)
            self.log_plan(plan)
            with self.handle.running_under(plan.policy):
                run_batches(self.handle, plan.batches, progress=f"flexgen {self.deployment}",
                            on_batch=lambda batch: self.publish(store, plan, self.new_responses(plan, batch)))
        return plan.requests_to_run

    def unique_requests(self, requests: List[Request]) -> Dict[str, tuple[Request, Dict[str, Any]]]:
        """{cache key: (request, raw cache key)} of the requests not yet computed ahead, once each."""
        unique: Dict[str, tuple[Request, Dict[str, Any]]] = {}
        for request in requests:
            if request.embedding:
                continue
            raw = self.raw_request(request)
            key = _key_str(raw)
            if key not in unique and key not in self._prefetched:
                unique[key] = (request, raw)
        return unique

    def plan(self, unique: Dict[str, tuple[Request, Dict[str, Any]]], cached: set[str],
             decide: Optional[Callable[[Callable[[], BatchingChoice]], BatchingChoice]] = None) -> ScenarioPlan:
        """The planned batches of `unique` (see unique_requests), `cached` being the keys in
        HELM's cache, in the block planned for them all (helm/block_planning.py: once per
        scenario, cached requests included, so that a resumed run forms the same batches); a
        request that cannot run gets its error now (held for make_request). decide: given the
        function that makes this process's choice, the choice to use: on data-parallel ranks,
        whose saved profiles or loaded blocks may differ, rank 0's (helm/data_parallel.py)."""
        handle = self.handle
        planned: Dict[str, PlannedRequest] = {}
        for key, (request, raw) in unique.items():
            try:
                job, n_prefix = self.make_job(request, raw, handle)
            except RequestFailed as exc:
                if key not in cached:
                    self.keep(key, {"error": str(exc)})
                continue
            planned[key] = PlannedRequest(request, raw, job, n_prefix)
        jobs = [p.job for p in planned.values()]
        choice = decide(lambda: self._batching_choice(jobs)) if decide else self._batching_choice(jobs)
        return plan_scenario(planned, cached, choice.max_batch, self.pad_tolerance, choice.max_batch_share,
                             choice.policy, choice.shared_prefix, choice.at_risk_batch, choice.generate_max_tokens)

    def _batching_choice(self, jobs: list) -> BatchingChoice:
        """The block the jobs run in, and what cuts their batches (plan_scenario)."""
        handle = self.handle
        block = plan_block(handle, jobs)
        policy = block.policy if block else None
        runs_in = policy or getattr(handle.engine, "policy", None)  # the scenario's block, else the loaded one
        shared = scenario_workload(jobs).shared_prefix if jobs and getattr(runs_in, "prefix_sharing", False) else 0
        share, at_risk, max_batch = self.max_batch_share, None, self.max_batch(runs_in)
        predicted = block.predicted_s if block is not None else math.inf
        # no floor where nothing caps, nothing is predicted, or uncapped_block_s is 0 (the share alone)
        floored = share is not None and math.isfinite(predicted) and self.uncapped_block_s > 0
        if floored and predicted <= self.uncapped_block_s:  # predicted_s is an upper bound for all of them
            hlog(f"flexgen: these requests are predicted to take {predicted:.1f} s in all, within the "
                 f"{self.uncapped_block_s:g} s a killed run may lose: their batches are the blocks, not capped by "
                 f"work at risk (max_batch_share)")
            share = None
        elif floored:
            # their share of the prediction, pro rata: a batch smaller than a block is not predicted apart
            at_risk = min(max_batch, math.floor(len(jobs) * self.uncapped_block_s / predicted))
            hlog(f"flexgen: these requests are predicted to take {predicted:.1f} s in all, more than the "
                 f"{self.uncapped_block_s:g} s a killed run may lose: a batch holds up to {at_risk} of them, their "
                 f"share of that time pro rata (or the work max_batch_share allows, if more)")
        # a block planned for these prompts bounds a generating batch's memory, not a count of tokens
        max_tokens = None if block is not None else MAX_BATCH_TOKENS
        return BatchingChoice(max_batch, share, policy, shared, at_risk, max_tokens)

    def log_plan(self, plan: ScenarioPlan) -> None:
        largest = max(map(len, plan.batches), default=0)
        hlog(f"flexgen: running {plan.requests_to_run} requests in {len(plan.batches)} batches of up to {largest} "
             f"({len(plan.cached)} of {len(plan.planned)} cached)")

    def new_responses(self, plan: ScenarioPlan, batch: List[Job]) -> Dict[str, Dict[str, Any]]:
        """{cache key: response (or {"error": ...})} of a finished batch's uncached requests."""
        tt = token_text_for(self.handle.tokenizer)
        return {key: self.response_of(p.request, p.job, p.n_prefix, tt) for key, p in plan.new_results(batch)}

    def publish(self, store, plan: ScenarioPlan, responses: Dict[str, Dict[str, Any]]) -> None:
        """Make responses durable in HELM's cache (`store`), then hold them for make_request."""
        # HELM caches no failures: they are retried
        self.store_durably(store, [(plan.planned[key].raw, r) for key, r in responses.items() if "error" not in r])
        for key, response in responses.items():
            self.keep(key, response)

    def store_durably(self, store, pairs: List[tuple[Dict[str, Any], Dict[str, Any]]]) -> None:
        """Put (raw request, response) pairs in HELM's cache; a full disk is a DiskFullError."""
        try:
            store.multi_put(pairs)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            where = getattr(self.cache.config, "path", self.cache.config.cache_stats_key)
            raise disk_full(where, len(json.dumps([r for _, r in pairs])), "HELM's request cache",
                            "free space and run the same command again: the batches already cached are "
                            "not computed again") from exc

    def cached_responses(self, keys: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """{cache key: response} of those of `keys` ({cache key: raw cache key}) in HELM's cache."""
        with create_key_value_store(self.cache.config) as store:
            hits = {key: store.get(raw) for key, raw in keys.items()}
        return {key: hit for key, hit in hits.items() if hit is not None}

    def response_of(self, request: Request, job: Job, n_prefix: int, tt: TokenText) -> Dict[str, Any]:
        """The response of a job run in a batch (its future set), or {"error": ...}."""
        exc = job.future.exception()
        if exc is not None:
            return {"error": str(exc)}
        result = job.future.result()
        response = self.to_response(request, job, n_prefix, result, tt)
        # computed in its batch, not when make_request picks it up
        response["request_time"] = result.batch.time_s
        response["request_datetime"] = int(result.batch_started)
        return response

    def keep(self, key: str, response: Dict[str, Any]) -> None:
        """Hold a response computed ahead until `make_request` asks for it."""
        with self._prefetched_lock:
            self._prefetched[key] = response

    @staticmethod
    def to_result(response: Dict[str, Any], cached: bool) -> RequestResult:
        completions = []
        for i, c in enumerate(response["completions"]):
            tokens = [Token(text=t, logprob=lp) for t, lp in c["tokens"]]
            finish: Dict[str, Any] = {"reason": c["finish_reason"]}
            if i == 0:
                finish["flexgen"] = response["flexgen"]
            completions.append(GeneratedOutput(text=c["text"], logprob=sum(t.logprob for t in tokens),
                                               tokens=tokens, finish_reason=finish))
        return RequestResult(
            success=True,
            cached=cached,
            request_time=response.get("request_time"),
            request_datetime=response.get("request_datetime"),
            completions=completions,
            embedding=[],
            batch_size=response["batch_size"],
            batch_request_time=response["batch_request_time"],
        )


def failed_result(error: str) -> RequestResult:
    # Not retriable (the same request fails the same way), not fatal (the run goes on;
    # HELM records an empty completion for it).
    return RequestResult(success=False, cached=False, error=f"flexgen: {error}", completions=[], embedding=[],
                         error_flags=ErrorFlags(is_retriable=False, is_fatal=False))


def _key_str(raw: Dict[str, Any]) -> str:
    return json.dumps(raw, sort_keys=True)


def _seed(raw: Dict[str, Any]) -> int:
    """A sampling seed fixed by the request, so a result does not depend on its batch (nor
    on the form its response is cached in)."""
    request = {k: v for k, v in raw.items() if k != "response_format"}
    return int.from_bytes(hashlib.sha256(_key_str(request).encode()).digest()[:4], "little") & 0x7FFFFFFF


def _finite(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else 0.0
