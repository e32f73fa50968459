"""The activation peak of a training step as ``lightning_ac.memory.measure_step`` reads it on the CPU (MemTracker):
the memory budget, the benchmark and the main job all take this figure."""

from __future__ import annotations

import torch
from conftest import VOCAB, tiny_model

from lightning_ac.memory import measure_step

CPU = torch.device("cpu")


def _measured(model, optimizer, run) -> int:
    with measure_step([model], [optimizer], CPU) as measurement:
        run()
    return measurement.result.activation_bytes


def test_a_step_that_starts_without_gradients_reads_at_least_its_forward():
    """The first step after validation starts with every ``.grad`` None (Lightning sets them so). MemTracker's own
    peak is the moment the step's total memory peaks: there the gradients and optimizer state of a full fine-tune
    dwarf the activations, most of which are freed by then, and it read about half what the forward alone holds."""
    model = tiny_model("llama", hidden_size=128, intermediate_size=512).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    step()  # the optimizer's state exists from here on
    optimizer.zero_grad(set_to_none=True)
    forward_alone = _measured(model, optimizer, lambda: model(input_ids=ids, labels=ids))
    optimizer.zero_grad(set_to_none=True)
    whole = _measured(model, optimizer, step)
    assert forward_alone > 0 and whole >= forward_alone
    with_grads = _measured(model, optimizer, step)  # the next step's gradients exist at its start
    assert with_grads == whole, "the activations of a step do not depend on whether its gradients existed before"


def test_a_step_that_calls_the_model_twice_is_measured_whole():
    """Two forwards a step (chosen and rejected halves, R-Drop): MemTracker took the second call of the root module
    for the next iteration and raised. Both forwards' activations are held until the backward of their sum."""
    model = tiny_model("llama").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))

    def once() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def twice() -> None:
        (model(input_ids=ids, labels=ids).loss + model(input_ids=ids.flip(-1), labels=ids.flip(-1)).loss).backward()

    single = _measured(model, optimizer, once)
    double = _measured(model, optimizer, twice)
    assert 1.8 * single < double < 2.2 * single


def test_overlapping_measurements_put_the_compilers_stance_back_whatever_order_they_end_in():
    # the memory budget's measurement and the benchmark's share a step, each ended by its own callback: the first to
    # start may end first; then the compiler stayed in force_eager for the rest of the process (nothing compiled)
    stance = torch._dynamo.eval_frame._stance.stance
    first, second = measure_step([], [], torch.device("cpu")), measure_step([], [], torch.device("cpu"))
    first.__enter__()
    second.__enter__()
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    first.__exit__(None, None, None)
    assert torch._dynamo.eval_frame._stance.stance == "force_eager", "the second still measures"
    second.__exit__(None, None, None)
    assert torch._dynamo.eval_frame._stance.stance == stance
