"""vLLM's `vllm.outputs` import path, so `from vllm.outputs import ...` ports by renaming the
package: the names are the engine's own (`pagedkv.engine.outputs`)."""

from pagedkv.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
