"""The self-checks that guard each feature on releases newer than the tested ones: they pass on this release, they
fail with IncompatibleReleaseError when the private behaviour they guard is broken on purpose, and they run before
the first training step only where a release is untested, without changing the run."""

from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from conftest import LM, assert_same_training, batches, clone, fit, make_trainer, model_fingerprint, tiny_model

from lightning_ac import (
    ActivationCheckpointing,
    ActivationOffload,
    IncompatibleReleaseError,
    LayerOffload,
    _compat,
    release_gate,
    selfcheck,
)
from lightning_ac._compat import CHECKPOINT_TAKES_RESPECT_HOOKS, SAC_STORAGE_INDEXED, TESTED

UNTESTED_TORCH = "2.99.0"


@pytest.fixture(autouse=True)
def _fresh_process():
    """Each test starts as a new process would: no feature checked yet."""
    release_gate._passed.clear()
    yield
    release_gate._passed.clear()


def _pretend(monkeypatch, **releases):
    """Report ``releases`` as installed (package -> version), the rest as they are."""
    real = _compat.installed_release
    monkeypatch.setattr(_compat, "installed_release", lambda package: releases.get(package) or real(package))


def _at_tested_releases(monkeypatch):
    _pretend(monkeypatch, **{package: newest for package, (_, newest) in TESTED.items()})


@pytest.mark.parametrize("feature", selfcheck.FEATURES)
def test_every_feature_passes_its_self_check_on_this_release(feature):
    assert selfcheck.run_check(feature) >= 0


def test_the_checks_leave_the_callers_state_as_it_was(monkeypatch):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    # torch.manual_seed would reseed every accelerator's generator (CUDA's lazily, even without one)
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for feature in selfcheck.FEATURES:
            selfcheck.run_check(feature)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(dtype)
    assert torch.equal(torch.rand(3), expected), "a self-check moved the caller's random state"
    assert reseeded == [], "a self-check reseeded the accelerators' generators"


# -- broken on purpose: each private behaviour a check guards, changed as a release could change it ----------------


def _checkpoint_keeps_nothing(monkeypatch):
    """torch's non-reentrant checkpoint no longer keeps its region's saves in its frame (they reach outer hooks,
    and nothing is recomputed)."""
    monkeypatch.setattr(torch_checkpoint, "_checkpoint_hook", lambda frame: contextlib.nullcontext())


def _layers_skip_the_checkpoint_function(monkeypatch):
    """transformers' layers no longer call the ``_gradient_checkpointing_func`` the engine installs."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    monkeypatch.setattr(LlamaDecoderLayer, "forward", LlamaDecoderLayer.forward.__wrapped__)


def _sac_ignores_the_policy(monkeypatch):
    """SAC's caching mode recomputes what the policy says to save."""
    init = torch_checkpoint._CachingTorchDispatchMode.__init__

    def recompute_everything(self, policy_fn, storage, *args, **kwargs):
        def policy(ctx, func, *a, **k):
            policy_fn(ctx, func, *a, **k)
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        init(self, policy, storage, *args, **kwargs)

    monkeypatch.setattr(torch_checkpoint._CachingTorchDispatchMode, "__init__", recompute_everything)


def _sac_keeps_its_own_storage(monkeypatch):
    """SAC's caching mode stores its saves somewhere else than in the storage it is given."""
    init = torch_checkpoint._CachingTorchDispatchMode.__init__

    def own_storage(self, policy_fn, storage, *args, **kwargs):
        init(self, policy_fn, collections.defaultdict(dict if SAC_STORAGE_INDEXED else list), *args, **kwargs)

    monkeypatch.setattr(torch_checkpoint._CachingTorchDispatchMode, "__init__", own_storage)


def _sac_replays_nothing(monkeypatch):
    """SAC's recompute-side mode no longer answers saved ops from the storage: it runs them again."""
    monkeypatch.setattr(
        torch_checkpoint._CachedTorchDispatchMode,
        "__torch_dispatch__",
        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})),
    )


