"""Run a flexgen-helm command with the engine's dequantize_packed timed around each call;
prints the total at the end. Usage: python dequant_time.py eval --task wikitext ..."""
import sys
import time

import flexgen_helm.compression.int4 as int4
from flexgen_helm.cli import main

spent = [0.0, 0]
_dequantize = int4.dequantize_packed


def _timed(*args, **kwargs):
    t0 = time.perf_counter()
    out = _dequantize(*args, **kwargs)
    spent[0] += time.perf_counter() - t0
    spent[1] += 1
    return out


int4.dequantize_packed = _timed  # int4's own callers look the name up in the module at each call
rc = main(sys.argv[1:])
print("dequantize_packed: %.3f s in %d calls" % tuple(spent))
sys.exit(rc)
