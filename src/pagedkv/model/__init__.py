"""Model runtime: loading, Llama-style modules, KV cache tensors and paged attention."""
