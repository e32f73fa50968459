"""One rank of N (lightning_ac.estimate.ranks): FSDP2's own memory counted as it comes and goes, on the fake process
group. The whole step against a real 2-process gloo run is tests/test_distributed.py's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from lightning_ac.estimate.models import Training, build_model
from lightning_ac.estimate.ranks import Ranks, counted, distribute, fake_world
from lightning_ac.estimate.tracker import Kind, MemoryTracker, local
from lightning_ac.fake import fake_mode, fake_session


def _storage_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("devices", [2, 4])
def test_fsdp2s_gathered_layers_come_and_go_and_its_sharded_gradients_stay(devices):
    """Under the tracker, a forward and backward of a sharded model: the gathered parameters (FSDP2 resizes their
    storages in place) count as streamed weights while a layer runs and none are left after the backward; the
    sharded gradients the reduce-scatter leaves are gradients, each rank's 1/N; the shards are 1/N of the weights."""
    config = tiny_config("llama", num_hidden_layers=8)  # enough layers that every one gathered at once shows
    ranks = Ranks("fsdp", devices)
    tracker = MemoryTracker()
    with fake_session(), fake_world(ranks) as mesh, counted(ranks, tracker):
        model = build_model(config, torch.float32, Training(None, None))
        fake = fake_mode()
        with fake:
            model.to_empty(device="cpu")
            whole = _storage_bytes(model.parameters())
            distribute(model, ranks, mesh, tracker)
            ids = torch.zeros(2, 32, dtype=torch.long)
            tracker.track_external([model], [])
            assert tracker.live[Kind.PARAMETER] == whole // devices  # the tiny model's shapes divide evenly
            layer = _storage_bytes(model.model.layers[0].parameters()) * devices
            root = whole - layer * len(model.model.layers)
            with tracker:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                # after the forward the root's parameters stay gathered for the backward, every layer's are freed
                assert tracker.live[Kind.WEIGHTS] == root
                loss.backward()
            sharded = [p.grad for p in model.parameters()]
            assert all(type(g).__name__ == "DTensor" for g in sharded)
            assert tracker.live[Kind.GRADIENT] == _storage_bytes(sharded) == whole // devices
            assert tracker.live[Kind.WEIGHTS] == 0, "every gathered layer is freed again after the backward"
            # the root's parameters (embeddings, head, norm) gathered with their all-gather buffer, beside the first
            # layer's gathered ahead: never every layer at once
            assert root + layer < tracker.weights_peak <= 2 * (root + 2 * layer) < whole
            assert tracker.live[Kind.ACTIVATION] < whole // 8, "nothing of the step is left but the loss"
    assert not torch.distributed.is_initialized()


def test_ddps_buckets_are_counted_with_the_gradients_when_it_wraps_the_model():
    config = tiny_config("llama")
    ranks = Ranks("ddp", 2)
    tracker = MemoryTracker()
    with fake_session(), fake_world(ranks) as mesh, counted(ranks, tracker):
        model = build_model(config, torch.float32, Training(None, None))
        with fake_mode():
            model.to_empty(device="cpu")
            wrapped = distribute(model, ranks, mesh, tracker)
    assert type(wrapped).__name__ == "DistributedDataParallel"
    assert tracker.live[Kind.GRADIENT] == _storage_bytes(model.parameters()), "one bucket byte per gradient byte"
    assert tracker.live[Kind.ACTIVATION] == 0
    del wrapped
    assert tracker.live[Kind.GRADIENT] == 0, "freed with DDP"


@pytest.mark.parametrize(
    "strategy, case",
    [
        ("fsdp", "lora"),  # frozen and trainable parameters sharded together
        ("fsdp", "tied"),  # the embeddings and the head one parameter
        ("fsdp", "first_step"),
        ("ddp", "first_step"),
        ("fsdp", "bf16"),
        ("ddp", "qlora"),
    ],
)
def test_one_rank_of_the_runs_users_run(strategy, case):
    """Each combination estimates per rank: under FSDP2 the shards are half one device's (padding aside), and the
    rank gathers; under DDP the rank holds one device's weights and, with the gradients, their buckets."""
    from lightning_ac.estimate import estimate

    overrides = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": case == "tied"}  # fmt: skip
    kwargs = dict(
        seq=32,
        modes=["full"],
        target="cpu",
        overrides=overrides,
        dtype="bfloat16" if case in ("bf16", "qlora") else "float32",
        full_finetune=case not in ("lora", "qlora"),
        lora=4,
        qlora=case == "qlora",
        first_step=case == "first_step",
    )
    one = estimate("llama", **kwargs).steps[0]
    rank = estimate("llama", strategy=strategy, devices=2, **kwargs).steps[0]
    if strategy == "fsdp":
        assert one.parameter_bytes / 2 <= rank.parameter_bytes < one.parameter_bytes * 0.51
        assert rank.streamed_weight_bytes > 0
    else:
        assert rank.parameter_bytes == one.parameter_bytes
        if case == "first_step":  # no gradient before a first step, but DDP's buckets, made when it wrapped the model
            assert one.gradient_bytes == 0 < rank.gradient_bytes
        else:
            assert rank.gradient_bytes == 2 * one.gradient_bytes
    assert rank.device_total_bytes > 0
