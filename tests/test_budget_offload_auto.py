"""``offload.hidden_states: auto`` beside a memory budget: the budget decides per decoder layer whether its input goes
to host memory, on the simulated asynchronous device (the engines' accelerator branch; its pinned host memory is not the
device's, and a step's measured peak leaves it out, as a CUDA allocator does).

The oracles: the peak of a step measured by StepMetrics (MemTracker, a measurement of its own), the offload engine's
own count of what it moved, gradients bit-identical to an unmodified run, and the inputs' bytes computed from the
model's shape.
"""

from __future__ import annotations

import pytest
from test_budget_mode import assert_exact, loader, train

import lightning_ac.offload.device as offload_device
from lightning_ac import ActivationCheckpointing, ActivationOffload, ConfigError
from lightning_ac.budget import Choice
from lightning_ac.config import parse_config

pytestmark = pytest.mark.simulated

LAYERS, SEQ, HIDDEN, BATCH = 6, 256, 256, 2
INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # one decoder layer's input, float32
STEPS = 9


def data():
    return loader(seqs=(SEQ,) * (STEPS + 2))


@pytest.fixture(scope="module")
def runs():
    """The base model, an unmodified run, and the measured peaks of every layer recomputed with and without every input
    in host memory, on the simulated device."""
    from test_budget_mode import tiny_model

    from lightning_ac.testing.simulated import SimulatedDevice

    base = tiny_model(
        "llama", hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, max_position_embeddings=512
    )
    off, _, _, _ = train(base, steps=STEPS, measure_step=STEPS - 1, data=data())
    with SimulatedDevice():
        _, full, _, _ = train(base, [ActivationCheckpointing()], data=data())
        offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
        _, offloaded, _, _ = train(base, [ActivationCheckpointing(), offload], data=data())
    assert offload.last_step["hidden_states"]["bytes"] == LAYERS * INPUT_BYTES
    assert offloaded < full - INPUT_BYTES, "offloading every input lowers the measured peak on the simulated device"
    return {"base": base, "off": off, "full": full, "offloaded": offloaded}


def run_auto(runs, budget, **offload_args):
    from lightning_ac.testing.simulated import SimulatedDevice

    offload = ActivationOffload(hidden_states="auto", copy_on_host=True, **offload_args)
    with SimulatedDevice():
        run, peak, probe, trainer = train(
            runs["base"],
            [ActivationCheckpointing(budget=budget), offload],
            steps=STEPS,
            measure_step=STEPS - 1,
            data=data(),
        )
    return run, peak, probe, offload


def test_a_budget_only_offloading_meets_settles_under_it_with_inputs_in_host_memory(runs, caplog):
    budget = (runs["full"] + runs["offloaded"]) // 2  # under every layer recomputed: recompute alone cannot meet it
    run, peak, probe, offload = run_auto(runs, budget)
    assert_exact(runs["off"], run)
    final = probe.choices[-1]
    offloaded = final.count(Choice.offload)
    assert probe.budget.settled and peak <= budget, (peak, budget, final)
    assert 0 < offloaded < LAYERS, final
    # the engine moved what the plan chose: one input per offloaded layer, and nothing for the others
    assert offload.last_step["hidden_states"] == {"tensors": offloaded, "bytes": offloaded * INPUT_BYTES}
    assert f"recomputing {offloaded} with the input in host memory" in probe.budget.plan_line()
    # the fewest that fit: one input fewer in host memory, every other choice the same, is over the budget by the
    # figures (the choice itself is checked against a brute force in test_budget_offload_choice)
    fewer = list(final)
    fewer[fewer.index(Choice.offload)] = Choice.recompute
    estimated, _ = probe.budget._estimate(fewer, probe.budget.calibration)
    assert estimated > budget


