"""A HELM run's saved requests, and the client the scenario benches send them to: shared by
scenario_ab.py (in each checkout's own process) and packed_units/attention_timers.py.

flexgen_helm and HELM are imported inside the functions, so a process that puts a checkout on
its path first gets that checkout's engine."""

import json


def scenario_requests(state_path):
    """The requests of a HELM run's scenario_state.json, as they were sent, addressed to the
    deployment flexgen/smollm2-135m."""
    from helm.common.request import Request

    fields = Request.__dataclass_fields__
    return [Request(**{**{k: v for k, v in s["request"].items() if k in fields},
                       "model": "flexgen/smollm2-135m", "model_deployment": "flexgen/smollm2-135m"})
            for s in json.load(open(state_path))["request_states"]]


def float32_client():
    """Our client for flexgen/smollm2-135m in float32, its engine loaded (before any clock starts)."""
    from helm.common.cache import BlackHoleCacheConfig

    from flexgen_helm.helm.client import FlexGenClient

    client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment="flexgen/smollm2-135m",
                           dtype="float32")
    _ = client.handle
    return client
