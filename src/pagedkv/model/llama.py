"""Llama (and Mistral and Qwen2, which differ from it only by config switches).

The decoder itself is `decoder.py`; this module is the family's entry in the registry.
"""

from __future__ import annotations

from pagedkv.model.decoder import DecoderModel


class LlamaModel(DecoderModel):
    """The Llama-family decoder exactly as `decoder.py` writes it out."""
