"""Where weights come from: the registry (a model name or path -> config + weight source),
readers (safetensors, torch .bin, GGUF, dummy), the converter into the per-tensor store the
disk tier reads, the compressed store, and export to a Hugging Face folder."""
