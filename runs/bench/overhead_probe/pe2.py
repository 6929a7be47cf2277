"""The MoE per-expert probe's decode figure over N probes: `python pe2.py old|new N`.

"old" loads the probe from /tmp/old_op.py (git show 91defdb:flexgen_helm/planner/overhead_profile.py);
"new" is the installed one. repeats=2, as the test uses."""

import importlib.util
import sys

from flexgen_helm.memory.devices import pick_devices

if sys.argv[1] == "old":
    spec = importlib.util.spec_from_file_location("old_op", "/tmp/old_op.py")
    op = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op)
else:
    from flexgen_helm.planner import overhead_profile as op
op.FAMILIES = ("moe",)
devices = pick_devices("cpu", "float32")
vals = sorted(op.measure_fixed_costs(devices, repeats=2)["moe"]["decode"]["per_expert"] * 1e6
              for _ in range(int(sys.argv[2])))
spread = [round(v, 1) for v in (vals[0], vals[len(vals) // 2], vals[-1])]
print(sys.argv[1], "zeros", sum(v == 0 for v in vals), "min/med/max", spread)
