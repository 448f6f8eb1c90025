"""CPU expert backends (kt-kernel AVX/AMX kernels, a torch fallback) and ISA detection.

Empty for now: the GPU-CPU hybrid-mode work fills it. Today's CPU expert compute is torch, through
`vismmoe_kt.operators.experts.PlacedExperts` with its weights on the CPU.
"""
