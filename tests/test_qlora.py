"""Layer offloading of a QLoRA base: bitsandbytes 4-bit (nf4) decoder linears with LoRA on top, on CPU.

The packed 4-bit weights stream with their quant state (``absmax``, ``code``; with double quantization the
nested state too), never dequantized; training is bit-identical to the same model without LayerOffload.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import LM, assert_same_training, batches, clone, fit, make_trainer, tiny_qlora_model
from test_layer_offload import LAYERS, DeviceCopySpy

from lightning_ac import ActivationCheckpointing, ActivationOffload, LayerOffload

pytest.importorskip("bitsandbytes")


def quantized_layer_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder layers' frozen parameters as stored: packed 4-bit data plus each quant state's
    tensors, and the plain frozen parameters (norms)."""
    from bitsandbytes.nn import Params4bit

    total = 0
    for p in model.base_model.model.model.layers.parameters():
        if p.requires_grad:
            continue
        total += p.numel() * p.element_size()
        if isinstance(p, Params4bit):
            state = p.quant_state
            tensors = [state.absmax, state.code]
            if state.nested:
                tensors += [state.offset, state.state2.absmax, state.state2.code]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    return tiny_qlora_model(str(tmp_path_factory.mktemp("qlora")))


@pytest.fixture(scope="module")
def qlora_reference(qlora):
    return fit(clone(qlora), max_steps=2)


@pytest.mark.parametrize(
    "others",
    [
        [],
        [ActivationCheckpointing],
        [lambda: ActivationCheckpointing(selective=True)],
        [ActivationCheckpointing, lambda: ActivationOffload(hidden_states="cpu", copy_on_host=True)],
    ],
    ids=["alone", "full", "selective", "hidden_states"],
)
def test_a_4bit_base_streams_exactly(qlora, qlora_reference, others, transfer):
    from bitsandbytes.nn import Params4bit

    callback = LayerOffload(copy_on_host=True)
    spy = DeviceCopySpy(callback)
    run = fit(clone(qlora), [make() for make in others] + [callback, spy], max_steps=2)
    assert_same_training(qlora_reference, run)
    quantized = quantized_layer_bytes(qlora)
    assert callback.last_step == {"loads": 2 * LAYERS, "bytes": 2 * quantized, "max_resident_layers": 2}
    assert callback.host_bytes == quantized
    # bitsandbytes' backward keeps the packed weight outside autograd's saved tensors: it is taken out after each
    # call, so no layer's device copy outlives its forward
    assert spy.alive_before_backward == [0, 0]
    layers = run.model.base_model.model.model.layers
    weights = [p for p in layers.parameters() if isinstance(p, Params4bit)]
    assert len(weights) == 7 * LAYERS and all(p.dtype == torch.uint8 for p in weights), "still packed"
    assert all(p.quant_state.absmax.device.type == "cpu" for p in weights)


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_double_quantization_streams_the_nested_state(tmp_path, transfer):
    base = tiny_qlora_model(str(tmp_path), double_quant=True)
    reference = fit(clone(base), max_steps=2)
    callback = LayerOffload(copy_on_host=True)
    run = fit(clone(base), [ActivationCheckpointing(), callback], max_steps=2)
    assert_same_training(reference, run)
    assert callback.last_step["bytes"] == 2 * quantized_layer_bytes(base)


def test_no_warning_that_4bit_weights_stay(qlora, caplog, recwarn):
    fit(clone(qlora), [LayerOffload(copy_on_host=True)], max_steps=1)
    assert not [w for w in recwarn if "stay on the device" in str(w.message)]
    assert "frozen parameters of 4/4 decoder layers" in caplog.text


class BackwardSpy(DeviceCopySpy):
    """Also records, as backward reaches each layer, how many device copies are alive, and at each step's start
    how many of bitsandbytes' 4-bit backward nodes are still alive (a graph kept by a hook of ours)."""

    def __init__(self, callback):
        super().__init__(callback)
        self.alive_in_backward: list = []
        self.nodes_at_start: list = []
        self.earlier_nodes: list = []

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        # 4-bit nodes this run did not make are not its to free: torch's MemTracker (the CPU step measurement that
        # an earlier test's run went through) leaves some alive. They are held until the run ends, so that no node
        # of this run takes the id of one freed meanwhile
        gc.collect()
        self.earlier_nodes = _4bit_nodes()
        streamer = self.callback.plan.weight_streamer
        original = streamer._backward_reached

        def reached(layer):
            original(layer)
            self.alive_in_backward.append(sum(not ref.expired() for ref in self.refs))

        streamer._backward_reached = reached
        self.slots_per_layer = len(streamer.layers[0].slots)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        gc.collect()
        earlier = {id(o) for o in self.earlier_nodes}
        self.nodes_at_start.append(sum(id(o) not in earlier for o in _4bit_nodes()))

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        self.earlier_nodes = []


