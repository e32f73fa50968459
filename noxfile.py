"""Sessions: tests (default), lint, train, slow, gpu, bench, mutants. `nox -l` lists them."""

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# The test environment pins the CPU wheel of torch, which lies on the CI machines' disk; users keep their own.
TORCH = "torch==2.13.0"


def _install(session: nox.Session, extra: str = "tests") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extra}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The default test run (CPU, under 15 minutes): everything not marked slow or gpu."""
    _install(session)
    session.run("pytest", "-m", "not slow and not gpu", *session.posargs)


# The supported ranges' ends (pyproject.toml, lightning_ac/_compat.py): the lowest releases, pinned, and the newest
# this machine's package index allows within the ranges (torch 2.14.1: 2.15.0 does not resolve there). Both torch
# pins are CUDA builds (GBs of nvidia packages), which run the CPU tests.
OLDEST = ["torch==2.9.1", "transformers==5.23.0", "peft==0.18.0", "lightning==2.6.0"]
NEWEST = ["torch==2.14.1", "transformers>=5.23,<6", "peft>=0.18.0", "lightning>=2.6.0,<2.7"]


@nox.session(default=False)
def oldest(session: nox.Session) -> None:
    """The default test run with the lowest supported releases of torch, transformers, peft and Lightning."""
    session.install(*OLDEST)
    session.install("-e", ".[tests]", *OLDEST)
    session.run("pytest", "-m", "not slow and not gpu", *session.posargs)


@nox.session(default=False)
def newest(session: nox.Session) -> None:
    """The default test run with the newest releases the ranges allow (downloads a CUDA build of torch: GBs)."""
    session.install(*NEWEST)
    session.install("-e", ".[tests]", "--upgrade-strategy", "eager", *NEWEST)
    session.run(
        "python",
        "-c",
        "import torch, transformers, peft, lightning; print(torch.__version__, "
        "transformers.__version__, peft.__version__, lightning.__version__)",
    )
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
    """Remove each synchronisation point of the copy engines in turn; every mutant must fail a simulated test."""
    _install(session)
    session.run("python", "tests/mutants.py", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "lightning_ac", "examples", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "lightning_ac", "examples", "tests", "noxfile.py")


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
