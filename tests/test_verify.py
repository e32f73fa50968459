"""Verify mode: the first optimizer steps run twice, the reference with synchronous transfers, and must match.

On the simulated asynchronous device the configured run is as asynchronous as it can be (copies land only when
waited for), so these tests check that verify passes with the real engines, that it catches a fault injected at
the device seam (a wait skipped, a copy's source released early) and names the transfer, and that the verified
run trains exactly as a run without verify.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import LM, batches, clone, fit, make_trainer, tiny_model

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    OffloadVerificationError,
    callbacks_from_config,
)
from lightning_ac.testing.simulated import SimulatedDevice

pytestmark = pytest.mark.simulated

MODES = {
    "hidden_states": lambda v: [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", copy_on_host=True,
                                                                             verify_steps=v)],
    "selective": lambda v: [ActivationCheckpointing(selective=True),
                            ActivationOffload(hidden_states="cpu", selective="cpu", copy_on_host=True, verify_steps=v)],
    "all": lambda v: [ActivationOffload(all="cpu", copy_on_host=True, min_offload_bytes=0, verify_steps=v)],
    "layers": lambda v: [ActivationCheckpointing(), LayerOffload(copy_on_host=True, verify_steps=v)],
    "layers_and_hidden_states": lambda v: [ActivationCheckpointing(),
                                           ActivationOffload(hidden_states="cpu", copy_on_host=True, verify_steps=v),
                                           LayerOffload(copy_on_host=True)],
}  # fmt: skip


@pytest.fixture(scope="module")
def lora_llama():
    return tiny_model("llama", lora=True)


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize(
    "mode, accumulate",
    [(mode, 1) for mode in MODES] + [("layers_and_hidden_states", 2)],
    ids=list(MODES) + ["layers_and_hidden_states-accumulated"],
)
def test_verify_passes_and_changes_nothing_it_checks(lora_llama, mode, accumulate, caplog):
    kwargs = dict(max_steps=3, accumulate_grad_batches=accumulate)
    with SimulatedDevice() as plain_sim:
        plain = fit(clone(lora_llama), MODES[mode](0), **kwargs)
    with SimulatedDevice() as sim:
        verified = fit(clone(lora_llama), MODES[mode](2), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(_params(plain), _params(verified))), "the same training"
    assert plain.grads.keys() == verified.grads.keys()
    assert all(torch.equal(plain.grads[n], verified.grads[n]) for n in plain.grads)
    assert "lightning_ac: verified 2 steps: gradients bit-identical to synchronous transfers (" in caplog.text
    # the reference pass ran training_step once more per verified micro-batch (LM records each call's loss)
    assert len(verified.losses) == len(plain.losses) + 2 * accumulate
    for kind, peak in sim.peak_bytes.items():
        assert peak <= plain_sim.peak_bytes[kind], f"{kind}: never more device memory than the configured run"


@pytest.mark.parametrize("fault", ["skip_wait", "early_release"])
@pytest.mark.parametrize(
    "mode, named", [("hidden_states", "with offload.hidden_states in force"), ("layers", "layer offloading in force")]
)
def test_an_injected_fault_is_caught_before_the_optimizer_steps(lora_llama, fault, mode, named):
    module = LM(clone(lora_llama))
    before = _params(module)
    with SimulatedDevice(faults=[fault]) as sim:
        with pytest.raises(OffloadVerificationError) as info:
            make_trainer(MODES[mode](1), max_steps=2).fit(module, batches())
    assert fault not in sim.faults, "the fault was injected"
    message = str(info.value)
    assert message.startswith("verify: optimizer step 0 (batch 0): the ") and named in message
    # the first difference found: the loss (poison reached it) or, when the loss still matches, a gradient
    assert "the loss is nan" in message or "differs by up to" in message, message
    assert "report it" in message and "off meanwhile" in message
    assert all(torch.equal(a, b) for a, b in zip(before, _params(module))), "the optimizer did not step"


class Manual(LM):
    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.optimizers().step()
        self.optimizers().zero_grad()


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: ActivationOffload(hidden_states="cpu", verify_steps=-1),
            r"verify_steps=\.\.\.\): expected an integer",
        ),
        (lambda: LayerOffload(verify_steps=True), r"LayerOffload\(verify_steps=\.\.\.\): expected an integer >= 0"),
        (lambda: LayerOffload(verify_atol="small"), r"verify_atol=\.\.\.\): expected a number >= 0"),
        (lambda: ActivationOffload(all="cpu", verify_atol=-1e-6), r"expected a number >= 0.*bit for bit"),
    ],
)
def test_arguments_are_checked(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_manual_optimization_is_refused(lora_llama):
    module = Manual(clone(lora_llama))
    with pytest.raises(ConfigError, match="optimizes manually"):
        make_trainer(MODES["hidden_states"](1)).fit(module, batches())


def test_nothing_transferred_says_so(lora_llama, caplog):
    """On a CPU trainer without copy_on_host activation offloading does nothing, so verify has nothing to check."""
    fit(clone(lora_llama), [ActivationCheckpointing(), ActivationOffload(hidden_states="cpu", verify_steps=1)])
    assert "verify mode: nothing is transferred in this run" in caplog.text


def test_callbacks_from_config_passes_verify_steps():
    callbacks = callbacks_from_config(
        {"offload": {"hidden_states": "cpu"}}, layer_offloading=True, copy_on_host=True, verify_steps=3
    )
    assert [cb.request.verify_steps for cb in callbacks[1:]] == [3, 3]


class Skips(pl.Callback):
    """Lightning's loggers and LR schedulers do not see the reference pass: one logged value per real step."""

    def __init__(self):
        self.logged = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


