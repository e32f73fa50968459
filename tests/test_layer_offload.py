"""LayerOffload: frozen decoder-layer parameters in host memory, one layer at a time on the device.

On CPU the copies run with ``copy_on_host=True`` (separate host tensors stand in for device copies), which is
the whole path but the streams; the CUDA path has gpu-marked tests in test_gpu.py.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, assert_same_training, batches, clone, fit, make_trainer, model_fingerprint, tiny_model
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    LightningACWarning,
    callbacks_from_config,
)

LAYERS = 4


def layer_offload(**kwargs):
    return LayerOffload(copy_on_host=True, **kwargs)


def frozen_layer_bytes(model: nn.Module) -> int:
    layers = model.base_model.model.model.layers if hasattr(model, "base_model") else model.model.layers
    return sum(p.numel() * p.element_size() for p in layers.parameters() if not p.requires_grad)


@pytest.fixture(scope="module")
def lora_llama():
    return tiny_model("llama", lora=True)


@pytest.fixture(scope="module")
def lora_reference(lora_llama):
    return fit(clone(lora_llama), max_steps=2)


@pytest.mark.parametrize(
    "others",
    [
        [],
        [ActivationCheckpointing],
        [lambda: ActivationCheckpointing(kwargs={"every_n_layers": 2})],
        [lambda: ActivationCheckpointing(reentrant=True)],
        [lambda: ActivationCheckpointing(selective=True)],
        [ActivationCheckpointing, lambda: ActivationOffload(hidden_states="cpu", copy_on_host=True)],
        [
            lambda: ActivationCheckpointing(selective=True),
            lambda: ActivationOffload(hidden_states="cpu", selective="cpu", copy_on_host=True),
        ],
        [lambda: ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)],
    ],
    ids=["alone", "full", "every_2", "reentrant", "selective", "hidden_states", "selective_offload", "offload_all"],
)
def test_training_is_exact_and_each_layer_visits_twice_per_step(lora_llama, lora_reference, others, transfer):
    callback = layer_offload()
    run = fit(clone(lora_llama), [make() for make in others] + [callback], max_steps=2)
    assert_same_training(lora_reference, run)
    frozen = frozen_layer_bytes(lora_llama)
    # forward brings each layer once, backward once more; never more than the running and the arriving layer
    assert callback.last_step == {"loads": 2 * LAYERS, "bytes": 2 * frozen, "max_resident_layers": 2}
    assert callback.host_bytes == frozen


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_sliding_window_families(family, transfer):
    base = tiny_model(family, lora=True)
    reference = fit(clone(base), max_steps=2)
    run = fit(clone(base), [ActivationCheckpointing(selective=True), layer_offload()], max_steps=2)
    assert_same_training(reference, run)


def test_gradient_accumulation_and_a_full_finetune_head(lora_llama, transfer):
    reference = fit(clone(lora_llama), max_steps=2, accumulate_grad_batches=2)
    run = fit(clone(lora_llama), [layer_offload()], max_steps=2, accumulate_grad_batches=2)
    assert_same_training(reference, run)


class DeviceCopySpy(pl.Callback):
    """Records, before each backward, whether any device copy made during the forward is still alive."""

    def __init__(self, callback: LayerOffload) -> None:
        self.callback = callback
        self.refs: list = []
        self.alive_before_backward: list = []

    def on_train_start(self, trainer, pl_module):
        streamer = self.callback.plan.weight_streamer
        original = streamer._load

        def load(layer, *args, **kwargs):
            fresh = layer.device is None
            original(layer, *args, **kwargs)
            if fresh:
                self.refs.extend(StorageWeakRef(t.untyped_storage()) for t in layer.device)

        streamer._load = load

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.refs.clear()

    def on_before_backward(self, trainer, pl_module, loss):
        self.alive_before_backward.append(sum(not ref.expired() for ref in self.refs))


def test_forward_keeps_no_device_copy_even_without_checkpointing(lora_llama, transfer):
    # Autograd saves linear's weight as a view of the device copy; without the saved-tensor hook those views
    # would keep every layer's weights on the device until backward.
    callback = layer_offload()
    spy = DeviceCopySpy(callback)
    run = fit(clone(lora_llama), [callback, spy], max_steps=2)
    layers = lora_llama.base_model.model.model.layers
    frozen = sum(1 for p in layers.parameters() if not p.requires_grad)
    assert len(spy.refs) == 2 * frozen, "each frozen layer parameter: one copy in forward, one in backward"
    assert spy.alive_before_backward == [0, 0]
    assert run.losses == fit(clone(lora_llama), max_steps=2).losses


class BetweenSteps(pl.Callback):
    """What user code sees between steps: the state_dict, and where the streamed parameters are."""

    def __init__(self, callback: LayerOffload, frozen_before: dict) -> None:
        self.callback, self.frozen_before = callback, frozen_before
        self.checks: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_ac.offload.weights.slots import holds as _holds

        state = pl_module.state_dict()
        streamer = self.callback.plan.weight_streamer
        self.checks.append(
            {
                "keys": sorted(state),
                "frozen values": all(torch.equal(state[n], v) for n, v in self.frozen_before.items()),
                "nothing loaded": all(layer.device is None for layer in streamer.layers),
                "data is the host copy": all(
                    _holds(slot.get(), h) for layer in streamer.layers for slot, h in zip(layer.slots, layer.host)
                ),
            }
        )


def test_state_dict_between_steps_and_model_left_as_found(lora_llama, transfer):
    model = clone(lora_llama)
    module = LM(model)
    fingerprint = model_fingerprint(module)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    callback = layer_offload()
    probe = BetweenSteps(callback, before)
    make_trainer([callback, probe], max_steps=2).fit(module, batches())
    assert len(probe.checks) == 2
    for check in probe.checks:
        assert check.pop("keys") == fingerprint["state_dict"]
        assert all(check.values()), check
    assert model_fingerprint(module) == fingerprint
    for name, param in module.named_parameters():
        if name in before:
            assert torch.equal(param, before[name]), "frozen weights are unchanged"
            # memory of its own again, not a slice of a layer's host buffer
            assert param.storage_offset() == 0 and param.untyped_storage().nbytes() == param.numel() * 4, name
    # a second fit applies and removes again
    make_trainer([layer_offload()], max_steps=1).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


class ValLM(LM):
    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("val_loss", loss)
        return loss


def test_validate_only_run_is_exact(lora_llama, transfer):
    plain = make_trainer().validate(ValLM(clone(lora_llama)), batches(), verbose=False)
    module = ValLM(clone(lora_llama))
    fingerprint = model_fingerprint(module)
    offloaded = make_trainer([layer_offload()]).validate(module, batches(), verbose=False)
    assert plain == offloaded
    assert model_fingerprint(module) == fingerprint


def test_validation_inside_fit_is_exact(lora_llama, transfer):
    """The sanity check's validation (no grad) is the first forward, with the weights already in host memory."""

    def run(callbacks):
        module = ValLM(clone(lora_llama))
        trainer = make_trainer(callbacks, max_steps=3, val_check_interval=2, limit_val_batches=1)
        trainer.fit(module, batches(), batches())
        return module, float(trainer.callback_metrics["val_loss"])

    (plain, plain_val), (streamed, streamed_val) = run([]), run([ActivationCheckpointing(), layer_offload()])
    assert plain.losses == streamed.losses and plain_val == streamed_val


