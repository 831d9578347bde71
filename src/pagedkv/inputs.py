"""vLLM's `vllm.inputs` import path, so `from vllm.inputs import ...` ports by renaming the
package: the names are the engine's own (`pagedkv.engine.prompts`)."""

from pagedkv.engine.prompts import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
