"""The output head's share of the activation peak at each vocabulary, with and without ``chunked_loss``.

    python -m lightning_ac.bench.head --out docs/bench-cpu-vocab     # vocabularies 256 and 32,000

The model is the preset's (``cpu-vocab``: ``cpu-small``'s shape) at each vocabulary; the rows are ``off``, ``full``
and ``full`` without the head's activations (``full_no_head``: ``logits_to_keep=1``, the floor), with and without
``chunked_loss``. Activation peaks are measured exactly and repeat run to run, so one repetition of one timed step
measures them (no step times here: the benchmark's own run has those). Writes ``head.md`` and ``head.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lightning_ac.bench.presets import PRESETS
from lightning_ac.bench.run import Row, quiet, run_benchmark

__all__ = ["HEAD_MODES", "head_markdown", "main", "run_head"]

HEAD_MODES = ["off", "off_chunked", "full", "full_chunked", "full_no_head"]
VOCABULARIES = (256, 32000)  # the byte tokens of the benchmark and the main job; Llama 2's


def run_head(
    preset: str = "cpu-vocab", vocabularies: Sequence[int] = VOCABULARIES, seq: Optional[int] = None
) -> Dict[int, List[Row]]:
    """The rows of :data:`HEAD_MODES` at each vocabulary."""
    return {v: run_benchmark(preset, list(HEAD_MODES), seq=seq, reps=1, steps=1, vocab_size=v) for v in vocabularies}


def _mib(row: Row) -> str:
    if row.status != "ok":
        return row.status
    return f"{row.peak_activation_bytes / 2**20:.1f}" if row.peak_activation_bytes is not None else "—"


def head_markdown(rows: Dict[int, List[Row]]) -> str:
    """One line per vocabulary: the peaks (MiB), the head's share of ``full``'s (what the floor lacks of it) and
    ``full`` with chunked_loss against the floor."""
    lines = [
        "| vocabulary | `off` | `off` + chunked_loss | `full` | `full` + chunked_loss "
        "| `full` without the head's activations (`logits_to_keep=1`) | head's share of `full` "
        "| `full` + chunked_loss vs that floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for vocabulary, measured in rows.items():
        by = {r.mode: r for r in measured}
        full, chunked, floor = (by[m].peak_activation_bytes for m in ("full", "full_chunked", "full_no_head"))
        share = f"{(full - floor) / full:.0%}" if full and floor is not None else "—"
        against = f"{chunked / floor:.2f}x" if chunked is not None and floor else "—"
        lines.append(
            f"| {vocabulary:,} | {' | '.join(_mib(by[m]) for m in ('off', 'off_chunked', 'full', 'full_chunked'))} "
            f"| {_mib(by['full_no_head'])} | {share} | {against} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict[int, List[Row]]:
    parser = argparse.ArgumentParser(prog="python -m lightning_ac.bench.head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-vocab", help="default: cpu-vocab")
    parser.add_argument(
        "--vocab", type=int, nargs="+", default=list(VOCABULARIES), help="vocabularies (default: 256 32000)"
    )
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench_out"), help="where head.md, head.json go (default: bench_out)"
    )
    args = parser.parse_args(argv)
    for flag in ("vocab", "seq"):
        values = getattr(args, flag)
        bad = [v for v in (values if isinstance(values, list) else [values]) if v is not None and v < 1]
        if bad:
            parser.error(f"--{flag} {bad[0]}: expected an integer >= 1")
    quiet()
    rows = run_head(args.preset, args.vocab, args.seq)
    table = head_markdown(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head.md").write_text(f"preset: {args.preset}\n\n{table}")
    data = {str(v): [asdict(r) for r in measured] for v, measured in rows.items()}
    (args.out / "head.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"results: {args.out / 'head.md'}, {args.out / 'head.json'}")
    return rows


if __name__ == "__main__":
    main()
