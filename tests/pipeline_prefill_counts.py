"""One pipeline stage, run under torchrun by tests/test_pipeline.py: generates STEPS tokens
for each prompt while counting the token positions that reach this stage's transformer
blocks at the prefill, and the cache units whose decode attention reads a shared prefix's
one copy, and writes what it saw to OUT/rank-R.json.

    torchrun --nproc-per-node N pipeline_prefill_counts.py MODEL PROMPTS.json STEPS OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flexgen_helm.policy import Policy

# a block of 6 prompts, three GPU batches of two: three stages run it as three micro-batches
POLICY = Policy(gpu_batch_size=2, num_gpu_batches=3)


def main(model: str, prompts_path: str, steps: str, out: str) -> None:
    from flexgen_helm.dist.pipeline import PipelineEngine
    from flexgen_helm.executor import schedule
    from flexgen_helm.executor.sampling import SamplingParams
    from flexgen_helm.models import llama

    seen, prefix_units, prefill_calls = [], [], []
    finish_block, attend_past = llama.finish_block, schedule.attend_past_shared_prefix
    llama.finish_block = lambda cfg, w, h, a: seen.append(h.shape[0] * h.shape[1]) or finish_block(cfg, w, h, a)
    schedule.attend_past_shared_prefix = lambda *a, **kw: prefix_units.append(a[0].shape[0]) or attend_past(*a, **kw)
    engine = PipelineEngine.load(model, POLICY, dtype="float32", device="cpu", offload_dir=Path(out) / "offload",
                                 progress=False)

    def on_step(done: int, total: int) -> None:
        if done == 1:  # the prefill's step
            prefill_calls.append(len(seen))

    run = engine.generate(json.loads(Path(prompts_path).read_text()),
                          SamplingParams(max_new_tokens=int(steps), ignore_eos=True), on_step=on_step)
    engine.close()
    Path(out, f"rank-{engine.rank}.json").write_text(json.dumps({
        "blocks": sum(layer.kind == "block" for layer in engine.runtime.layers),
        "prefill_tokens": sum(seen[:prefill_calls[0]]),
        "decode_prefix_units": sum(prefix_units),
        "stats": run.stats.as_dict(),
        "tokens": [r.completions[0].token_ids for r in run.results],
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
