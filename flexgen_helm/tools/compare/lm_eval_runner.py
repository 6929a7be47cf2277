"""lm-evaluation-harness's side of `tools/compare/lm_eval_harness.py`, run as a script by the
interpreter lm-eval is installed in (its dependencies stay out of ours): loads its Hugging
Face backend on a local transformers folder, scores one task from a local task folder,
and writes its metrics with the model-load and scoring times apart. Of flexgen_helm it
takes only the torchvision guard (lm-eval's environment sees our packages: it is made with
--system-site-packages, see lm_eval_harness.py), as transformers breaks on the torchvision
that crfm-helm pulls in beside a CPU torch."""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a transformers folder")
    p.add_argument("--task-dir", required=True, help="folder of the local task YAML")
    p.add_argument("--task", required=True)
    p.add_argument("--limit", type=int)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--max-length", type=int, help="the model's window (rolling log-likelihood's too)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    # nothing is downloaded: the model and the data are local
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from flexgen_helm.torchvision_guard import hide_broken_torchvision

    hide_broken_torchvision()
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    lm = HFLM(pretrained=args.checkpoint, dtype=args.dtype, batch_size=args.batch_size, device="cpu",
              max_length=args.max_length)
    t1 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[args.task], limit=args.limit, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=args.task_dir), log_samples=False)
    t2 = time.perf_counter()
    metrics = {k: v for k, v in out["results"][args.task].items() if isinstance(v, (int, float))}
    record = {"lm_eval_version": getattr(lm_eval, "__version__", "unknown"), "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(), "batch_size": args.batch_size, "dtype": args.dtype,
              "limit": args.limit, "max_length": args.max_length, "load_s": t1 - t0, "eval_s": t2 - t1,
              "metrics": metrics}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