def _checkpoint_function_wrapped(monkeypatch):
    """transformers installs its own wrapper as the layers' checkpoint function, not functools.partial(checkpoint)."""
    import functools

    from transformers import PreTrainedModel

    set_checkpointing = PreTrainedModel._set_gradient_checkpointing

    def wrapping(self, enable=True, gradient_checkpointing_func=torch_checkpoint.checkpoint, **kwargs):
        @functools.wraps(gradient_checkpointing_func)
        def transformers_checkpoint(*args, **kw):
            return gradient_checkpointing_func(*args, **kw)

        return set_checkpointing(self, enable, transformers_checkpoint, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_set_gradient_checkpointing", wrapping)


def _on_exception_not_called(monkeypatch):
    """Lightning no longer calls the callbacks' on_exception when a fit raises."""
    import lightning.pytorch.trainer.call as call

    hooks = call._call_callback_hooks

    def all_but_on_exception(trainer, hook, *args, **kwargs):
        return None if hook == "on_exception" else hooks(trainer, hook, *args, **kwargs)

    monkeypatch.setattr(call, "_call_callback_hooks", all_but_on_exception)


def _sac_storage_changes_layout(monkeypatch):
    """SAC's storage per op changes layout (indexed slots <-> a queue) where our probe does not see it."""
    import lightning_ac.offload.activations as activations

    monkeypatch.setattr(activations, "SAC_STORAGE_INDEXED", not SAC_STORAGE_INDEXED)


def _sac_saves_reach_the_hooks(monkeypatch):
    """torch routes SAC's saves through the saved-tensor hooks in force (respect_saved_tensors_hooks=True, which a
    later release makes the default)."""
    import lightning_ac.selective.policy as policy

    monkeypatch.setattr(
        policy, "sac_saves_bypass_saved_tensor_hooks", lambda mode: setattr(mode, "respect_saved_tensors_hooks", True)
    )


def _graph_task_id_unknown(monkeypatch):
    """``torch._C._current_graph_task_id`` no longer tells the forward from the backward."""
    monkeypatch.setattr(torch._C, "_current_graph_task_id", lambda: -1)


def _outer_hooks_hidden(monkeypatch):
    """``torch._C._autograd._top_saved_tensors_default_hooks`` no longer returns the hooks in force."""
    monkeypatch.setattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda *args: None)


def _callback_hook_removed(monkeypatch):
    from lightning.pytorch import Callback

    monkeypatch.delattr(Callback, "on_before_backward")


def _callback_hook_reshaped(monkeypatch):
    from lightning.pytorch import Callback

    monkeypatch.setattr(Callback, "on_train_batch_start", lambda self, trainer, pl_module, batch: None)


