"""GGUF files read as config, tensors and tokenizer, or converted into a Hugging Face folder."""
