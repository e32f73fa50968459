"""The supported ranges, checked at import, and the branches that depend on the torch release."""

from __future__ import annotations

import warnings

import pytest
from conftest import clone, fit, tiny_model

from lightning_ac import ActivationCheckpointing, ActivationOffload
from lightning_ac._compat import CHECKPOINT_TAKES_RESPECT_HOOKS, SUPPORTED, check_versions


def _at(**versions):
    installed = {package: low for package, (low, _) in SUPPORTED.items()}
    installed.update(versions)
    return installed


@pytest.mark.parametrize(
    "versions, message",
    [
        ({"torch": "2.8.0"}, r"supports torch>=2\.13\.0,<2\.15 .* but torch 2\.8\.0 is installed.*pip install"),
        ({"torch": "2.15.0+cu130"}, r"torch>=2\.13\.0,<2\.15"),
        ({"transformers": "5.0.0"}, r"transformers>=5\.24\.0,<6"),
        ({"lightning": "2.7.0"}, r"lightning>=2\.6\.6,<2\.7"),
        ({"peft": "0.17.0"}, r"peft>=0\.21\.2 "),
    ],
)
def test_a_release_outside_the_range_fails_naming_it(versions, message):
    with pytest.raises(ImportError, match=message):
        check_versions(_at(**versions))


def test_the_range_ends_and_local_builds_pass():
    check_versions(_at())
    check_versions(_at(torch="2.14.1+cu130", transformers="5.99.0", lightning="2.6.99"))


@pytest.mark.skipif(not CHECKPOINT_TAKES_RESPECT_HOOKS, reason="this torch has no respect_saved_tensors_hooks")
def test_sac_under_offload_hooks_says_what_it_does_and_torch_does_not_warn():
    """torch >= 2.14 warns when saved-tensor hooks surround a SAC region and nobody chose whether SAC's saves go
    through them; offload.hidden_states (and layer offloading) install such hooks, and we choose: they bypass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(clone(tiny_model("llama")), [ActivationCheckpointing(selective=True),
                                          ActivationOffload(hidden_states="cpu", copy_on_host=True)])  # fmt: skip
    assert not [w for w in caught if "respect_saved_tensors_hooks" in str(w.message)]
