"""Reports: HELM runs (padded vs actual throughput, metrics), accuracy (Table 5), the
latency-throughput frontier (Figure 1), the runtime breakdown (Table 23) and the ablation
table, as markdown + CSV + PNG under runs/<suite>/. Entry point: `build.build_report`."""
