"""ggml's tensor type ids (the `gguf` package's GGMLQuantizationType values), for code that must know
them without importing the optional `gguf` package: GGUF readers hand tensors over with these ids, and
kt-kernel's llamafile kernels take them as the experts' and activations' types (kt_backend.py)."""

F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30
UNQUANTIZED = (F32, F16, BF16)
# the host store's formats (vismmoe_kt/runtime/store.py) by their ggml type
STORE_FORMATS = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_k": Q4_K, "q5_k": Q5_K}
PART_FORMATS = {**STORE_FORMATS, "q6_k": Q6_K}  # what a store block's down part may hold as a file stores it
