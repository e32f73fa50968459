"""ActivationOffload on CPU with copy_on_host: exact gradients, counted transfers, nothing left behind."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
from conftest import (
    BATCH,
    LM,
    SEQ,
    assert_same_training,
    batches,
    clone,
    fit,
    make_trainer,
    model_fingerprint,
    tiny_model,
)
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_ac import ActivationCheckpointing, ActivationOffload, ConfigError, LightningACWarning
from lightning_ac.offload import HostMemoryError, TransferEngine
from lightning_ac.offload.activations import SavedTensorOffloader
from lightning_ac.offload.copies import InFlight

HIDDEN = 64
LAYER_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # fp32


@pytest.fixture(scope="module")
def llama_reference():
    base = tiny_model("llama")
    return base, fit(clone(base))


@pytest.mark.parametrize(
    "checkpointing, offload, expected",
    [
        # one layer input per checkpointed layer: tensors == layers, bytes == layers * B * S * H * itemsize
        ({}, {"hidden_states": "cpu"}, {"hidden_states": (4, 4 * LAYER_INPUT_BYTES)}),
        ({"reentrant": True}, {"hidden_states": "cpu"}, {"hidden_states": (4, 4 * LAYER_INPUT_BYTES)}),
        ({"kwargs": {"every_n_layers": 2}}, {"hidden_states": "cpu"}, {"hidden_states": (2, 2 * LAYER_INPUT_BYTES)}),
        # SDPA on CPU returns (output, logsumexp): 2 saved tensors per layer
        (
            {"selective": True},
            {"hidden_states": "cpu", "selective": "cpu"},
            {
                "hidden_states": (4, 4 * LAYER_INPUT_BYTES),
                "selective": (8, 4 * (LAYER_INPUT_BYTES + BATCH * 4 * SEQ * 4)),
            },
        ),
        ({"selective": True}, {"selective": "cpu"}, {"selective": (8, 4 * (LAYER_INPUT_BYTES + BATCH * 4 * SEQ * 4))}),
        ({}, {"all": "cpu", "min_offload_bytes": 0}, {"all": None}),
        (
            {"selective": True},
            {"all": "cpu", "selective": "cpu", "min_offload_bytes": 0},
            {"all": None, "selective": (8, None)},
        ),
        (None, {"all": "cpu", "min_offload_bytes": 0}, {"all": None}),
    ],
)
def test_gradients_identical_and_counts(llama_reference, checkpointing, offload, expected, transfer):
    base, reference = llama_reference
    callback = ActivationOffload(copy_on_host=True, **offload)
    callbacks = ([ActivationCheckpointing(**checkpointing)] if checkpointing is not None else []) + [callback]
    run = fit(clone(base), callbacks)
    assert_same_training(reference, run)
    for target in ("hidden_states", "selective", "all"):
        stats = callback.last_step[target]
        if target not in expected:
            assert stats == {"tensors": 0, "bytes": 0}, target
            continue
        want = expected[target]
        if want is None:
            assert stats["tensors"] > 0 and stats["bytes"] > 0
            continue
        tensors, nbytes = want
        assert stats["tensors"] == tensors, (target, stats)
        if nbytes is not None:
            assert stats["bytes"] == nbytes, (target, stats)


def test_all_with_recompute_moves_layer_inputs_and_outside_saves_only(llama_reference, transfer):
    base, reference = llama_reference
    with_recompute = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    without = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    fit(clone(base), [ActivationCheckpointing(), with_recompute])
    fit(clone(base), [without])
    # recompute keeps the layers' insides out of the saved set: far fewer tensors move
    assert 4 <= with_recompute.last_step["all"]["tensors"] < without.last_step["all"]["tensors"] / 3


def test_output_head_stays_on_device(llama_reference, transfer):
    base, _ = llama_reference
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            offloader = callback.plan.activation_offload.all
            head = pl_module.model.lm_head
            head.register_forward_pre_hook(lambda *a: seen.append(offloader.paused))

    callback = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    fit(clone(base), [Probe(), callback])
    assert seen == [1]


class OutsideLossLM(LM):
    """Computes the loss outside the model, from its logits, as many training steps do."""

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("module_cls", [LM, OutsideLossLM], ids=["loss_in_the_model", "loss_in_the_step"])
@pytest.mark.parametrize("recompute", [False, True], ids=["no_recompute", "full"])
def test_the_logits_and_the_loss_over_them_stay_on_device(transfer, module_cls, recompute):
    """Nothing of the vocabulary's size moves: the logits, their float32 upcast and the log-softmax of the loss are
    read first thing in backward."""
    vocab = 1000  # no other dimension of the tiny model has this size
    base = tiny_model("llama", lora=True, vocab_size=vocab)
    moved = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            engine = callback.plan.activation_offload.engine
            pack = engine.pack

            def recording_pack(tensor, target):
                moved.append(tuple(tensor.shape))
                return pack(tensor, target)

            engine.pack = recording_pack

    callback = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    reference = fit(clone(base), module_cls=module_cls)
    run = fit(
        clone(base), [*([ActivationCheckpointing()] if recompute else []), callback, Record()], module_cls=module_cls
    )
    assert_same_training(reference, run)
    assert callback.last_step["all"]["tensors"] > 0
    assert [shape for shape in moved if shape[-1:] == (vocab,)] == []


def test_a_head_called_outside_a_step_pauses_nothing_of_the_next():
    """Validation calls the head too: the next training step offloads from its start."""
    offloader = SavedTensorOffloader(TransferEngine(torch.device("cpu"), copy_on_host=True), "all")
    head = torch.nn.Linear(2, 2)
    handle = offloader.pause_from(head)
    head(torch.ones(1, 2))  # a validation step
    assert offloader.paused
    offloader.push()
    assert not offloader.paused
    offloader.pop()
    handle.remove()


def test_lora_and_reentrant_with_hidden_states(transfer):
    base = tiny_model("llama", lora=True)
    reference = fit(clone(base))
    for reentrant in (False, True):
        callback = ActivationOffload(hidden_states="cpu", copy_on_host=True)
        run = fit(clone(base), [ActivationCheckpointing(reentrant=reentrant), callback])
        assert_same_training(reference, run)
        assert callback.last_step["hidden_states"]["tensors"] == 4


def test_every_step_and_closure_are_offloaded(llama_reference, transfer):
    base, _ = llama_reference

    class Counting(LM):
        def configure_optimizers(self):
            return torch.optim.LBFGS([p for p in self.parameters() if p.requires_grad], max_iter=3)

    callback = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    module = Counting(clone(base))
    make_trainer([ActivationCheckpointing(), callback], max_steps=2).fit(module, batches())
    # LBFGS evaluates the closure several times a step: each forward's layer inputs are offloaded
    assert callback.last_step["hidden_states"]["tensors"] > 4
    assert callback.last_step["hidden_states"]["tensors"] % 4 == 0


def test_inactive_outside_training(llama_reference, transfer):
    base, _ = llama_reference
    callback = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    module = LM(clone(base))
    module.validation_step = lambda batch, batch_idx: module.model(input_ids=batch[0], labels=batch[0]).loss
    trainer = make_trainer([callback])
    trainer.validate(module, batches(), verbose=False)
    assert callback.last_step["all"] == {"tensors": 0, "bytes": 0}


class Boom(pl.Callback):
    def on_after_backward(self, trainer, pl_module):
        raise RuntimeError("boom")


def test_nothing_left_pushed_after_exception(llama_reference, transfer):
    base, _ = llama_reference
    module = LM(clone(base))
    fingerprint = model_fingerprint(module)
    callback = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)

    with pytest.raises(RuntimeError, match="boom"):
        make_trainer([callback, Boom()]).fit(module, batches())
    assert model_fingerprint(module) == fingerprint
    # no saved-tensor hooks of ours are left on the stack: a plain forward saves real tensors
    x = torch.ones(3, requires_grad=True)
    y = x.sin()
    assert torch.equal(y.grad_fn._saved_self, x)


class SkipsTheRestOfTheEpoch(LM):
    """Lightning's on_train_batch_start returning -1: the batch is not trained and the epoch ends."""

    def __init__(self, model):
        super().__init__(model)
        self.hooked: dict = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.hooked[f"batch {batch_idx} start"] = _saved_tensor_hooks_active()
        return -1 if batch_idx == 1 else None

    def on_train_epoch_end(self):
        self.hooked["epoch end"] = _saved_tensor_hooks_active()

    def validation_step(self, batch, batch_idx):
        self.hooked["validation"] = _saved_tensor_hooks_active()


