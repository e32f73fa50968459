"""What the plan installs for the offload targets, and the per-step lifecycle the callback drives."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac.config import OffloadConfig, Placement
from lightning_ac.offload.engine import TransferEngine
from lightning_ac.offload.targets import SavedTensorOffloader, offloading_sac_storage

__all__ = ["OffloadRuntime", "TARGETS"]

TARGETS = ("hidden_states", "selective", "all")


class OffloadRuntime:
    """The engine and the targets of one run.

    Args:
        config: Which targets move to the host.
        device: The training device.
        copy_on_host: Force the pack/unpack path on a CPU device.
        min_offload_bytes: ``all`` leaves tensors smaller than this on the device.
        engine_kwargs: Passed to :class:`TransferEngine` (pool size, stash, prefetch, host reserve).
    """

    def __init__(
        self,
        config: OffloadConfig,
        device: torch.device,
        copy_on_host: bool = False,
        min_offload_bytes: int = 2**16,
        **engine_kwargs: Any,
    ) -> None:
        self.config = config
        self.engine = TransferEngine(device, copy_on_host=copy_on_host, **engine_kwargs)
        self.targets = [t for t in TARGETS if getattr(config, t) != Placement.none]
        self.hidden_states = (
            SavedTensorOffloader(self.engine, "hidden_states") if config.hidden_states != Placement.none else None
        )
        self.all = (
            SavedTensorOffloader(self.engine, "all", min_bytes=min_offload_bytes)
            if config.all != Placement.none
            else None
        )
        self.sac_storage: Optional[Callable[..., Any]] = (
            offloading_sac_storage(self.engine) if config.selective != Placement.none else None
        )
        self.handles: List[Any] = []
        self.in_step = False
        self._module: Optional[torch.nn.Module] = None

    def skip_module_tensors(self, module: torch.nn.Module) -> None:
        """Parameters and buffers (and views of them, like a transposed weight) never move. Read again at each
        step: the strategy moves the module to its device after ``setup``, and sharding changes storages."""
        self._module = module
        self._refresh_skips()

    def _refresh_skips(self) -> None:
        if self._module is None:
            return
        skips = {}
        for tensor in [*self._module.parameters(), *self._module.buffers()]:
            local = tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor
            storage = local.untyped_storage()
            skips[storage.data_ptr()] = StorageWeakRef(storage)
        self.engine.skip_storages = skips

    def start_step(self) -> None:
        self._refresh_skips()
        self.engine.start_step()
        if self.sac_storage is not None:
            self.sac_storage.reset()  # type: ignore[attr-defined]
        if self.all is not None:
            self.all.push()
        self.in_step = True

    def finish_step(self) -> None:
        if not self.in_step:
            return
        self.in_step = False
        if self.all is not None:
            self.all.pop()
        self.engine.finish_step()

    def close(self) -> None:
        """Leave nothing pushed or in flight (after an exception too)."""
        self.finish_step()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def last_step(self) -> Dict[str, Dict[str, int]]:
        """``{target: {"tensors": n, "bytes": n}}`` for the most recent training step, every target listed."""
        return {t: dict(self.engine.last_step.get(t, {"tensors": 0, "bytes": 0})) for t in TARGETS}
