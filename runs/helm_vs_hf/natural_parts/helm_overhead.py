"""Where a helm-run process's time goes outside our engine, from a py-spy profile of the
comparison's `ours` row (inclusive seconds of helm-run's main frames, and of Runner.run_one's
children):

    py-spy record -s -r 50 -f raw -o natural.raw -- python -m flexgen_helm.tools.compare.helm_clients \\
        --systems ours --scenarios synthetic_reasoning_natural-easy --max-instances 400 --out <dir>
    python runs/helm_vs_hf/natural_parts/helm_overhead.py natural.raw

py-spy samples at 50 Hz and slows the process it samples; read the seconds as shares.
"""

import collections
import re
import sys

RATE = 50  # samples a second (-r)
FRAMES = ("main (helm/benchmark/run.py)", "run_benchmarking (helm/benchmark/run.py)",
          "Runner.run_one (helm/benchmark/runner.py)",
          "BatchingExecutor.execute (flexgen_helm/helm/scenario_executor.py)",
          "Engine.generate (flexgen_helm/engine.py)")


def main() -> None:
    inclusive, children, helm_run = collections.Counter(), collections.Counter(), 0
    for line in open(sys.argv[1]):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
        if not any("helm-run" in f for f in frames[:2]):  # (a child of the comparison)
            continue
        helm_run += int(n)
        for f in set(frames) & set(FRAMES):
            inclusive[f] += int(n)
        for i, f in enumerate(frames[:-1]):
            if f == FRAMES[2]:
                children[frames[i + 1]] += int(n)
                break
    print(f"helm-run process: {helm_run / RATE:.1f} s")
    for f in FRAMES:
        print(f"  {inclusive[f] / RATE:6.1f} s  {f}")
    print("Runner.run_one's children:")
    for f, n in children.most_common(8):
        print(f"  {n / RATE:6.1f} s  {f[:110]}")


if __name__ == "__main__":
    main()