def _saved_tensor_hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_hooks_are_in_force_only_during_the_training_step(llama_reference, transfer):
    base, _ = llama_reference
    module = SkipsTheRestOfTheEpoch(clone(base))
    callback = ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)
    make_trainer([callback], max_steps=3, max_epochs=1, limit_val_batches=1).fit(module, batches(), batches())
    assert len(module.losses) == 1, "batch 0 trained, batch 1 skipped the rest of the epoch"
    assert module.hooked == {"batch 0 start": False, "batch 1 start": False, "epoch end": False, "validation": False}
    assert callback.last_step["all"]["tensors"] > 0


def test_cpu_trainer_without_copy_on_host_does_nothing(llama_reference, caplog):
    base, reference = llama_reference
    callback = ActivationOffload(hidden_states="cpu")
    run = fit(clone(base), [ActivationCheckpointing(), callback])
    assert_same_training(reference, run)
    assert callback.last_step["hidden_states"] == {"tensors": 0, "bytes": 0}
    notices = [r.getMessage() for r in caplog.records if "does nothing on a CPU-only trainer" in r.getMessage()]
    assert len(notices) == 1
    # the fix in the terms of both routes: the Python argument, and the Hydra job's key
    assert "ActivationOffload(copy_on_host=True) (Hydra: offload_copy_on_host=true)" in notices[0], notices[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden_states": "cpu", "all": "cpu"}, "cannot be combined"),
        ({"all": "disk"}, "pending a fix"),
        ({"all": "gpu"}, "all"),
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"copy_on_host": "yes"}, "copy_on_host"),
    ],
)
def test_argument_checks(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ActivationOffload(**kwargs)


@pytest.mark.parametrize("offload", [{"hidden_states": "cpu"}, {"selective": "cpu"}])
def test_targets_that_need_checkpointing(llama_reference, offload):
    base, _ = llama_reference
    with pytest.raises(ConfigError, match="no ActivationCheckpointing"):
        fit(clone(base), [ActivationOffload(copy_on_host=True, **offload)])


def test_selective_offload_needs_selective(llama_reference):
    base, _ = llama_reference
    with pytest.raises(ConfigError, match="needs selective"):
        fit(clone(base), [ActivationCheckpointing(), ActivationOffload(selective="cpu", copy_on_host=True)])


def test_offload_metrics_are_logged(llama_reference):
    base, _ = llama_reference
    callback = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    module = LM(clone(base))
    trainer = make_trainer([ActivationCheckpointing(), callback])
    trainer.fit(module, batches())
    assert trainer.callback_metrics["lightning_ac/offload_bytes"] == 4 * LAYER_INPUT_BYTES
    assert trainer.callback_metrics["lightning_ac/offload_hidden_states_bytes"] == 4 * LAYER_INPUT_BYTES


# -- the engine on its own --------------------------------------------------------------------------------


def roundtrip(engine: TransferEngine, tensors):
    engine.start_step()
    packed = [engine.pack(t, "all") for t in tensors]
    out = [engine.unpack(p) for p in reversed(packed)][::-1]
    engine.finish_step()
    return out


@pytest.fixture
def engine(transfer):
    return TransferEngine(torch.device("cpu"), copy_on_host=True)


def test_engine_views_offsets_and_strides(engine):
    base = torch.arange(60.0).reshape(6, 10)
    cases = [base, base[2:4], base[:, 3:7], base.t(), base[1:, ::3], base.reshape(3, 20)[1], base.permute(1, 0)[2:]]
    out = roundtrip(engine, cases)
    for original, back in zip(cases, out):
        assert torch.equal(original, back)
        assert back.stride() == original.stride()
        assert back.data_ptr() != original.data_ptr(), "a real copy"


def test_engine_broadcast_is_not_materialised(engine):
    row = torch.arange(8.0)
    wide = row.expand(1000, 8)  # stride 0: 8 floats, not 8000
    (back,) = roundtrip(engine, [wide])
    assert torch.equal(back, wide) and back.stride() == (0, 1)
    assert engine.last_step["all"] == {"tensors": 1, "bytes": 32}


def test_engine_shared_storage_moves_once(engine):
    base = torch.arange(100.0)
    views = [base, base[10:20], base.view(10, 10)[3], base]
    out = roundtrip(engine, views)
    assert all(torch.equal(a, b) for a, b in zip(views, out))
    assert engine.last_step["all"] == {"tensors": 1, "bytes": 400}
    # the copies share their storage on the way back too
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1


def test_engine_reused_address_is_not_mistaken_for_the_same_storage(engine):
    engine.start_step()
    first = torch.full((256,), 1.0)
    packed_first = engine.pack(first, "all")
    del first  # its memory may be handed to the next tensor of the same size
    second = torch.full((256,), 2.0)
    packed_second = engine.pack(second, "all")
    assert torch.equal(engine.unpack(packed_second), torch.full((256,), 2.0))
    assert torch.equal(engine.unpack(packed_first), torch.full((256,), 1.0))
    engine.finish_step()
    assert engine.last_step["all"]["tensors"] == 2


def test_engine_skips_parameters_buffers_and_small_tensors(engine):
    linear = torch.nn.Linear(4, 4)
    storage = linear.weight.untyped_storage()
    engine.skip_storages[storage.data_ptr()] = StorageWeakRef(storage)
    assert engine.should_skip(linear.weight)
    assert engine.should_skip(linear.weight.t()), "a view of a parameter is the parameter"
    assert engine.should_skip(torch.ones(4), min_bytes=1024)
    assert not engine.should_skip(torch.ones(4))


def test_engine_skip_ends_when_the_parameter_storage_is_freed(engine):
    # A parameter whose data moved (layer offloading) frees its storage; a new activation may get the address.
    weight = torch.nn.Parameter(torch.ones(64))
    stale = StorageWeakRef(weight.untyped_storage())
    weight.data = torch.zeros(64)
    activation = torch.ones(64)
    engine.skip_storages[activation.untyped_storage().data_ptr()] = stale  # as if the address were reused
    assert stale.expired() and not engine.should_skip(activation)


def test_engine_host_memory_error_before_oom(engine, monkeypatch):
    # as if the host had 1500 bytes left before the step: MemAvailable falls by what the engine holds (on the simulated
    # device, a pinned arena of 1 KiB: the copy's 800 bytes in 512-byte slices)
    monkeypatch.setattr("lightning_ac.offload.host_pool.host_limit", lambda reserve: 1500 - engine.host.held_bytes)
    engine.start_step()
    held = engine.pack(torch.ones(200), "all")  # noqa: F841 - held as autograd holds it
    # small sizes in units that show them (they read "0.0 GiB ... 0.0 GiB" before)
    pattern = r"needs (800 B|1.00 KiB) more host memory, but only (700|476) B is available"
    with pytest.raises(HostMemoryError, match=pattern) as raised:
        engine.pack(torch.ones(200), "all")
    assert "This step has moved 1.56 KiB in 2 tensors so far, and offloading holds" in str(raised.value)


@pytest.mark.parametrize(
    "checkpointing, offload, fix",
    [
        (
            {"selective": True},
            {"selective": "cpu"},
            "(offload.selective off, or fewer activation_checkpointing.selective",
        ),
        ({}, {"hidden_states": "cpu"}, "(offload.hidden_states off)"),
        ({"selective": True}, {"all": "cpu", "selective": "cpu"}, "(offload.hidden_states instead of offload.all; or "),
        # without checkpointing, offload.hidden_states alone would be refused: the advice says to turn it on
        (
            None,
            {"all": "cpu", "min_offload_bytes": 0},
            "(activation checkpointing on, with offload.hidden_states instead of offload.all",
        ),
    ],
)
def test_host_memory_error_names_the_targets_in_force(llama, checkpointing, offload, fix):
    # It said "offload.hidden_states instead of offload.all" whichever targets were on.
    # a reserve larger than any host leaves no room: the first offloaded tensor raises
    offloading = ActivationOffload(copy_on_host=True, host_reserve_bytes=2**60, **offload)
    checkpoints = [] if checkpointing is None else [ActivationCheckpointing(**checkpointing)]
    with pytest.raises(HostMemoryError, match="of host memory") as raised:
        fit(llama, [*checkpoints, offloading])
    message = str(raised.value)
    assert fix in message, message
    assert ("offload.all" in message) == ("all" in offload), message


def test_engine_detects_an_edit_racing_the_copy():
    engine = TransferEngine(torch.device("cpu"), copy_on_host=True)

    class Pending:
        def query(self):
            return False

        def synchronize(self):
            pass

    engine.start_step()
    saved = torch.ones(4)
    packed = engine.pack(saved, "all")
    engine._stash_push(InFlight(Pending(), saved, saved, saved._version, packed.copy, None))
    saved.mul_(2)  # the compute stream edits it while the (pretend) copy still reads it
    engine.finish_step()
    with pytest.raises(RuntimeError, match="edited in place while it was being copied"):
        engine.unpack(packed, check_version=False)  # selective checkpointing's storage: SAC checks the version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        engine.unpack(packed)


def test_in_place_edit_after_save_does_not_reuse_a_stale_copy(transfer):
    torch.manual_seed(0)
    x, w, w2 = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def step(offload: bool):
        w.grad = w2.grad = None
        engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
        hooks = SavedTensorOffloader(engine, "all").hooks() if offload else contextlib.nullcontext()
        engine.start_step()
        with hooks:
            h = x @ w
            (h * h).mean()  # saves h (version 0), never backpropagated
            h.relu_()  # edits h in place: the next save must not reuse the copy above
            loss = (h @ w2).sum()
        loss.backward()
        engine.finish_step()
        return w.grad.clone(), w2.grad.clone()

    for plain, offloaded in zip(step(False), step(True)):
        assert torch.equal(plain, offloaded)


def test_engine_skips_empty_conj_and_subclass_tensors(engine):
    assert engine.should_skip(torch.randn(10)[10:])
    assert engine.should_skip(torch.randn(4, dtype=torch.complex64).conj())
    assert engine.should_skip(torch.nn.Parameter(torch.ones(4)))


def test_parameter_skips_follow_the_module_to_its_storage():
    from lightning_ac.config import ActivationOffloadRequest, OffloadConfig
    from lightning_ac.offload import ActivationOffloadRuntime

    linear = torch.nn.Linear(4, 4)
    request = ActivationOffloadRequest(OffloadConfig(all="cpu"), copy_on_host=True)
    runtime = ActivationOffloadRuntime(request, torch.device("cpu"))
    runtime.install(linear)
    linear.weight.data = linear.weight.data.clone()  # as a strategy moving the module to its device does
    runtime.start_step()
    assert runtime.engine.should_skip(linear.weight.detach().t())
    runtime.finish_step()


def test_offload_bytes_in_the_progress_bar_when_asked(llama_reference):
    base, _ = llama_reference
    for prog_bar in (False, True):
        module = LM(clone(base))
        trainer = make_trainer(
            [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", copy_on_host=True, prog_bar=prog_bar)]
        )
        trainer.fit(module, batches())
        assert ("lightning_ac/offload_bytes" in trainer.progress_bar_metrics) is prog_bar


def test_last_step_covers_the_optimizer_step_under_accumulation(llama_reference):
    """Lightning's step is the optimizer step: with two micro-batches per step, twice the layer inputs move."""
    base, _ = llama_reference
    callback = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    trainer = make_trainer([ActivationCheckpointing(), callback], max_steps=1, accumulate_grad_batches=2)
    trainer.fit(LM(clone(base)), batches())
    assert callback.last_step["hidden_states"] == {"tensors": 8, "bytes": 8 * LAYER_INPUT_BYTES}
    assert trainer.callback_metrics["lightning_ac/offload_bytes"] == 8 * LAYER_INPUT_BYTES


def test_callbacks_can_be_copied_and_pickled_during_a_run(llama_reference):
    """Loggers, the LR finder and user code deep-copy callbacks; a copy during a run crashed the process (the
    engine's storage references were duplicated). A copy holds the arguments and figures, not the run's plan."""
    import copy
    import pickle

    base, reference = llama_reference
    suite = [ActivationCheckpointing(), ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0)]
    copies = []

    class CopyDuringRun(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            for callback in suite:
                assert callback.plan is not None
                copies.append(copy.deepcopy(callback))
                copies.append(pickle.loads(pickle.dumps(callback)))

    run = fit(clone(base), [*suite, CopyDuringRun()])
    assert_same_training(reference, run)
    assert len(copies) == 4 and all(c.plan is None for c in copies)
    assert copies[2].request == suite[1].request and copies[2].last_step == suite[1].last_step


def test_an_offload_callback_without_a_target_says_so(llama_reference):
    base, _ = llama_reference
    with pytest.warns(LightningACWarning, match=r"ActivationOffload\(\) has no target, so nothing is offloaded"):
        fit(clone(base), [ActivationOffload(copy_on_host=True)])
