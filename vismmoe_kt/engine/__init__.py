"""Our decode path: a static KV cache, one step split into capturable segments, a generation loop."""
