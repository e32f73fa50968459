"""The step's memory measurement on the CPU prints nothing of torch's own (issue 57, item 17): the README's first
command printed torch's "The module hierarchy tracking maybe be messed up" in the middle of its output, because
torch's module tracker named two different modules alike (see ``lightning_ac.memory._distinct_root_names``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import fit, tiny_model

from lightning_ac import callbacks_from_config
from lightning_ac.bench.memory import StepMetrics
from lightning_ac.memory import measure_step

MESSED_UP = "module hierarchy tracking"


def _torch_tracker_warnings(caught) -> list:
    return [str(w.message) for w in caught if MESSED_UP in str(w.message)]


class _Dispatch(torch.nn.Module):
    """transformers' ``kernels`` wrapper in small: one module outside any model's tree that hands each call on to
    another module of its class, also outside the tree (the attention's private copy)."""

    def __init__(self, inner: _Dispatch | None = None) -> None:
        super().__init__()
        self.__dict__["inner"] = inner  # not a submodule, as kernels keeps it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if self.inner is not None else torch.sin(x) * x


_GLOBAL = _Dispatch(_Dispatch())


class _Model(torch.nn.Module):
    def __init__(self, through_global: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.through_global = through_global
        self.__dict__["private"] = _GLOBAL.inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return self.linear(_GLOBAL(h) if self.through_global else self.private(h))


def test_modules_of_one_class_outside_the_model_nested_in_a_step_are_measured_without_torchs_warning():
    peaks = []
    for through_global in (True, False):
        torch.manual_seed(0)
        model = _Model(through_global)
        x = torch.randn(32, 64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with measure_step([model], [], torch.device("cpu")) as measurement:
                model(x).sum().backward()
        assert not _torch_tracker_warnings(caught)
        peaks.append(measurement.result.activation_bytes)
    assert peaks[0] > 0 and peaks[0] == peaks[1], "the same computation, with or without the wrapper: the same peak"


@pytest.mark.parametrize("block", [{"enabled": True}, {"enabled": False}], ids=["full", "off"])
def test_the_main_jobs_measured_step_prints_no_warning_of_torchs_module_tracker(block):
    """The README's first command in small: a LoRA Llama, full checkpointing (and off), the step measured by the
    main job's StepMetrics, in a real Trainer."""
    model = tiny_model("llama", lora=True)
    attentions = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    if not getattr(attentions[0], "_kernel_funcs", None):
        pytest.skip("this transformers has no kernels wrapper around the attention: nothing nests a second Func")
    metrics = StepMetrics(measure_step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [*callbacks_from_config(block), metrics], max_steps=3)
    assert not _torch_tracker_warnings(caught)
    assert metrics.peak is not None and metrics.peak.activation_bytes > 0