def _4bit_nodes() -> list:
    return [o for o in gc.get_objects() if type(o).__name__ == "MatMul4BitBackward"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_4bit_backward_keeps_nothing_alive(qlora, checkpointing):
    """The packed weight rebuilt for a 4-bit node's backward is let go right after it: no layer's copy piles up as
    backward goes on, and no graph outlives its step."""
    callback = LayerOffload(copy_on_host=True)
    spy = BackwardSpy(callback)
    fit(clone(qlora), [*([ActivationCheckpointing()] if checkpointing else []), callback, spy], max_steps=3)
    assert spy.nodes_at_start == [0, 0, 0]
    assert spy.alive_in_backward and max(spy.alive_in_backward) <= 2 * spy.slots_per_layer, spy.alive_in_backward


def pretrained_qlora_model(tmp_dir: str, double_quant: bool = False) -> torch.nn.Module:
    """A QLoRA base as a user loads it: ``from_pretrained`` with a 4-bit config and LoRA on q/v, no ``.train()``
    after it, so the base stays in the eval mode ``from_pretrained`` leaves it in (Lightning keeps a module's
    mode). At its first call without gradient, bitsandbytes repacks such a ``Linear4bit``'s weight for its CPU
    kernel (where the CPU has AVX512-bf16): the first decoder layer's q/k/v, whose input needs none."""
    return tiny_qlora_model(tmp_dir, double_quant, targets=["q_proj", "v_proj"], train=False)


def repacked(run) -> list:
    """Which 4-bit linears of the first decoder layer bitsandbytes repacked for its CPU kernel."""
    from bitsandbytes.nn import Linear4bit

    layer = run.model.base_model.model.model.layers[0]
    return [
        name
        for name, module in layer.named_modules()
        if isinstance(module, Linear4bit) and getattr(module.weight.quant_state, "packing_format_for_cpu", False)
    ]


@pytest.mark.filterwarnings("ignore:.*eval mode at the start of training")
@pytest.mark.parametrize(
    "double_quant, checkpointing",
    # double quantization: the repack drops the nested state's slots while the norms' saved views name theirs
    [(False, False), (True, False), (True, True)],
    ids=["nf4", "double_quant", "double_quant_full"],
)
def test_a_base_in_eval_mode_streams_its_repacked_weights_exactly(tmp_path, double_quant, checkpointing, transfer):
    """bitsandbytes repacks an eval-mode 4-bit weight at its first call without gradient (the layout and bf16
    absmax of its AVX512-bf16 kernel, the nested state folded in): the streamed layer computes with the repacked
    weight too, and streams it from then on."""
    from bitsandbytes.functional import has_avx512bf16

    base = pretrained_qlora_model(str(tmp_path), double_quant=double_quant)
    if checkpointing:
        # transformers recomputes only layers in training mode (an eval-mode layer is refused): the decoder layers
        # train, the 4-bit linears inside them stay in the eval mode from_pretrained left them in
        for layer in base.base_model.model.model.layers:
            layer.training = True
    others = [ActivationCheckpointing()] if checkpointing else []
    reference = fit(clone(base), others, max_steps=2)
    others = [ActivationCheckpointing()] if checkpointing else []
    callback = LayerOffload(copy_on_host=True)
    run = fit(clone(base), [*others, callback], max_steps=2)
    assert_same_training(reference, run)
    expected = ["self_attn.q_proj.base_layer", "self_attn.k_proj", "self_attn.v_proj.base_layer"]
    assert repacked(reference) == (expected if has_avx512bf16() else [])
    assert repacked(run) == repacked(reference)
    # the repacked layout is what streams now: host copies and the bytes of the second step
    assert callback.last_step["bytes"] == 2 * callback.host_bytes


class ValidatedLM(LM):
    """Also validates, so the sanity check calls the base in eval mode without gradient before training."""

    def validation_step(self, batch, batch_idx):
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss


# bitsandbytes' own: its repacked kernel (gemv_4bit) has no autograd formula, and training after the repack
# backprops through it, with or without LayerOffload
@pytest.mark.filterwarnings("ignore:.*gemv_4bit. an autograd kernel was not registered")
def test_the_sanity_check_repacks_and_training_streams_that_exactly(qlora, transfer):
    """A base in train mode is repacked by the sanity check (every 4-bit linear, on a CPU with AVX512-bf16):
    training then computes with the repacked weights, streamed or not."""
    from bitsandbytes.functional import has_avx512bf16

    def run(callbacks):
        module = ValidatedLM(clone(qlora))
        trainer = make_trainer(callbacks, max_steps=2, limit_val_batches=1, num_sanity_val_steps=1)
        trainer.fit(module, batches(), batches(1))
        return module

    reference = run([])
    streamed = run([LayerOffload(copy_on_host=True)])
    assert_same_training(reference, streamed)
    assert bool(repacked(reference)) == has_avx512bf16()
    assert repacked(streamed) == repacked(reference)
