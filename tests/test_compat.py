"""The tested ranges, checked at import, and the branches that depend on the torch release."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import clone, fit, tiny_model
from packaging.requirements import Requirement
from packaging.version import Version
from torch.utils.checkpoint import _VersionWrapper

from lightning_ac import ActivationCheckpointing, ActivationOffload, LightningACWarning
from lightning_ac._compat import CHECKPOINT_TAKES_RESPECT_HOOKS, SAC_STORAGE_INDEXED, TESTED, check_versions
from lightning_ac.offload.activations import _HostQueue, _HostSlots, _HostStorage
from lightning_ac.offload.engine import Packed, TransferEngine


def _at(end=0, **versions):
    installed = {package: ends[end] for package, ends in TESTED.items()}
    installed.update(versions)
    return installed


@pytest.mark.parametrize(
    "versions, message",
    [
        ({"torch": "2.9.0"}, r"needs torch>=2\.9\.1, but torch 2\.9\.0 is installed.*pip install 'torch>=2\.9\.1'"),
        ({"torch": "2.8.0+cu128"}, r"tested: torch 2\.9\.1 to "),
        ({"transformers": "5.22.2"}, r"needs transformers>=5\.23\.0"),
        ({"lightning": "2.5.6"}, r"needs lightning>=2\.6\.0"),
        ({"peft": "0.17.1"}, r"needs peft>=0\.18\.0"),
    ],
)
def test_a_release_older_than_the_tested_ones_fails_naming_the_floor(versions, message):
    with pytest.raises(ImportError, match=message):
        check_versions(_at(**versions))


@pytest.mark.parametrize("end", [0, 1])
def test_the_tested_ends_and_their_local_builds_pass_in_silence(end):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_versions(_at(end)) == {}
        local = {p: v + "+cu130" for p, v in _at(end).items() if p == "torch"}
        assert check_versions(_at(end, **local)) == {}


@pytest.mark.parametrize(
    "package, release",
    [
        ("torch", "2.99.0+cu130"),
        ("torch", "3.0.0"),
        ("torch", "2.99.0.dev20261201+cpu"),
        ("torch", TESTED["torch"][1] + "rc1"),  # a pre-release of the newest tested is not what was tested
        ("lightning", "2.7.0"),
        ("transformers", "5.99.0"),
        ("peft", "0.99.0"),
    ],
)
def test_a_release_newer_than_the_tested_ones_warns_naming_it_and_the_range(package, release):
    low, high = TESTED[package]
    with pytest.warns(LightningACWarning) as caught:
        assert check_versions(_at(1, **{package: release})) == {package: release}
    assert len(caught) == 1
    message = str(caught[0].message)
    named = f"{package} {release} is newer than the releases lightning_ac was tested with ({package} {low} to {high})"
    assert named in message
    assert f"pip install '{package}<={high}'" in message
    assert ("IncompatibleReleaseError" in message) == (package != "peft"), "peft's public API only: no self-check"


def test_pyproject_declares_the_tested_floors_and_caps_at_the_next_major_release_only():
    """pip must be able to install lightning_ac next to a newer torch or Lightning without replacing it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    declared = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    for package, (low, high) in TESTED.items():
        specifier = declared[package]
        floors = [Version(s.version) for s in specifier if s.operator == ">="]
        assert floors == [Version(low)], f"{package}: the floor is the oldest tested release"
        major = Version(low).major
        assert specifier.contains(high) and specifier.contains(f"{major}.99.0"), f"{package}: capped below {major + 1}"
        assert package == "peft" or not specifier.contains(f"{major + 1}.0.0"), f"{package}: the next major is out"


def test_the_readme_names_the_tested_ranges():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    named = {"torch": "torch", "transformers": "transformers", "peft": "peft", "lightning": "Lightning"}
    for package, (low, high) in TESTED.items():
        assert f"{named[package]} {low}–{high}" in readme, package


