"""The tiers (gpu, cpu, disk): devices, weight placement by fraction, weight homes, disk
files that bypass the page cache, the copy engine, usage accounting, and the machine's
description. Layer: below the executor; uses compression, models and the plain-data policy."""
