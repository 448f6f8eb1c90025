"""Full-size models with random weights, the published shapes of each family, built in host memory
(synthetic.py) or written as a GGUF checkpoint (synthetic_gguf.py): what the benchmarks measure on
without downloading a checkpoint."""
