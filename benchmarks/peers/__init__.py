"""Other programs' benchmarks run beside ours on the same model file (llama.cpp's llama-bench)."""