class PlacementSpy(SingleDeviceStrategy):
    """A single-device strategy that records every tensor its placement of the module (``model.to(device)``)
    converts: what it would copy to the device."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.placed: dict = {}

    def model_to_device(self) -> None:
        placed = self.placed

        class Spy(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.to:
                    placed[id(args[0])] = args[0].numel() * args[0].element_size()
                return func(*args, **(kwargs or {}))

        with Spy():
            super().model_to_device()


def test_the_strategy_never_places_streamed_weights(lora_llama, transfer):
    """The frozen decoder-layer weights move to host memory in setup, before the strategy places the module:
    its model.to(device) converts everything else and none of them, so the device peak, setup included, is what
    is not streamed plus two layers."""
    module = LM(clone(lora_llama))
    callback = layer_offload()
    strategy = PlacementSpy()
    make_trainer([ActivationCheckpointing(), callback], max_steps=2, strategy=strategy).fit(module, batches())
    layers = module.model.base_model.model.model.layers
    streamed = {id(p): p.numel() * p.element_size() for p in layers.parameters() if not p.requires_grad}
    assert streamed and not streamed.keys() & strategy.placed.keys(), "no streamed weight passes placement"
    placed = {id(p) for p in module.parameters()} & strategy.placed.keys()
    assert placed == {id(p) for p in module.parameters()} - streamed.keys(), "everything else is placed"
    frozen = frozen_layer_bytes(lora_llama)
    assert callback.last_step == {"loads": 2 * LAYERS, "bytes": 2 * frozen, "max_resident_layers": 2}
    if transfer is not None:  # the simulated device: what it held, besides what placement put there
        assert transfer.peak_bytes["layer weights"] == 2 * frozen // LAYERS


def test_a_dtype_conversion_of_the_module_converts_the_host_copies(lora_llama, transfer):
    """bf16-true precision converts the module with model.to(torch.bfloat16) at setup, after the weights went to
    host memory: they are converted there (into one new buffer per layer; the float32 buffers are unpinned), and
    training is exact."""
    reference = fit(clone(lora_llama), max_steps=2, precision="bf16-true")
    module = LM(clone(lora_llama))
    callback = layer_offload()
    pinned = []
    at_start = pl.Callback()
    if transfer is not None:
        at_start.on_train_start = lambda trainer, pl_module: pinned.extend(transfer.pinned_in_place.values())
    make_trainer([callback, at_start], max_steps=2, precision="bf16-true").fit(module, batches())
    assert reference.losses == module.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, module.grads[name]), name
    assert callback.host_bytes == frozen_layer_bytes(lora_llama) // 2, "bfloat16 copies in host memory"
    if transfer is not None:  # the simulated device: what stays page-locked during the run
        assert len(pinned) == LAYERS and sum(pinned) <= callback.host_bytes + LAYERS * 64 * 16, pinned
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())


def test_resume_from_a_checkpoint_loads_the_streamed_weights(lora_llama, tmp_path, transfer):
    """fit(ckpt_path=...) loads the checkpoint into the module after setup: the streamed weights take the
    checkpoint's values in host memory, and training goes on exactly as without LayerOffload."""
    first = LM(clone(lora_llama))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([checkpoint], max_steps=2, enable_checkpointing=True).fit(first, batches())

    def resume(callbacks):
        model = clone(lora_llama)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # everything, frozen weights included, must come from the checkpoint
        module = LM(model)
        trainer = make_trainer(callbacks, max_steps=4)
        trainer.fit(module, batches(), ckpt_path=str(tmp_path / "last.ckpt"))
        return module

    plain, streamed = resume([]), resume([ActivationCheckpointing(), layer_offload()])
    assert plain.losses == streamed.losses and len(plain.losses) == 2
    for a, b in zip(plain.parameters(), streamed.parameters()):
        assert torch.equal(a, b)


