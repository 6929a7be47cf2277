import sys, importlib.util
from flexgen_helm.memory.devices import pick_devices
if sys.argv[1]=="old":
    spec=importlib.util.spec_from_file_location("old_op","/tmp/old_op.py"); op=importlib.util.module_from_spec(spec); spec.loader.exec_module(op)
else:
    from flexgen_helm.planner import overhead_profile as op
op.FAMILIES=("moe",)
d=pick_devices("cpu","float32")
vals=[op.measure_fixed_costs(d, repeats=2)["moe"]["decode"]["per_expert"]*1e6 for _ in range(int(sys.argv[2]))]
vals.sort(); print(sys.argv[1], "zeros", sum(v==0 for v in vals), "min/med/max", [round(v,1) for v in (vals[0], vals[len(vals)//2], vals[-1])])
