"""Self-checks: on a release of torch, transformers or Lightning newer than the ones lightning_ac was tested with,
each feature that relies on their private behaviour proves itself on a toy model before the user's first step.

``pyproject.toml`` admits every release up to the next major one, so that installing lightning_ac never replaces a
user's torch; a few features are built on behaviour that torch, transformers and Lightning do not promise to keep
(SAC's caching and cached dispatch modes and their storage layout, whether SAC's saves reach saved-tensor hooks,
which tensors a checkpoint saves outside its region, the checkpoint function transformers' layers call, the saved-
tensor hooks in force and MemTracker's records that the memory budget measures with, the Lightning hooks the
callbacks implement). On a tested release the test suite covers them and nothing runs here. On a newer one, the
first time the plan applies a feature, its check trains a two-layer Llama (hidden size 16, built from a config, on
the CPU: a few milliseconds) one step with the feature and without it, compares the loss and every gradient bit for
bit, and checks that the feature did what it is for (layers recomputed through the checkpoint function the suite
gives them, attention kept, tensors moved to the host and back, weights streamed, each layer measured). A failure
raises :class:`IncompatibleReleaseError`, naming the feature, the release and what to do, before anything trains; a
check that could not run on the machine (out of host memory) raises :class:`SelfCheckError`, which says so instead.

The checks run in isolation: the caller's random state, default device and dtype are left as they were, and the
toy is thrown away. Run every check by hand with ``python -m lightning_ac.selfcheck``.

The modules: :mod:`~lightning_ac.selfcheck.verdict` (the errors and their messages),
:mod:`~lightning_ac.selfcheck.toy` (the toy model and what is measured on it), :mod:`~lightning_ac.selfcheck.checks`,
:mod:`~lightning_ac.selfcheck.budget_check`, :mod:`~lightning_ac.selfcheck.loss_check` and
:mod:`~lightning_ac.selfcheck.lightning_hooks` (the checks), :mod:`~lightning_ac.selfcheck.registry` (which feature
has which check), :mod:`~lightning_ac.selfcheck.runner` (running one), :mod:`~lightning_ac.selfcheck.cli`
(``python -m``). When they run is the release gate's to decide (:mod:`lightning_ac.release_gate`, which the engines
ask and which imports none of them); importing this package registers the checks and the runner there.
"""

from __future__ import annotations

import lightning_ac.release_gate as release_gate
from lightning_ac.release_gate import FEATURES, ensure, features_of, register
from lightning_ac.selfcheck import registry as _registry  # noqa: F401  (registers each feature's check)
from lightning_ac.selfcheck.cli import main
from lightning_ac.selfcheck.runner import run_check
from lightning_ac.selfcheck.verdict import IncompatibleReleaseError, SelfCheckError, SelfCheckFailed

__all__ = [
    "FEATURES",
    "IncompatibleReleaseError",
    "SelfCheckError",
    "SelfCheckFailed",
    "ensure",
    "features_of",
    "main",
    "register",
    "run_check",
]

release_gate.set_runner(run_check)
