"""The tensor side of a step: KV cache tensors, pool sizing, the model runner."""
