"""Put on PYTHONPATH by ab.sh: every Python process of the run starts with the cyclic GC off."""

import gc

gc.disable()
