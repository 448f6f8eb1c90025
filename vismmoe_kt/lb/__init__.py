"""ReaLB: modality-aware mixed precision to balance expert-parallel ranks in real time.

Vocabulary: a *rank* executes a subset of a layer's experts (expert parallelism; with one GPU the
ranks are virtual and run one after another); a rank's *load* is its token-expert pairs; its
*vision fraction* is the share of those pairs that come from image tokens; *M_d* is the vision
fraction above which an overloaded rank may switch experts to low precision; the *LB gate* keeps
everything in BF16 below `gate_tokens` tokens per step.

Modules: `nvfp4` (exact NVFP4 numerics), `policy` (the per-step precision plan), `aimd` (control
of M_d).
"""
