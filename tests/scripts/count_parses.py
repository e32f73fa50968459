"""Run the main job (examples/train.py) with its arguments, counting how often a block is validated.

Writes ``parse_count.json`` next to the run's ``summary.json``: ``{"validations": N}``.
"""

import atexit
import json
import runpy
import sys
from pathlib import Path

import lightning_ac.config.block

calls = []
_original = lightning_ac.config.block._parse_block


def _counting(value):
    calls.append(value)
    return _original(value)


lightning_ac.config.block._parse_block = _counting
run_dir = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir="))


@atexit.register
def _write() -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "parse_count.json").write_text(json.dumps({"validations": len(calls)}))


root = Path(__file__).resolve().parents[2]
sys.argv = [str(root / "examples" / "train.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
