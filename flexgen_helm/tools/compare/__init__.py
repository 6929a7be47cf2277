"""`flexgen-helm compare`: the same model, workload and memory budgets through our engine
(searched policy, DeepSpeed-style policy) and through Hugging Face accelerate's
big-model inference with disk offload, in one run, so that the ratios hold."""