def _layers_checkpoint_by_themselves(monkeypatch):
    """transformers' layers checkpoint with torch's checkpoint directly (non-reentrant), no longer calling the
    ``_gradient_checkpointing_func`` the suite installs or the kwargs it gave."""
    import functools

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.forward.__wrapped__

    def checkpointing(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return torch_checkpoint.checkpoint(functools.partial(forward, self, **kwargs), *args, use_reentrant=False)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", checkpointing)


def _reentrant_dropped(monkeypatch):
    """transformers installs torch's checkpoint non-reentrant whatever it is asked."""
    import functools

    from transformers import PreTrainedModel

    set_checkpointing = PreTrainedModel._set_gradient_checkpointing

    def non_reentrant(self, enable=True, gradient_checkpointing_func=torch_checkpoint.checkpoint, **kwargs):
        keywords = {**getattr(gradient_checkpointing_func, "keywords", {}), "use_reentrant": False}
        return set_checkpointing(self, enable, functools.partial(torch_checkpoint.checkpoint, **keywords), **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_set_gradient_checkpointing", non_reentrant)


def _outer_hooks_gone(monkeypatch):
    """``torch._C._autograd._top_saved_tensors_default_hooks`` no longer exists."""
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")


def _mem_tracker_measures_nothing(monkeypatch):
    """MemTracker no longer keeps its current records per category (its records changed shape)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.setattr(MemTracker, "_update_snap", lambda self, *args, **kwargs: None)


def _loss_computed_inline(monkeypatch):
    """A causal LM's forward computes its loss itself, not through ``self.loss_function``."""
    from transformers import LlamaForCausalLM

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    from transformers.modeling_outputs import CausalLMOutputWithPast

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)


def _loss_smooths_labels(monkeypatch):
    """transformers' causal-LM loss takes another cross-entropy (label smoothing) than the chunks reproduce."""
    from transformers.loss import loss_utils

    cross_entropy = torch.nn.functional.cross_entropy

    def smoothed(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
        return cross_entropy(source, target, ignore_index=ignore_index, label_smoothing=0.1)

    monkeypatch.setattr(loss_utils, "fixed_cross_entropy", smoothed)


def _loss_takes_other_arguments(monkeypatch):
    """transformers' causal-LM loss renames what the chunks read from its calls."""
    from transformers.loss import loss_utils

    def renamed(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, labels_shifted=None, **kw):
        raise AssertionError("not called")

    monkeypatch.setattr(loss_utils, "ForCausalLMLoss", renamed)


needs_respect_hooks = pytest.mark.skipif(
    not CHECKPOINT_TAKES_RESPECT_HOOKS, reason="this torch always keeps SAC's saves out of saved-tensor hooks"
)

BROKEN = [
    ("activation_checkpointing", _checkpoint_keeps_nothing, r"the layers were not recomputed"),
    ("activation_checkpointing", _layers_skip_the_checkpoint_function, r"the layers were not recomputed"),
    ("selective", _checkpoint_keeps_nothing, r"recomputed nothing"),
    # torch < 2.13 asks the policy again in the recompute, and finds nothing stored where it says to save
    ("selective", _sac_ignores_the_policy, r"attention ran 4 times .* did not keep what the policy saved|not found in"),
    ("selective", _sac_keeps_its_own_storage, r"RuntimeError: .*not found in storage"),
    ("selective", _sac_replays_nothing, r"attention ran 4 times .* did not keep what the policy saved"),
    pytest.param(
        "selective",
        _sac_saves_reach_the_hooks,
        r"changed what offload.hidden_states moves \(6 tensors instead of 2\)",
        marks=needs_respect_hooks,
        id="respect",
    ),
    ("offload.selective", _sac_ignores_the_policy, r"did not keep what the policy saved|not found in storage"),
    ("offload.selective", _sac_keeps_its_own_storage, r"not found in storage"),
    ("offload.selective", _sac_replays_nothing, r"did not keep what the policy saved"),
    ("offload.selective", _sac_storage_changes_layout, r"(IndexError|AttributeError|KeyError|TypeError): "),
    ("offload.hidden_states", _checkpoint_keeps_nothing, r"saw \d+ tensors, where they see one per layer"),
    ("offload.hidden_states", _layers_skip_the_checkpoint_function, r"did not call the checkpoint function"),
    ("offload.hidden_states", _checkpoint_function_wrapped, r"cannot route the layer inputs through it"),
    ("offload.all", _checkpoint_keeps_nothing, r"no fewer than without it"),
    ("layer_offloading", _graph_task_id_unknown, r"inside a backward"),
    ("layer_offloading", _outer_hooks_hidden, r"offload.all moved \d+ tensors instead of \d+"),
    ("callbacks", _callback_hook_removed, r"Callback has no on_before_backward hook"),
    ("callbacks", _callback_hook_reshaped, r"on_train_batch_start now takes \(self, trainer, pl_module, batch\)"),
    ("callbacks", _on_exception_not_called, r"a fit whose step raised called setup, configure_model, .*teardown"),
    (
        "activation_checkpointing",
        _layers_checkpoint_by_themselves,
        r"called the checkpoint function lightning_ac gave them 0 times .* no longer checkpoint through the function "
        r"lightning_ac installs, so reentrant: true",
    ),
    ("activation_checkpointing", _reentrant_dropped, r"ran non-reentrant, where the block asks for reentrant"),
    ("budget", _outer_hooks_hidden, r"_top_saved_tensors_default_hooks\), so nothing was recomputed"),
    ("budget", _outer_hooks_gone, r"AttributeError: .*_top_saved_tensors_default_hooks"),
    ("budget", _layers_checkpoint_by_themselves, r"no longer run through the budget's checkpoint functions"),
    ("budget", _mem_tracker_measures_nothing, r"MemTracker measured no activation peak"),
    ("chunked_loss", _loss_computed_inline, r"refused transformers' own LlamaForCausalLM: .*does not call"),
    ("chunked_loss", _loss_smooths_labels, r"the chunked loss changed the loss"),
    ("chunked_loss", _loss_takes_other_arguments, r"ForCausalLMLoss no longer takes shift_labels"),
]


@pytest.mark.parametrize(
    "feature, breakage",
    [
        # what transformers installs as the layers' checkpoint function matters only where ours replaces it
        ("activation_checkpointing", _checkpoint_function_wrapped),
        # SAC's saves reaching the hooks is selective checkpointing's fault, not the offload target's
        pytest.param("offload.hidden_states", _sac_saves_reach_the_hooks, marks=needs_respect_hooks),
        pytest.param("offload.all", _sac_saves_reach_the_hooks, marks=needs_respect_hooks),
        # and it matters only beside a target whose hooks it would reach
        pytest.param("selective", _sac_saves_reach_the_hooks, marks=needs_respect_hooks),
    ],
)
def test_a_check_does_not_blame_its_feature_for_what_does_not_break_it(feature, breakage, monkeypatch):
    breakage(monkeypatch)
    others = () if feature == "selective" else None
    selfcheck.run_check(feature, others=others)


@pytest.mark.parametrize("feature, breakage, found", BROKEN)
def test_a_broken_private_behaviour_fails_the_check_naming_feature_release_and_fix(
    feature, breakage, found, monkeypatch
):
    # the message for a tested release, whichever releases are installed (nox -s newest runs this too)
    _at_tested_releases(monkeypatch)
    breakage(monkeypatch)
    with pytest.raises(IncompatibleReleaseError, match=found) as raised:
        selfcheck.run_check(feature)
    message = str(raised.value)
    # hidden_states' transformers side is named too
    package = {"callbacks": "lightning", "chunked_loss": "transformers"}.get(feature, "torch")
    assert f"{feature} does not work with" in message
    assert f"{package} {_compat.installed_release(package)}" in message, "names the release"
    assert "(tested: " in message and "a bug of lightning_ac on a tested release: please report it" in message
    if feature != "callbacks":
        assert "meanwhile turn " + feature + " off (" in message, "says how to turn the feature off"
    assert not re.search(r"[^.]\.\.[^.]", message), "one full stop per sentence"


def test_the_error_says_the_release_is_newer_than_the_tested_ones(monkeypatch):
    # the others at tested releases: an untested one would be named beside torch
    _pretend(monkeypatch, torch=UNTESTED_TORCH, **{p: TESTED[p][1] for p in TESTED if p != "torch"})
    _checkpoint_keeps_nothing(monkeypatch)
    with pytest.raises(IncompatibleReleaseError) as raised:
        selfcheck.ensure(["offload.hidden_states"])
    low, high = TESTED["torch"]
    assert (
        f"offload.hidden_states does not work with torch {UNTESTED_TORCH} (newer than the releases lightning_ac was "
        f"tested with: torch {low} to {high})" in str(raised.value)
    )
    assert f"Install a tested release (pip install 'torch<={high}'), or turn offload.hidden_states off " in str(
        raised.value
    )


# -- when the checks run -------------------------------------------------------------------------------------------


def _record_runs(monkeypatch):
    runs = []
    real = release_gate.run_check
    monkeypatch.setattr(release_gate, "run_check", lambda feature, *args: runs.append(feature) or real(feature, *args))
    return runs


def test_a_tested_release_skips_every_check(monkeypatch):
    _at_tested_releases(monkeypatch)
    runs = _record_runs(monkeypatch)
    selfcheck.ensure(selfcheck.FEATURES)
    assert runs == []


def test_an_untested_release_checks_the_features_that_rely_on_it_once_per_process(monkeypatch, caplog):
    _at_tested_releases(monkeypatch)
    _pretend(monkeypatch, torch=UNTESTED_TORCH, **{p: TESTED[p][1] for p in TESTED if p != "torch"})
    runs = _record_runs(monkeypatch)
    selfcheck.ensure(["callbacks", "activation_checkpointing", "offload.all"])
    selfcheck.ensure(["activation_checkpointing", "offload.all", "selective"])
    assert runs == ["activation_checkpointing", "offload.all", "selective"], "callbacks rely on Lightning only"
    assert (
        f"self-check of offload.all on torch {UNTESTED_TORCH} (newer than the tested releases): passed" in caplog.text
    )


def test_an_untested_lightning_checks_the_callbacks(monkeypatch):
    _at_tested_releases(monkeypatch)
    _pretend(monkeypatch, lightning="2.7.0", **{p: TESTED[p][1] for p in TESTED if p != "lightning"})
    runs = _record_runs(monkeypatch)
    selfcheck.ensure(["callbacks", "activation_checkpointing", "offload.all"])
    assert runs == ["callbacks"]


def test_the_packages_the_checks_rely_on_are_the_ones_the_import_warning_names():
    assert {p for check in release_gate.CHECKS.values() for p in check.packages} == set(_compat.SELF_CHECKED)
    assert set(release_gate.CHECKS) == set(selfcheck.FEATURES)


def test_features_of_a_plan():
    assert selfcheck.features_of(False, False, [], False) == ["callbacks"]
    assert selfcheck.features_of(True, True, ["hidden_states", "selective"], True) == [
        "callbacks",
        "activation_checkpointing",
        "selective",
        "offload.hidden_states",
        "offload.selective",
        "layer_offloading",
    ]
    everything = selfcheck.features_of(True, True, ["hidden_states", "selective", "all"], True, True, True)
    assert set(everything) == set(selfcheck.FEATURES)
    assert "budget" in selfcheck.features_of(True, False, [], False, budget=True)
    assert selfcheck.features_of(False, False, [], False, chunked_loss=True) == ["callbacks", "chunked_loss"]
    assert "budget" not in selfcheck.features_of(False, False, [], False, budget=True), "nothing is recomputed"


def _suite(selective=True):
    return [ActivationCheckpointing(selective=selective), ActivationOffload(selective="cpu", copy_on_host=True)]


def test_a_broken_feature_on_an_untested_release_fails_before_the_first_step(monkeypatch):
    steps = []

    class Counting(LM):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    _sac_ignores_the_policy(monkeypatch)
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(IncompatibleReleaseError, match=rf"selective does not work with torch {UNTESTED_TORCH}"):
        fit(model, _suite(), module_cls=Counting)
    assert steps == []
    assert model_fingerprint(model) == before, "nothing of ours stays on the model"


def test_layer_offloading_checks_itself_too(monkeypatch):
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    _outer_hooks_hidden(monkeypatch)
    model = tiny_model("llama", lora=True)
    with pytest.raises(IncompatibleReleaseError, match="layer_offloading does not work"):
        fit(model, [LayerOffload(copy_on_host=True)])


def test_a_passing_self_check_leaves_the_run_as_on_a_tested_release(monkeypatch, caplog):
    """The checks run inside the user's setup: the training that follows is bit for bit the one without them."""
    base = tiny_model("llama")
    _at_tested_releases(monkeypatch)
    tested = fit(clone(base), _suite(), max_steps=2)
    assert "self-check" not in caplog.text
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    untested = fit(clone(base), _suite(), max_steps=2)
    assert "self-check of selective on torch 2.99.0" in caplog.text
    assert_same_training(tested, untested)
    for (name, a), b in zip(tested.named_parameters(), untested.parameters()):
        assert torch.equal(a, b), name


# -- at import -----------------------------------------------------------------------------------------------------

_IMPORT_AS_IF = """
import importlib.metadata, warnings
real = importlib.metadata.version
importlib.metadata.version = lambda p: {version!r} if p == {package!r} else real(p)
warnings.simplefilter("default")
import lightning_ac
import lightning_ac.callbacks
"""


def _import_as_if(package, version, **env):
    import os

    return subprocess.run(
        [sys.executable, "-c", _IMPORT_AS_IF.format(package=package, version=version)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


@pytest.mark.slow  # moved to the slow session to keep the default run under 15 minutes
def test_importing_next_to_a_newer_torch_warns_once_on_rank_zero():
    newer = _import_as_if("torch", "2.99.0+cu130")
    assert newer.returncode == 0, newer.stderr
    warning = "LightningACWarning: lightning_ac: torch 2.99.0+cu130 is newer than the releases lightning_ac was tested"
    assert newer.stderr.count(warning) == 1, newer.stderr
    assert "<string>:6: LightningACWarning" in newer.stderr, "points at the user's import"
    other_rank = _import_as_if("torch", "2.99.0+cu130", RANK="1", LOCAL_RANK="1")
    assert other_rank.returncode == 0 and "LightningACWarning" not in other_rank.stderr, other_rank.stderr


def test_importing_next_to_an_older_torch_fails_naming_the_floor():
    older = _import_as_if("torch", "2.8.0")
    assert older.returncode != 0
    assert f"lightning_ac needs torch>={TESTED['torch'][0]}, but torch 2.8.0 is installed" in older.stderr


def test_the_users_block_is_still_parsed_once_on_an_untested_release(monkeypatch):
    import lightning_ac.config.block

    calls = []
    original = lightning_ac.config.block._parse_block
    monkeypatch.setattr(lightning_ac.config.block, "_parse_block", lambda value: calls.append(value) or original(value))
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    fit(clone(tiny_model("llama")), _suite())
    assert len(calls) == 1 and {feature for feature, _ in release_gate._passed} >= {"selective", "offload.selective"}


def test_python_m_lightning_ac_selfcheck_says_what_works(capsys, monkeypatch):
    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    assert f"{len(selfcheck.FEATURES)}/{len(selfcheck.FEATURES)} features work with torch " in out
    _sac_ignores_the_policy(monkeypatch)
    assert selfcheck.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL selective: lightning_ac: selective does not work with torch" in out and "ok   layer_offloading" in out


def test_python_m_lightning_ac_selfcheck_takes_features_and_help(capsys):
    # --help ran every check before
    with pytest.raises(SystemExit) as exit:
        selfcheck.main(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "usage: python -m lightning_ac.selfcheck" in out and "ok " not in out
    assert all(feature in out for feature in selfcheck.FEATURES)
    assert selfcheck.main(["offload.all"]) == 0
    out = capsys.readouterr().out
    assert "ok   offload.all" in out and "1/1 features work" in out and "selective" not in out
    with pytest.raises(SystemExit) as exit:
        selfcheck.main(["offload.disk"])
    assert (
        exit.value.code == 2 and "unknown feature(s) 'offload.disk'; choose from callbacks" in capsys.readouterr().err
    )


@pytest.mark.simulated
def test_the_checks_copy_on_the_host_apart_from_a_simulated_device():
    """The toy's copies are not the run's: a check inside a SimulatedDevice leaves its figures as they were."""
    from lightning_ac.testing.simulated import SimulatedDevice

    with SimulatedDevice() as sim:
        for feature in ("offload.selective", "layer_offloading"):
            selfcheck.run_check(feature)
        assert sim.copies == 0 and not any(sim.peak_bytes.values())


def test_validate_test_and_predict_check_only_the_callbacks(monkeypatch):
    """They run no backward: a feature broken only in training does not stop them."""
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    _sac_ignores_the_policy(monkeypatch)
    runs = _record_runs(monkeypatch)

    class Validated(LM):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    model = Validated(tiny_model("llama"))
    make_trainer(_suite()).validate(model, batches())
    assert runs == []  # callbacks rely on Lightning only, which is at a tested release here
    with pytest.raises(IncompatibleReleaseError, match="selective does not work"):
        make_trainer(_suite()).fit(model, batches())


def test_apply_selective_checkpointing_checks_itself_too(monkeypatch):
    from lightning_ac import apply_selective_checkpointing

    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    _sac_ignores_the_policy(monkeypatch)
    model = tiny_model("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(IncompatibleReleaseError, match=rf"selective does not work with torch {UNTESTED_TORCH}"):
        apply_selective_checkpointing(model)


def test_a_memory_budget_on_an_untested_release_checks_itself(monkeypatch):
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    _outer_hooks_hidden(monkeypatch)
    runs = _record_runs(monkeypatch)
    with pytest.raises(IncompatibleReleaseError, match=rf"budget does not work with torch {UNTESTED_TORCH}"):
        fit(clone(tiny_model("llama")), [ActivationCheckpointing(budget="1GiB")])
    assert runs == ["activation_checkpointing", "budget"]


def test_a_chunked_loss_on_an_untested_transformers_checks_itself(monkeypatch):
    _pretend(monkeypatch, transformers="6.0.0")
    _loss_smooths_labels(monkeypatch)
    runs = _record_runs(monkeypatch)
    with pytest.raises(IncompatibleReleaseError, match="chunked_loss does not work with transformers 6.0.0"):
        fit(clone(tiny_model("llama")), [ActivationCheckpointing(enabled=False, chunked_loss=True)])
    assert runs == ["chunked_loss"]


# -- what a check does not blame on the release --------------------------------------------------------------------

OFFLOADING = ["offload.hidden_states", "offload.selective", "offload.all", "layer_offloading"]


def _host_memory_available(monkeypatch, nbytes):
    import lightning_ac.offload.device as device

    monkeypatch.setattr(device, "available_host_bytes", lambda: nbytes)


@pytest.mark.parametrize("feature", OFFLOADING)
def test_offloading_checks_pass_on_a_host_with_less_free_memory_than_the_default_reserve(feature, monkeypatch):
    """A run's host reserve (2 GiB by default) is the run's: the toy's few KiB keep none."""
    _host_memory_available(monkeypatch, 2**30)
    selfcheck.run_check(feature)


def test_a_check_that_runs_out_of_host_memory_says_so_and_does_not_blame_the_release(monkeypatch, capsys):
    _host_memory_available(monkeypatch, 0)
    _pretend(monkeypatch, torch=UNTESTED_TORCH)
    import lightning_ac

    with pytest.raises(lightning_ac.SelfCheckError) as raised:
        selfcheck.ensure(["offload.all"])
    message = str(raised.value)
    assert message.startswith(
        "lightning_ac: the self-check of offload.all could not run on this machine: the host has no memory left for "
        "a toy model of a few KiB (HostMemoryError: "
    ), message
    assert f"This is not torch {UNTESTED_TORCH} breaking offload.all" in message and "Free host memory" in message
    assert "does not work with" not in message and not isinstance(raised.value, IncompatibleReleaseError)
    assert release_gate._passed == {}, "a check that could not run runs again next time"
    assert selfcheck.main(["offload.all"]) == 1
    assert "ERROR offload.all: lightning_ac: the self-check of offload.all could not run" in capsys.readouterr().out


def test_the_callbacks_probe_ignores_the_users_trainer_environment(monkeypatch):
    import os

    monkeypatch.setenv("PL_TRAINER_LIMIT_TRAIN_BATCHES", "0.5")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "0")
    selfcheck.run_check("callbacks")
    assert os.environ["PL_TRAINER_LIMIT_TRAIN_BATCHES"] == "0.5" and os.environ["PL_TRAINER_MAX_STEPS"] == "0"
