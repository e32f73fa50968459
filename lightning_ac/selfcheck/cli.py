"""``python -m lightning_ac.selfcheck [FEATURE ...]``: every feature's self-check on the installed releases."""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_ac._compat import TESTED
from lightning_ac.release_gate import FEATURES
from lightning_ac.selfcheck.runner import installed_releases, run_check
from lightning_ac.selfcheck.verdict import IncompatibleReleaseError, SelfCheckError

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_ac.selfcheck [FEATURE ...]``: run the checks (all by default) on the installed releases,
    one line each; exits 1 if one fails or cannot run."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lightning_ac.selfcheck",
        description="Check each feature that relies on behaviour torch, transformers or Lightning do not promise to "
        "keep, on the installed releases: a two-layer toy model trained one step on the CPU with the feature and "
        "without it, compared bit for bit. Exits 1 if a check fails.",
    )
    parser.add_argument("features", nargs="*", metavar="FEATURE", help=f"the checks to run: {', '.join(FEATURES)}")
    features = parser.parse_args(argv).features or list(FEATURES)
    unknown = [f for f in features if f not in FEATURES]
    if unknown:  # checked here: argparse's choices= lists an empty list among them when nargs="*"
        parser.error(f"unknown feature(s) {', '.join(map(repr, unknown))}; choose from {', '.join(FEATURES)}")
    failed = 0
    for feature in features:
        try:
            seconds = run_check(feature)
        except IncompatibleReleaseError as error:
            failed += 1
            print(f"FAIL {feature}: {error}")
        except SelfCheckError as error:  # not a verdict on the release: said apart from one
            failed += 1
            print(f"ERROR {feature}: {error}")
        else:
            print(f"ok   {feature} ({seconds * 1e3:.0f} ms)")
    versions = ", ".join(f"{p} {r}" for p, r in installed_releases(TESTED).items())
    print(f"{len(features) - failed}/{len(features)} features work with {versions}")
    return 1 if failed else 0
