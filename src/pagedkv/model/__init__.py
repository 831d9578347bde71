"""The decoder, one module per model family, the architecture registry and the layers."""
