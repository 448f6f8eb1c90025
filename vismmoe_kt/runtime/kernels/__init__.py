"""The runtime's Triton kernels, one concept per module; each defines its kernels only where Triton
is installed (`available`), and its callers (table_experts, offload, decode_table, transfers,
layerwise_prefill) take the torch twins otherwise.

Modules: `bf16_gemv` (a decode step's experts read where they lie, slab or mapped host store),
`quantized_gemv` (the same on quantized slabs, each format decoded as it is read), `q4k_dp4a` (its
Q4_K GEMVs against int8 inputs, four products an instruction), `block_decode`
(the formats' weight decoders the quantized kernels share), `block_staging` (quantized blocks copied
as they are from the host), `dequantize` (blocks dequantized into slabs or a bank), `table_ops`
(the decode table's lookup, combine and publish, and the prefetch's claims), `prefetch_copy` (the
lookahead prefetch's in-graph copies), `expert_major` and `quantized_major` (a batched step's
experts, each routed expert read once for all its tokens, on tensor cores), `tuning` (the tuned tile
configurations per device, tuning.json), `triton_support` (Triton or None).
"""
