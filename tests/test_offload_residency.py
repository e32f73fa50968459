"""What offloading holds on the device, judged by an oracle that does not run the transfer engine.

Each case runs one step twice from the same weights and batches: once without offloading, traced with plain
saved-tensor hooks (:class:`~lightning_ac.testing.residency.SaveTrace`), from which
:func:`~lightning_ac.testing.residency.ideal_residency` computes what an ideal engine of the documented design holds
as each unpack begins; and once offloading on the simulated asynchronous device, where the device's own count of the
engine's reloaded bytes still referred to is read as each unpack begins. The two sequences are equal, unpack by
unpack; the copies waiting on the device in forward stay within the oracle's stash bound; and at the end of backward
at most one copy (loaded ahead and never asked for) is on the device.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
from conftest import assert_same_training, clone, fit, tiny_model
from torch import nn

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload
from lightning_ac.layers import find_decoder_layers
from lightning_ac.testing.residency import (
    SaveTrace,
    ideal_residency,
    layer_inputs,
    moved_by_all,
    stash_bound,
    tracing_sac_storage,
)
from lightning_ac.testing.simulated import SimulatedDevice

pytestmark = pytest.mark.simulated

RELOADED = "reloaded activation bytes"


class Tracer(pl.Callback):
    """Traces the first training step of a run without offloading, selecting what ``offload`` would move."""

    def __init__(self, offload: Dict[str, Any], suite: Optional[ActivationCheckpointing]) -> None:
        self.offload, self.suite = offload, suite
        self.trace: Optional[SaveTrace] = None
        self._hooks: Any = None
        self._handles: List[Any] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.trace is not None:
            return
        model = module.model
        head = None if isinstance(model, PlainLM) else model.get_output_embeddings()  # a transformers model's head
        if "all" in self.offload:
            select, self._handles = moved_by_all(model, head, self.offload.get("min_offload_bytes", 2**16))
        elif "hidden_states" in self.offload:
            layers = list(model.blocks) if isinstance(model, PlainLM) else find_decoder_layers(model).modules
            select, self._handles = layer_inputs(model, layers)
        else:
            select = lambda tensor: False  # noqa: E731 - only SAC's saves move
        self.trace = SaveTrace(select)
        if "selective" in self.offload:
            policy = self.suite.plan.selective
            policy.storage_factory = tracing_sac_storage(self.trace, lambda t: _plain(t, model))
        self._hooks = self.trace.hooks()
        self._hooks.__enter__()

    def on_train_batch_end(self, *args):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
            for handle in self._handles:
                handle.remove()


def _plain(tensor: torch.Tensor, model: nn.Module) -> bool:
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return type(tensor) is torch.Tensor and tensor.numel() > 0 and tensor.untyped_storage().data_ptr() not in own


class Probe(pl.Callback):
    """Reads the simulated device's count of reloaded bytes as each of the first step's unpacks begins."""

    def __init__(self, sim: SimulatedDevice, offload: ActivationOffload) -> None:
        self.sim, self.offload = sim, offload
        self.seen: List[int] = []
        self.in_flight_peak = 0
        self.after_backward: Optional[int] = None
        self._done = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        engine = self.offload.plan.activation_offload.engine
        if self._done or "unpack" in engine.__dict__:
            return
        unpack = engine.unpack

        def probed(packed, *args, **kwargs):
            self.seen.append(self.sim.live_bytes(RELOADED))
            return unpack(packed, *args, **kwargs)

        engine.unpack = probed

    def on_after_backward(self, trainer, module):
        if self.after_backward is None:
            self.after_backward = self.sim.live_bytes(RELOADED)

    def on_train_batch_end(self, trainer, module, *args):
        engine = self.offload.plan.activation_offload.engine
        if "unpack" in engine.__dict__:
            del engine.unpack
            self._done = True
        streams = self.offload.plan.activation_offload.engine._streams
        self.in_flight_peak = self.sim.peak_in_flight_bytes.get(streams.d2h.name, 0) if streams else 0


class PlainBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class PlainLM(nn.Module):
    """A plain-torch language model: embedding, blocks, head."""

    def __init__(self, vocab: int = 128, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(PlainBlock(width) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Out", (), {"loss": loss})


ALL = {"all": "cpu", "min_offload_bytes": 0}
HIDDEN = {"hidden_states": "cpu"}
HIDDEN_SAC = {"hidden_states": "cpu", "selective": "cpu"}

CASES = {
    # id: (model, checkpointing (None: no ActivationCheckpointing), offload, layer offloading)
    "llama-offload_only": ("llama", None, ALL, False),
    "llama-full+all": ("llama", {}, ALL, False),
    "llama-full+hidden": ("llama", {}, HIDDEN, False),
    "llama-selective+hidden+selective": ("llama", {"selective": True}, HIDDEN_SAC, False),
    "llama-selective+selective": ("llama", {"selective": True}, {"selective": "cpu"}, False),
    "llama-full+hidden+chunked_loss": ("llama", {"chunked_loss": True}, HIDDEN, False),
    "llama-offload_only+chunked_loss": ("llama", {"enabled": False, "chunked_loss": True}, ALL, False),
    "llama-full+hidden+tiled_mlp": ("llama", {"tiled_mlp": True}, HIDDEN, False),
    "llama-lora-offload_only+layers": ("llama-lora", None, ALL, True),
    "llama-lora-full+hidden+layers": ("llama-lora", {}, HIDDEN, True),
    "qwen3-selective+hidden+selective": ("qwen3", {"selective": True}, HIDDEN_SAC, False),
    "qwen3-offload_only": ("qwen3", None, ALL, False),
    "gemma3-selective+hidden+selective": ("gemma3_text", {"selective": True}, HIDDEN_SAC, False),
    "gemma3-full+all": ("gemma3_text", {}, ALL, False),
    "plain-offload_only": ("plain", None, ALL, False),
    "plain-full+hidden": ("plain", {"layers": ["model.blocks.*"]}, HIDDEN, False),
}


def _model(name: str) -> nn.Module:
    if name == "plain":
        return PlainLM()
    family, _, lora = name.partition("-")
    return tiny_model(family, lora=bool(lora))


def _callbacks(checkpointing: Optional[Dict[str, Any]], layers: bool) -> List[pl.Callback]:
    suite: List[pl.Callback] = [] if checkpointing is None else [ActivationCheckpointing(**checkpointing)]
    return suite + ([LayerOffload(copy_on_host=True)] if layers else [])


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_offloading_holds_what_the_oracle_says_at_every_unpack(case):
    name, checkpointing, offload, layers = CASES[case]
    base = _model(name)
    suite = _callbacks(checkpointing, layers)
    tracer = Tracer(offload, suite[0] if checkpointing is not None else None)
    reference = fit(clone(base), [*suite, tracer])
    expected = ideal_residency(tracer.trace)
    assert tracer.trace.unpacks, "the trace saw no save the target moves"

    with SimulatedDevice() as sim:
        offloading = ActivationOffload(copy_on_host=True, **offload)
        probe = Probe(sim, offloading)
        run = fit(clone(base), [*_callbacks(checkpointing, layers), offloading, probe])
    assert_same_training(reference, run)
    assert probe.seen == expected
    assert 0 < probe.in_flight_peak <= stash_bound(tracer.trace)
    assert probe.after_backward <= max(c.nbytes for c in tracer.trace.copies), "at most one copy loaded ahead"


class CudaProbe(Probe):
    """The engine's reloaded bytes still referred to, by their storages: on CUDA (the caching allocator keeps freed
    blocks, so its own count does not fall when a storage is freed) and in the estimate's fake step (no allocator)."""

    def __init__(self, offload: Optional[ActivationOffload] = None) -> None:
        super().__init__(None, offload)  # type: ignore[arg-type]
        self.reloaded: List[Any] = []

    def live(self) -> int:
        return sum(nbytes for ref, nbytes in self.reloaded if not ref.expired())

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from torch.multiprocessing.reductions import StorageWeakRef

        if self.offload is None:  # the first ActivationOffload of the run (one the estimate's fake step made)
            self.offload = next(cb for cb in trainer.callbacks if isinstance(cb, ActivationOffload))
        engine = self.offload.plan.activation_offload.engine
        if self._done or "unpack" in engine.__dict__:
            return
        unpack, reload = engine.unpack, engine._reload

        def probed(packed, *args, **kwargs):
            self.seen.append(self.live())
            return unpack(packed, *args, **kwargs)

        def tracked(copy):
            fresh = copy.device_data is None
            data = reload(copy)
            if fresh:
                self.reloaded.append((StorageWeakRef(data.untyped_storage()), copy.nbytes))
            return data

        engine.unpack, engine._reload = probed, tracked

    def on_after_backward(self, trainer, module):
        if self.after_backward is None:
            self.after_backward = self.live()

    def on_train_batch_end(self, trainer, module, *args):
        engine = self.offload.plan.activation_offload.engine
        if "unpack" in engine.__dict__:
            del engine.unpack, engine._reload
            self._done = True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["llama-offload_only", "llama-selective+hidden+selective", "qwen3-full+all"])
def test_on_cuda_offloading_holds_what_the_oracle_says_at_every_unpack(case):
    """The same oracle on real streams: backward's reloads and prefetch hold what the design says, unpack by unpack."""
    name, checkpointing, offload, layers = CASES[case]
    base = _model(name)
    suite = _callbacks(checkpointing, layers)
    tracer = Tracer(offload, suite[0] if checkpointing is not None else None)
    fit(clone(base), [*suite, tracer], accelerator="gpu")
    offloading = ActivationOffload(**offload)
    probe = CudaProbe(offloading)
    fit(clone(base), [*_callbacks(checkpointing, layers), offloading, probe], accelerator="gpu")
    assert probe.seen == ideal_residency(tracer.trace)
    assert probe.after_backward <= max(c.nbytes for c in tracer.trace.copies)
