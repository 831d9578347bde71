"""From files to a model: one `load()` for Hugging Face folders, GGUF files and built-ins."""