def test_a_budget_over_every_layer_recomputed_moves_nothing_more_than_it_needs(runs):
    budget = runs["full"] + 4 * INPUT_BYTES  # recompute alone meets it
    run, peak, probe, offload = run_auto(runs, budget)
    assert_exact(runs["off"], run)
    assert probe.budget.settled and peak <= budget
    # the copies cost nothing measurable on this host, so offloading an input is chosen only where it lets a layer
    # keep its activations; what moved is what was chosen
    offloaded = probe.choices[-1].count(Choice.offload)
    assert offload.last_step["hidden_states"]["bytes"] == offloaded * INPUT_BYTES


def test_a_host_without_the_room_gives_the_nothing_fits_warning_naming_host_memory(runs, monkeypatch):
    """The host has room for one input: the budget that needs several does not fit; nothing is offloaded past the
    room (no HostMemoryError, no OOM), and the warning says what the inputs need and what the host had."""
    reserve = 2**30
    room = INPUT_BYTES + INPUT_BYTES // 2
    monkeypatch.setattr(offload_device, "available_host_bytes", lambda: reserve + room)
    budget = runs["offloaded"] + 1024
    with pytest.warns(UserWarning, match="over the budget; training goes on") as caught:
        run, _, probe, offload = run_auto(runs, budget, host_reserve_bytes=reserve)
    assert_exact(runs["off"], run)
    message = next(str(w.message) for w in caught if "over the budget" in str(w.message))
    assert "more host memory" in message and "host_reserve_bytes" in message, message
    assert offload.last_step["hidden_states"]["bytes"] <= room
    assert probe.choices[-1].count(Choice.offload) <= 1


def test_on_the_host_path_offloading_frees_nothing_and_the_budget_recomputes(caplog):
    """A CPU device whose copies run on the host (no simulated device): host memory is the device's; the line says
    so and the budget chooses as without offloading."""
    from test_budget_mode import tiny_model

    base = tiny_model("llama")
    _, plain_peak, _, _ = train(base)
    _, full_peak, _, _ = train(base, [ActivationCheckpointing()])
    budget = (plain_peak + full_peak) // 2
    _, peak, probe, _ = train(
        base, [ActivationCheckpointing(budget=budget), ActivationOffload(hidden_states="auto", copy_on_host=True)]
    )
    assert "frees nothing on the device" in caplog.text
    assert Choice.offload not in probe.choices[-1] and probe.budget.settled


def test_auto_without_a_budget_is_a_config_error_naming_the_fix():
    from conftest import make_trainer
    from test_budget_mode import StepLM, tiny_model

    with pytest.raises(ConfigError, match=r"offload.hidden_states: auto .* budget is not set"):
        parse_config({"offload": {"hidden_states": "auto"}})
    trainer = make_trainer([ActivationCheckpointing(), ActivationOffload(hidden_states="auto")])
    with pytest.raises(ConfigError, match="budget is not set"):
        trainer.fit(StepLM(tiny_model("llama")), loader())


@pytest.mark.parametrize("target", ["selective", "all"])
def test_auto_is_for_hidden_states_only(target):
    with pytest.raises(ConfigError, match=rf"offload.{target}: 'auto' is for hidden_states only"):
        parse_config({"budget": "1GiB", "offload": {target: "auto"}})
    with pytest.raises(ConfigError, match=rf"ActivationOffload\({target}=...\): 'auto' is for hidden_states only"):
        ActivationOffload(**{target: "auto"})


def test_auto_beside_all_names_the_value_given_and_the_fix():
    """The break-it pass: auto beside all: cpu was refused as "hidden_states: cpu", a value nobody set."""
    from lightning_ac import callbacks_from_config

    for make in (
        lambda: callbacks_from_config({"budget": "100MiB", "offload": {"hidden_states": "auto", "all": "cpu"}}),
        lambda: ActivationOffload(hidden_states="auto", all="cpu"),
    ):
        with pytest.raises(ConfigError, match=r"hidden_states: auto cannot be combined with all: cpu") as caught:
            make()
        assert "hidden_states: cpu" not in str(caught.value) and "Drop all: cpu" in str(caught.value)