@pytest.mark.skipif(not CHECKPOINT_TAKES_RESPECT_HOOKS, reason="this torch has no respect_saved_tensors_hooks")
@pytest.mark.parametrize("respect", [False, True])
def test_sac_saves_bypass_the_offload_hooks_because_we_say_so(respect, monkeypatch):
    """torch >= 2.14 warns when saved-tensor hooks surround a SAC region and nobody chose whether SAC's saves go
    through them (a later release will route them through by default). offload.hidden_states installs such hooks
    around each checkpoint call, for the layer's inputs only; we choose: SAC's saves bypass them (offload.selective
    moves those). With the other choice forced, SAC's saves (2 per layer) would go through the hooks too."""
    import lightning_ac.selective.policy as policy_module

    if respect:
        monkeypatch.setattr(
            policy_module,
            "sac_saves_bypass_saved_tensor_hooks",
            lambda mode: setattr(mode, "respect_saved_tensors_hooks", True),
        )
    offload = ActivationOffload(hidden_states="cpu", copy_on_host=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(clone(tiny_model("llama")), [ActivationCheckpointing(selective=True), offload])
    assert not [w for w in caught if "respect_saved_tensors_hooks" in str(w.message)]
    layer_inputs = 4  # one per checkpointed layer
    moved = offload.last_step["hidden_states"]["tensors"]
    assert moved == (layer_inputs + 2 * 4 if respect else layer_inputs)


def _saved(*values):
    """An op's output as torch's SAC caching mode stores it: each tensor in a _VersionWrapper."""
    return tuple(_VersionWrapper(v) for v in values)


@pytest.mark.parametrize("layout", ["indexed", "queue"])
def test_offload_selective_storage_speaks_both_sac_storage_layouts(layout):
    """torch >= 2.13 stores SAC saves as storage[op][index] (with markers for recomputed ops); older releases as a
    queue per op, appended in the forward and popped from the front in the recompute. offload.selective's storage
    moves the saved tensors to the host and back in both; the one this torch uses is picked by _HostStorage."""
    engine = TransferEngine(torch.device("cpu"), copy_on_host=True)
    engine.start_step()
    first, second = torch.arange(6.0), torch.ones(2, 3)
    marker = object()  # torch >= 2.13's "recompute this one" entry: not a save, left as it is
    if layout == "indexed":
        slots = _HostSlots(engine)
        slots[0], slots[1], slots[2] = _saved(first), marker, _saved(second, 7)
    else:
        slots = _HostQueue(engine)
        slots.append(_saved(first))
        slots.append(_saved(second, 7))
    packed = slots.packed()
    assert len(packed) == 2 and all(isinstance(p, Packed) for p in packed)
    if layout == "indexed":
        back_first, back_second = slots.get(0), slots.get(2)
        assert slots.get(1) is marker
    else:
        back_first, back_second = slots.pop(0), slots.pop(0)
        assert not slots
    assert torch.equal(back_first[0].get_val(False), first)
    assert torch.equal(back_second[0].get_val(False), second) and back_second[1].get_val(False) == 7
    assert back_first[0].val.data_ptr() != first.data_ptr(), "a copy came back, not the forward's tensor"
    engine.finish_step()
    assert engine.last_step["selective"] == {"tensors": 2, "bytes": first.nbytes + second.nbytes}
    expected = _HostSlots if SAC_STORAGE_INDEXED else _HostQueue
    assert type(_HostStorage(engine)[torch.ops.aten.mm.default]) is expected


def test_the_default_test_run_caps_the_packages_at_the_newest_releases_tested():
    """noxfile.py's caps are TESTED's newest: the default run tests what lightning_ac says it was tested with."""
    import ast
    from pathlib import Path

    from lightning_ac._compat import TESTED

    tree = ast.parse((Path(__file__).resolve().parents[1] / "noxfile.py").read_text())
    caps = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TESTED_NEWEST"
    )
    assert sorted(caps) == sorted(f"{name}<={TESTED[name][1]}" for name in TESTED if name != "torch")
