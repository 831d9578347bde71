"""What rank 0 broadcasts to the workers, besides each step's `SchedulerOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine's arguments import this module: no torch at import
    from pagedkv.weights.lora import LoRAAdapter


@dataclass(frozen=True)
class LoadSpec:
    """What every rank loads its shard from, and with how many threads.

    `device` is the device type ("cpu" or "cuda"): rank `r` of a machine uses CUDA device
    `local_rank`.
    """

    model: str
    dtype: str
    device: str
    quantization: str
    threads: int | None
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    download_dir: str | None = None
    revision: str | None = None  # of a repo id in the Hugging Face cache

    def load_options(self) -> dict[str, Any]:
        """The keywords of `weights.load.load` besides the model and the device."""
        return {
            "dtype": self.dtype,
            "quantization": self.quantization,
            "load_format": self.load_format,
            "hf_overrides": self.hf_overrides,
            "download_dir": self.download_dir,
            "revision": self.revision,
        }


@dataclass(frozen=True)
class Keepalive:
    """Sent when rank 0 has been idle a while: workers answer with a pulse (an all-reduce), so
    neither side's collective timeout fires while there is simply nothing to do."""


@dataclass(frozen=True)
class LoRAWeights:
    """The LoRA adapters the next step writes into blocks (its `adapters.loaded`), whole: only
    rank 0 reads adapter folders (`engine/lora.py`); each rank writes its own share of them."""

    adapters: dict[int, LoRAAdapter]


@dataclass(frozen=True)
class Stop:
    """The engine is shutting down: workers leave their loop and exit."""
