"""The README's set-up commands: each stands alone, and CI runs the test command as the README prints it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list:
    """The commands of the README's first shell block (the job's and the tests' set-up), comments left out."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert block, "the README opens with a bash block of set-up commands"
    return [line for line in block[1].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _environment(command: str) -> str:
    """The virtual environment a command creates, checked to be the one it activates."""
    made = re.findall(r"python3 -m venv (\S+)", command)
    assert len(made) == 1, f"one environment per command: {command}"
    assert f". {made[0]}/bin/activate" in command, f"it activates the environment it made: {command}"
    return made[0]


def test_the_two_setup_commands_make_environments_of_their_own():
    """Run one after the other in one clone, the second would otherwise reuse the first's environment silently."""
    commands = _setup_commands()
    assert len(commands) == 2 and "examples/train.py" in commands[0] and "nox -s tests" in commands[1]
    job, tests = (_environment(c) for c in commands)
    assert job != tests
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    for environment in (job, tests):
        assert f"{environment}/" in ignored, f"{environment} is not tracked"


def test_ci_runs_the_readme_test_command_verbatim_in_a_fresh_environment():
    test_command = _setup_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
    assert f"rm -rf {_environment(test_command)}" in ci[: ci.index(test_command)], "the environment is made afresh"