class Boom(LM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_model_restored_after_an_exception(lora_llama, transfer):
    module = Boom(clone(lora_llama))
    fingerprint = model_fingerprint(module)
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([ActivationCheckpointing(), layer_offload()], max_steps=3).fit(module, batches())
    assert model_fingerprint(module) == fingerprint
    layers = module.model.base_model.model.model.layers
    frozen = [p for p in layers.parameters() if not p.requires_grad]
    assert frozen and all(p.storage_offset() == 0 and not p.is_pinned() for p in frozen)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.adapter = nn.Linear(16, 16, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return x + torch.tanh(self.frozen(x)) + self.adapter(x)


class Net(pl.LightningModule):
    """Plain torch blocks, optionally checkpointed by the model itself around each block's call."""

    def __init__(self, checkpoint: str = "none") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.checkpoint = checkpoint
        self.grads = None
        self.losses = []

    def training_step(self, batch, batch_idx):
        x = batch[0].float()[:, :16].requires_grad_(self.checkpoint == "reentrant")
        for block in self.blocks:
            if self.checkpoint == "none":
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        loss = x.pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def on_after_backward(self):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize("checkpoint", ["none", "non-reentrant", "reentrant", "checkpoint_wrapper"])
def test_plain_torch_layers_and_checkpoints_around_their_calls(checkpoint, transfer):
    """Checkpoints that call the layer module again in backward (the model's own, torch's CheckpointWrapper):
    the recompute sees the same saved tensors, and releases follow the backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    base = Net("none" if checkpoint == "checkpoint_wrapper" else checkpoint)
    if checkpoint == "checkpoint_wrapper":
        base.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in base.blocks)
    reference, run = clone(base), clone(base)
    make_trainer(max_steps=2).fit(reference, batches())
    callback = layer_offload(layers=[Block])
    probe = BetweenSteps(callback, {})
    make_trainer([callback, probe], max_steps=2).fit(run, batches())
    assert reference.losses == run.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, run.grads[name]), name
    assert callback.last_step == {"loads": 6, "bytes": 6 * (16 * 16 + 16) * 4, "max_resident_layers": 2}
    assert all(check["nothing loaded"] and check["data is the host copy"] for check in probe.checks)


def test_saved_tensors_without_plain_storage_pass_through(transfer):
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    class SparseBlock(Block):
        def forward(self, x):
            eye = torch.eye(x.shape[0]).to_sparse()
            return super().forward(torch.sparse.mm(eye, x))  # saves a sparse tensor for backward

    torch.manual_seed(0)
    blocks = [SparseBlock() for _ in range(2)]
    x = torch.randn(8, 16, requires_grad=True)

    def grad():
        h = x
        for block in blocks:
            h = block(h)
        return torch.autograd.grad(h.pow(2).sum(), [x])[0]

    reference = grad()
    streamer = LayerWeightStreamer(blocks, frozen_layer_parameters(blocks), torch.device("cpu"), copy_on_host=True)
    streamer.install()
    try:
        assert torch.equal(grad(), reference)
    finally:
        streamer.close()


def test_a_backward_that_raises_leaves_nothing_loaded_for_the_next_step(transfer):
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    torch.manual_seed(0)
    blocks = [Block() for _ in range(4)]
    streamer = LayerWeightStreamer(blocks, frozen_layer_parameters(blocks), torch.device("cpu"), copy_on_host=True)
    streamer.install()

    def backward(fail: bool) -> None:
        h = torch.randn(8, 16, requires_grad=True)
        for index, block in enumerate(blocks):
            if fail and index == 2:
                h.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
            h = block(h)
        h.pow(2).mean().backward()

    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            backward(fail=True)
        streamer.start_step()  # as the callback does before the next step
        assert all(layer.device is None for layer in streamer.layers)
        backward(fail=False)  # and the next backward queues its own final release
        assert all(layer.device is None for layer in streamer.layers)
    finally:
        streamer.close()


def test_close_after_a_forward_that_raised_waits_for_the_copies_in_flight(transfer):
    # A forward that raises between layers leaves the next layer's copy in flight; closing gives the parameters
    # their own memory again and unpins the host buffers that copy still reads: it must wait for it first.
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    class Failing(Block):
        def forward(self, x):
            raise RuntimeError("out of memory")

    torch.manual_seed(0)
    blocks = [Block(), Block(), Failing(), Block()]
    weights = [b.frozen.weight.detach().clone() for b in blocks]
    streamer = LayerWeightStreamer(blocks, frozen_layer_parameters(blocks), torch.device("cpu"), copy_on_host=True)
    streamer.install()
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            h = torch.randn(8, 16)
            for block in blocks:
                h = block(h)
        if transfer is not None:
            assert any(stream.pending_copies() for stream in transfer.streams), "a copy is in flight at the raise"
        buffers = [layer.buffer for layer in streamer.layers]
        streamer.start_step()  # as the callback does before the next step: the unused prefetch is let go
        assert all(a is b for a, b in zip(buffers, [layer.buffer for layer in streamer.layers])), "not copied again"
        if transfer is not None:
            # still in flight: close() must wait for it
            assert any(stream.pending_copies() for stream in transfer.streams)
    finally:
        streamer.close()
    assert all(torch.equal(b.frozen.weight, w) for b, w in zip(blocks, weights))


class Unfreeze(pl.Callback):
    """A fine-tuning schedule: layer 0's frozen weight starts training at the second step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            pl_module.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)


def test_a_parameter_unfrozen_during_training_leaves_the_stream(lora_llama, transfer):
    reference = fit(clone(lora_llama), [Unfreeze()], max_steps=3)
    callback = layer_offload()
    run = fit(clone(lora_llama), [Unfreeze(), callback], max_steps=3)
    assert reference.losses == run.losses
    weight = run.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert weight.grad is not None and weight.grad.device == weight.device
    assert callback.last_step["bytes"] == 2 * (frozen_layer_bytes(lora_llama) - weight.numel() * 4)


def test_mixed_precision_without_recompute_warns(lora_llama):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(clone(lora_llama), [layer_offload()], precision="bf16-mixed")
    warned = [w for w in caught if "autocast makes a half-precision copy" in str(w.message)]
    assert len(warned) == 1 and issubclass(warned[0].category, LightningACWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(clone(lora_llama), [ActivationCheckpointing(), layer_offload()], precision="bf16-mixed")
    assert not any("autocast makes a half-precision copy" in str(w.message) for w in caught)


class QuantizedLike(nn.Parameter):
    """Stands in for a quantized weight class layer offloading does not know (not bitsandbytes' Params4bit)."""


def test_frozen_weights_it_cannot_move_are_named(lora_llama):
    model = clone(lora_llama)
    for layer in model.base_model.model.model.layers:
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, layer.self_attn.q_proj):
            weight = proj.base_layer.weight
            proj.base_layer.weight = QuantizedLike(weight.detach(), requires_grad=False)
    callback = layer_offload()
    reference = fit(clone(model), max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(model, [callback], max_steps=2)
    assert_same_training(reference, run)
    warned = [str(w.message) for w in caught if "stay on the device" in str(w.message)]
    assert len(warned) == 1 and "parameter subclasses it cannot move" in warned[0]
    assert callback.host_bytes < frozen_layer_bytes(lora_llama) / 2


def test_not_enough_host_memory_is_an_error_before_anything_moves(lora_llama):
    from lightning_ac.offload import HostMemoryError

    module = LM(clone(lora_llama))
    fingerprint = model_fingerprint(module)
    with pytest.raises(HostMemoryError, match=r"layer_offloading needs [0-9.]+ [KMG]iB of host memory"):
        make_trainer([layer_offload(host_reserve_bytes=2**60)]).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


def test_cpu_trainer_without_copy_on_host_is_a_config_error(lora_llama):
    module = LM(clone(lora_llama))
    fingerprint = model_fingerprint(module)
    with pytest.raises(ConfigError, match="layer_offloading: true needs an accelerator.*copy_on_host=True"):
        make_trainer([LayerOffload()]).fit(module, batches())
    assert model_fingerprint(module) == fingerprint


def test_compiled_layers_are_refused(lora_llama):
    model = clone(lora_llama)
    model.base_model.model.model.layers[2].compile()
    with pytest.raises(ConfigError, match=r"layer_offloading: decoder layers \[2\] are compiled"):
        make_trainer([layer_offload()]).fit(LM(model), batches())


def _compile_model(model: nn.Module) -> nn.Module:
    model.compile()
    return model


def _compile_each_layer(model: nn.Module) -> nn.Module:
    layers = model.base_model.model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i])  # torchtitan's way: the layer list holds compiled wrappers
    return model


@pytest.mark.parametrize(
    "compile_it, match",
    [
        (_compile_model, r"the model around the decoder layers \('model'\) is compiled"),
        (torch.compile, r"the model around the decoder layers \('model'\) is compiled"),
        (_compile_each_layer, r"decoder layers \[0, 1, 2, 3\] are compiled"),
    ],
    ids=["model.compile", "torch.compile(model)", "per-layer wrappers"],
)
def test_compiled_models_are_refused(lora_llama, compile_it, match):
    """A compiled graph would skip the streaming hooks while the log says the weights are streamed."""
    with pytest.raises(ConfigError, match="layer_offloading: " + match):
        make_trainer([layer_offload()]).fit(LM(compile_it(clone(lora_llama))), batches())


def test_nothing_frozen_is_a_config_error():
    module = LM(tiny_model("llama"))
    with pytest.raises(ConfigError, match="all 4 layers train every parameter.*LoRA"):
        make_trainer([layer_offload()]).fit(module, batches())
    assert not module.model.model.layers[0]._forward_pre_hooks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"copy_on_host": "yes"}, "copy_on_host"),
        ({"layers": "model.layers.*"}, "layers"),
        ({"host_reserve_bytes": -1}, "host_reserve_bytes"),
        ({"resident_layers": -1}, r"resident_layers=\.\.\.\): expected an integer >= 0"),
        ({"resident_layers": True}, "resident_layers"),
    ],
)
def test_argument_checks_in_init(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LayerOffload(**kwargs)


def test_layers_must_agree_with_activation_checkpointing(lora_llama):
    callbacks = [ActivationCheckpointing(layers=["*.layers.*"]), layer_offload(layers=["*.blocks.*"])]
    with pytest.raises(ConfigError, match="name different decoder layers"):
        make_trainer(callbacks).fit(LM(clone(lora_llama)), batches())


def test_callbacks_from_config_builds_it(caplog):
    callbacks = callbacks_from_config(True, layer_offloading=True, copy_on_host=True)
    assert [type(cb).__name__ for cb in callbacks] == ["ActivationCheckpointing", "LayerOffload"]
    assert callbacks[1].copy_on_host
    assert [type(cb).__name__ for cb in callbacks_from_config(False, layer_offloading=True)] == ["LayerOffload"]
    with pytest.raises(ConfigError, match="layer_offloading: expected true or false"):
        callbacks_from_config(True, layer_offloading="yes")


def test_one_log_line_says_what_moved(lora_llama, caplog):
    fit(clone(lora_llama), [layer_offload()])
    lines = [r.getMessage() for r in caplog.records if "layer offloading" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].endswith(
        "frozen parameters of 4/4 decoder layers (0.6 MiB) live in host memory and are copied to separate host "
        "buffers one layer at a time"
    ), lines[0]


def test_last_step_covers_the_optimizer_step_under_accumulation(lora_llama):
    callback = layer_offload()
    trainer = make_trainer([callback], max_steps=1, accumulate_grad_batches=2)
    trainer.fit(LM(clone(lora_llama)), batches())
    frozen = frozen_layer_bytes(lora_llama)
    assert callback.last_step == {"loads": 4 * LAYERS, "bytes": 4 * frozen, "max_resident_layers": 2}
    assert trainer.callback_metrics["lightning_ac/layer_offload_bytes"] == 4 * frozen


class TwoForwards(LM):
    """DPO-style: the policy runs twice (chosen, rejected) before one backward."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        half = ids.shape[0] // 2
        loss = (
            self.model(input_ids=ids[:half], labels=ids[:half]).loss
            + self.model(input_ids=ids[half:], labels=ids[half:]).loss
        )
        self.losses.append(float(loss.detach()))
        return loss


class WithReference(LM):
    """A policy and a frozen reference model (no gradient) inside one module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.reference = tiny_model("llama", seed=1).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        with torch.no_grad():
            reference_loss = self.reference(input_ids=ids, labels=ids).loss
        loss = self.model(input_ids=ids, labels=ids).loss - reference_loss
        self.losses.append(float(loss.detach()))
        return loss


@pytest.mark.parametrize("module_cls", [TwoForwards, WithReference], ids=["two_forwards", "policy_and_reference"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_multi_forward_steps_keep_two_layers(lora_llama, module_cls, checkpointing, transfer):
    reference = fit(clone(lora_llama), max_steps=2, module_cls=module_cls)
    callback = layer_offload()
    others = [ActivationCheckpointing()] if checkpointing else []
    run = fit(clone(lora_llama), [*others, callback], max_steps=2, module_cls=module_cls)
    assert_same_training(reference, run)
    assert callback.last_step["max_resident_layers"] == 2
    if transfer is not None:  # on the simulated device: the bytes on the device, not just the layers counted
        layer = sum(p.numel() * p.element_size() for p in lora_llama.base_model.model.model.layers[0].parameters())
        frozen_layer = layer - sum(
            p.numel() * p.element_size() for p in lora_llama.base_model.model.model.layers[0].parameters()
            if p.requires_grad
        )  # fmt: skip
        assert transfer.peak_bytes["layer weights"] <= 2 * frozen_layer


def test_resident_layers_stay_on_the_device(lora_llama, lora_reference, transfer):
    """The last layer's frozen weights stay put: two loads fewer per step, exact all the same."""
    callback = layer_offload(resident_layers=1, verbose=True)
    seen = {}

    class Grab(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["rows"] = callback.plan.layer_rows()

    run = fit(clone(lora_llama), [ActivationCheckpointing(), callback, Grab()], max_steps=2)
    assert_same_training(lora_reference, run)
    per_layer = frozen_layer_bytes(lora_llama) // LAYERS
    assert callback.last_step == {"loads": 2 * (LAYERS - 1), "bytes": 2 * (LAYERS - 1) * per_layer,
                                  "max_resident_layers": 2}  # fmt: skip
    assert callback.host_bytes == (LAYERS - 1) * per_layer
    assert [row.offloaded.endswith("resident on the device") for row in seen["rows"]] == [False] * 3 + [True]


def test_resident_layers_must_leave_something_to_stream(lora_llama):
    with pytest.raises(ConfigError, match=r"resident_layers=4\) keeps every one of the 4 decoder layers"):
        make_trainer([layer_offload(resident_layers=4)]).fit(LM(clone(lora_llama)), batches())


def test_callbacks_from_config_passes_resident_layers():
    (callback,) = callbacks_from_config(False, layer_offloading=True, layer_offloading_resident_layers=2)
    assert callback.request.resident_layers == 2
    with pytest.raises(ConfigError, match="resident_layers"):
        callbacks_from_config(False, layer_offloading=True, layer_offloading_resident_layers="2")


def test_a_precision_plugin_that_replaces_the_linears_is_refused(lora_llama):
    from lightning.pytorch.plugins.precision import BitsandbytesPrecision

    module = LM(clone(lora_llama))
    fingerprint = model_fingerprint(module)
    with pytest.raises(ConfigError, match="BitsandbytesPrecision replaces the model's linear layers"):
        trainer = make_trainer([layer_offload()])
        # the plugin itself refuses a CPU trainer: put it in place the way a CUDA trainer holds it
        trainer.strategy.precision_plugin = BitsandbytesPrecision(mode="nf4")
        trainer.fit(module, batches())
    assert model_fingerprint(module) == fingerprint


class CopiesTheModule(pl.Callback):
    """A deep copy of the module during the run, converted (as StochasticWeightAveraging does with its copy)."""

    def on_train_start(self, trainer, pl_module):
        self.copy = copy.deepcopy(pl_module).double()


def test_a_copy_of_the_module_is_its_own_and_converts_alone(lora_llama):
    module = LM(clone(lora_llama))
    spy = CopiesTheModule()
    make_trainer([layer_offload(), spy], max_steps=1).fit(module, batches())
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad and ".layers." in n]
    assert {dict(module.named_parameters())[n].dtype for n in frozen} == {torch.float32}, "the original is untouched"
    assert {dict(spy.copy.named_parameters())[n].dtype for n in frozen} == {torch.float64}, "the copy converted"


def test_a_parameter_unfrozen_since_install_is_converted_with_its_module():
    from lightning_ac.offload.weights import LayerWeightStreamer, frozen_layer_parameters

    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(2))).requires_grad_(False)
    streamer = LayerWeightStreamer(list(blocks), frozen_layer_parameters(list(blocks)), torch.device("cpu"),
                                   copy_on_host=True)  # fmt: skip
    streamer.install()
    try:
        blocks[0].weight.requires_grad_(True)
        blocks(torch.randn(1, 4))  # the load sees it train: it leaves the stream
        before = [b.weight.detach().clone() for b in blocks]
        blocks._apply(lambda t: t.add(1))  # a conversion: the unfrozen weight takes part, the streamed one sits out
        assert torch.equal(blocks[0].weight, before[0] + 1)
        assert torch.equal(blocks[1].weight, before[1])
    finally:
        streamer.close()
