"""Sessions: tests (default), lint, docs, train, slow, gpu, bench, mutants. `nox -l` lists them."""

import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# The test environment pins the CPU wheel of torch, which lies on the CI machines' disk; users keep their own.
TORCH = "torch==2.13.0"
# ... and caps the other packages at the newest releases tested (lightning_ac/_compat.py TESTED; tests/
# test_compat.py checks that the two agree), so that a release published since does not change what the default run
# tests; `nox -s newest` is where new releases are tried.
TESTED_NEWEST = ["transformers<=5.25.0", "peft<=0.21.2", "lightning<=2.6.6"]


def _install(session: nox.Session, extra: str = "tests") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extra}]", *TESTED_NEWEST)


@nox.session
def tests(session: nox.Session) -> None:
    """The default test run (CPU, under 15 minutes): everything not marked slow or gpu."""
    _install(session)
    session.run("pytest", "-m", "not slow and not gpu", *session.posargs)


# The ends of the tested ranges (lightning_ac/_compat.py TESTED): the oldest releases, pinned, and the newest the
# package index offers within pyproject.toml's ranges, unpinned so that the session keeps up with new releases
# (2026-12-01: torch 2.15.0, transformers 5.24.0, peft 0.21.2, Lightning 2.6.6; transformers 5.25.0 passed the default
# run on 2026-12-05, with torch 2.13.0). Both torch wheels are CUDA builds (GBs of nvidia packages), which run the CPU
# tests.
OLDEST = ["torch==2.9.1", "transformers==5.23.0", "peft==0.18.0", "lightning==2.6.0"]
NEWEST = ["torch>=2.9.1,<3", "transformers>=5.23,<6", "peft>=0.18.0", "lightning>=2.6.0,<3"]
# A pip constraint (this project's machines cap torch at the release that lies on their disk, in pip's configuration)
# would hold the newest releases back: the newest session's installs take an empty constraints file instead, and keep
# the rest of pip's configuration (indexes, mirrors).
NO_CONSTRAINTS = {"PIP_CONSTRAINT": os.devnull}
VERSIONS = (
    "import torch, transformers, peft, lightning; print('testing with torch', torch.__version__, 'transformers', "
    "transformers.__version__, 'peft', peft.__version__, 'lightning', lightning.__version__)"
)


@nox.session(default=False)
def oldest(session: nox.Session) -> None:
    """The default test run with the oldest tested releases of torch, transformers, peft and Lightning."""
    session.install(*OLDEST)
    session.install("-e", ".[tests]", *OLDEST)
    session.run("python", "-c", VERSIONS)
    # grouped-query attention on the oldest torch, whose flop counter takes equal heads only (lightning_ac counts
    # attention's FLOPs itself): an 8B Llama-3 at a short length, seconds
    session.run("python", "-m", "lightning_ac.estimate", "--model", "llama3-8b", "--seq", "512", "--modes", "full")
    session.run("pytest", "-m", "not slow and not gpu", *session.posargs)


@nox.session(default=False)
def newest(session: nox.Session) -> None:
    """The default test run with the newest releases the package index offers (downloads a CUDA build of torch: GBs).
    When it passes, those releases are the newest tested: update TESTED in lightning_ac/_compat.py and the README."""
    session.install("--upgrade", *NEWEST, env=NO_CONSTRAINTS)
    session.install("-e", ".[tests]", "--upgrade-strategy", "eager", *NEWEST, env=NO_CONSTRAINTS)
    session.run("python", "-c", VERSIONS)
    session.run("python", "-m", "lightning_ac.selfcheck")
    session.run("pytest", "-m", "not slow and not gpu", *session.posargs)


@nox.session(default=False)
def slow(session: nox.Session) -> None:
    """Longer integration tests (CPU)."""
    _install(session)
    session.run("pytest", "-m", "slow and not gpu", *session.posargs)


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """Tests that need CUDA. Installs the torch already present when run with --no-venv on a GPU machine."""
    session.install("-e", ".[tests]")
    session.run("pytest", "-m", "gpu", *session.posargs)


@nox.session(default=False)
def mutants(session: nox.Session) -> None:
    """The mutation check (tests/mutants.py): each sync point of the copy engines removed, and the listed bugs of the
    chunked loss, the budget, its measurement and the estimator put in, one at a time; a default test must fail."""
    _install(session)
    session.run("python", "tests/mutants.py", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "lightning_ac", "examples", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "lightning_ac", "examples", "tests", "noxfile.py")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the documentation site (docs/, the API reference from the docstrings) into site/; any warning fails."""
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The mode benchmark (cpu-small on CPU). Extra arguments go to `python -m lightning_ac.bench`."""
    _install(session, "examples")
    session.run("python", "-m", "lightning_ac.bench", "--out", "bench_out", *session.posargs)


@nox.session(default=False)
def train(session: nox.Session) -> None:
    """The main job with the default example (CPU). Extra arguments are Hydra overrides."""
    _install(session, "examples")
    session.run("python", "examples/train.py", *session.posargs)
