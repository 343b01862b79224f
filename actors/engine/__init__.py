"""The emulated inference engine: vLLM-like scheduler and paged KV cache over a cost model and a clock."""