class Logs(LM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_loggers_and_schedulers_see_the_real_step_only(lora_llama):
    def run(verify_steps):
        module, probe = Logs(clone(lora_llama)), Skips()
        with SimulatedDevice():
            trainer = make_trainer([*MODES["hidden_states"](verify_steps), probe], max_steps=3)
            trainer.fit(module, batches())
        return probe.logged, trainer.lr_scheduler_configs[0].scheduler.last_epoch, _params(module)

    plain, verified = run(0), run(2)
    assert plain[0] == verified[0] and len(plain[0]) == 3
    assert plain[1] == verified[1] == 3, "the scheduler stepped once per optimizer step"
    assert all(torch.equal(a, b) for a, b in zip(plain[2], verified[2]))


class Unusual(LM):
    """What Lightning allows and verify must take as it comes: a training_step without batch_idx that skips some
    batches (returns None), state set in on_train_batch_start, a buffer the step reassigns, and an optimizer over
    some trainable parameters only (zero_grad clears those alone)."""

    def __init__(self, model):
        super().__init__(model)
        self.scale = 1.0
        self.register_buffer("calls", torch.zeros(()))

    def on_train_batch_start(self, batch, batch_idx):
        self.scale = 1.0 + batch_idx  # the reference pass must see it

    def training_step(self, batch):
        self.calls = self.calls + 1  # reassigned, not changed in place
        if len(self.losses) % 5 == 4:
            self.losses.append(float("nan"))
            return None  # skip
        return super().training_step(batch, 0) * self.scale

    def configure_optimizers(self):
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        return torch.optim.SGD([p for n, p in named if "lora_B" in n], lr=self.lr)


def test_what_lightning_allows_is_verified_as_it_comes(lora_llama):
    with SimulatedDevice():
        plain = fit(clone(lora_llama), MODES["hidden_states"](0), max_steps=3, module_cls=Unusual)
    with SimulatedDevice():
        verified = fit(clone(lora_llama), MODES["hidden_states"](3), max_steps=3, module_cls=Unusual)
    assert all(torch.equal(a, b) for a, b in zip(_params(plain), _params(verified)))
    assert float(verified.calls) == float(plain.calls), "the buffer as the real steps left it, the reference undone"


def test_a_resumed_run_verifies_its_own_first_steps(lora_llama, tmp_path, caplog):
    """Verify mode is for a job moved to a new machine, which resumes from its checkpoint: the first steps of that
    run are verified, counted from where it starts (a fault injected there is caught)."""
    with SimulatedDevice():
        make_trainer(MODES["hidden_states"](0), max_steps=2, default_root_dir=tmp_path, enable_checkpointing=True).fit(
            LM(clone(lora_llama)), batches()
        )
    ckpt = next(tmp_path.rglob("*.ckpt"))
    caplog.clear()
    with SimulatedDevice():
        resumed = LM(clone(lora_llama))
        make_trainer(MODES["hidden_states"](1), max_steps=3, default_root_dir=tmp_path).fit(
            resumed, batches(), ckpt_path=ckpt
        )
    assert "lightning_ac: verified 1 step: gradients bit-identical" in caplog.text
    assert len(resumed.losses) == 2, "step 2 ran twice: the reference pass and the real one"
    with SimulatedDevice(faults=["skip_wait"]):
        with pytest.raises(OffloadVerificationError, match="verify: optimizer step 2 "):
            make_trainer(MODES["hidden_states"](1), max_steps=3, default_root_dir=tmp_path).fit(
                LM(clone(lora_llama)), batches(), ckpt_path=ckpt
            )


class NaNLoss(LM):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * float("nan")


def test_identical_nans_match_and_a_diverged_reference_is_not_blamed_on_the_transfers(lora_llama, caplog):
    # the loss is NaN in the reference too, bit for bit the same: verify passes (and the run trains on NaN, as it
    # would without verify mode)
    with SimulatedDevice():
        make_trainer(MODES["hidden_states"](1), max_steps=1).fit(NaNLoss(clone(lora_llama)), batches())
    assert "lightning_ac: verified 1 step: gradients bit-identical" in caplog.text
    # a fault on top of a diverged reference: the message says the training diverged, not that the transfers raced
    with SimulatedDevice(faults=["skip_wait"]):
        with pytest.raises(OffloadVerificationError) as info:
            make_trainer(MODES["hidden_states"](1), max_steps=1).fit(NaNLoss(clone(lora_llama)), batches())
    message = str(info.value)
    assert "is not finite itself, so the training diverged" in message and "raced" not in message, message
