"""The main job: train a small real Hugging Face causal LM with a LoRA adapter, configured by Hydra.

    python examples/train.py                                        # no checkpointing, CPU
    python examples/train.py activation_checkpointing=full          # recompute every decoder layer
    python examples/train.py activation_checkpointing=full activation_checkpointing/selective=attention
    python examples/train.py -m activation_checkpointing=off,full,every_2   # sweep, writes sweep_summary.*

The model is built from a config (random init, no download) and trained on English prose that ships with
Python: the docstrings of a fixed list of standard-library names (examples/corpus.py), as bytes: the same text for
the same Python version, whatever else is installed. Each run writes ``summary.json`` to its
output directory; a multirun also writes ``sweep_summary.csv`` and ``sweep_summary.png`` to the sweep dir. A bad
value stops a single run with exit status 2 before training; in a sweep, that job is recorded as failed, the others
run, and the sweep exits with status 2 at the end.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimate_job import run_estimate  # noqa: E402
from lm import CausalLM, LossPrinter, build_model, make_dataloader  # noqa: E402
from modes import mode_label  # noqa: E402
from sweep import write_sweep_summary  # noqa: E402

from lightning_ac import (  # noqa: E402
    ActivationCheckpointing,
    ActivationOffload,
    ConfigError,
    LayerOffload,
    callbacks_from_config,
    migrate_legacy,
)
from lightning_ac.bench.memory import StepMetrics  # noqa: E402
from lightning_ac.config import (  # noqa: E402
    OffloadConfig,
    check_block_key,
    config_to_dict,
    parse_bool,
    parse_config,
    parse_count,
)
from lightning_ac.legacy import find_legacy_keys  # noqa: E402

log = logging.getLogger("train")
# peft asks transformers for this deprecated property when wrapping a model: noise for the user, not ours.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates, at every step: not the user's to act on.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class _NoAdvertising(logging.Filter):
    """Lightning's tip to install its cloud logger, printed by every Trainer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdvertising())

CONF = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class BlockSchema:
    """Hydra's view of the block: ActivationCheckpointingConfig's fields (so an unknown field fails at
    composition), with values left to parse_config, whose ConfigError names the field and the fix and exits with
    status 2 (OmegaConf's own type check would end the job with a composition traceback and status 1)."""

    enabled: Any = True
    implementation: Any = "hf"
    reentrant: Any = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    selective: Any = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    budget: Any = None
    chunked_loss: Any = None
    budget_first_plan: Any = "measure"
    tiled_mlp: Any = None


# Every activation_checkpointing option extends this schema, so any field can be overridden on any option.
ConfigStore.instance().store(group="activation_checkpointing", name="schema", node=BlockSchema)


def _describe_options(group: str) -> str:
    """``--help``'s list of a group's options, each with the first comment line of its file."""
    lines = []
    for path in sorted((CONF / group).glob("*.yaml")):
        comments = [line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")]
        about = next((c for c in comments if not c.startswith("@package")), "")
        lines.append(f"  {path.stem:26s} {about}".rstrip())
    return "\n".join(lines)


# conf/train.yaml's hydra.help.template asks for these: the modes and groups with a line each, not the schema
OmegaConf.register_new_resolver("train_options", _describe_options, replace=True)

# `activation_checkpointing=true` is the block's own syntax (README), but Hydra reads it as a group choice and
# rejects a boolean: it means the option full (false: off).
_BOOLEAN_CHOICES = {"true": "full", "false": "off"}


def _boolean_choices_as_options(argv: List[str]) -> List[str]:
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key == "activation_checkpointing":
            value = ",".join(_BOOLEAN_CHOICES.get(v.strip().lower(), v) for v in value.split(","))
        out.append(f"{key}{sep}{value}" if sep else arg)
    return out


def _selective_true_with_its_fields(argv: List[str]) -> List[str]:
    """``activation_checkpointing.selective=true`` followed by ``activation_checkpointing.selective.<field>=...`` (the
    README's route): Hydra would set a boolean and then fail to find a field in it, so ``true`` there means the
    ``activation_checkpointing/selective=attention`` option (the same block: save attention), whose fields follow."""
    keys = [arg.partition("=")[0].lstrip("+~") for arg in argv]
    if not any(key.startswith("activation_checkpointing.selective.") for key in keys):
        return argv
    return [
        "activation_checkpointing/selective=attention"
        if key == "activation_checkpointing.selective" and arg.partition("=")[2].strip().lower() == "true"
        else arg
        for arg, key in zip(argv, keys)
    ]


def _user_set_block() -> bool:
    """Whether the command line chose or overrode the activation_checkpointing block."""
    overrides = HydraConfig.get().overrides.task
    return any(o.lstrip("+~").startswith("activation_checkpointing") for o in overrides)


def resolve_block(cfg: DictConfig) -> Dict[str, Any]:
    """The job config as plain data with legacy keys migrated into the block."""
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    if find_legacy_keys(data) and not _user_set_block():
        data.pop("activation_checkpointing", None)  # the default option, not a choice of the user's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = migrate_legacy(data)
    for w in caught:
        log.warning("%s", w.message)
    return data


PROGRESS = ("auto", "bar", "lines")


def progress_mode(value: Any, trainer_cfg: Any = None, terminal: Optional[bool] = None) -> str:
    """``progress``, resolved: ``bar`` (Lightning's progress bar) or ``lines`` (a line a step, with the time left).
    ``auto`` is the bar on a terminal (``terminal``: whether stdout, where the bar goes, is one) and lines otherwise,
    where a bar would print nothing readable (a log file, CI)."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in PROGRESS:
        raise ConfigError(
            f"progress: expected auto, bar or lines, got {value!r}. auto shows Lightning's progress bar on a terminal "
            "and a line a step with the time left otherwise; bar and lines choose one of them."
        )
    if trainer_cfg is not None and "enable_progress_bar" in trainer_cfg:
        raise ConfigError(
            f"trainer.enable_progress_bar={trainer_cfg['enable_progress_bar']!r}: the job's progress key chooses "
            "it. Set progress=bar (Lightning's progress bar), progress=lines (a line a step) or progress=auto instead."
        )
    if text == "auto":
        return "bar" if (sys.stdout.isatty() if terminal is None else terminal) else "lines"
    return text


def run(cfg: DictConfig) -> Dict[str, Any]:
    if not isinstance(cfg.print_every, int) or cfg.print_every < 1:
        raise ConfigError(f"print_every: expected an integer >= 1, got {cfg.print_every!r}.")
    progress = progress_mode(cfg.progress, cfg.trainer)
    if parse_bool(cfg.estimate, "estimate"):
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        estimated = run_estimate(cfg, out_dir)
        log.info("estimate: %s, %s (nothing trained)", out_dir / "estimate.md", out_dir / "estimate.json")
        return estimated
    if cfg.model.config.vocab_size < 256:
        raise ConfigError(
            "model.config.vocab_size: the example trains on bytes, so it needs >= 256, "
            f"got {cfg.model.config.vocab_size}."
        )
    choice = HydraConfig.get().runtime.choices.get("activation_checkpointing")
    if choice == "schema":
        raise ConfigError(
            "activation_checkpointing=schema is the fields every option extends, not a mode. Choose a mode: "
            + ", ".join(p.stem for p in sorted((CONF / "activation_checkpointing").glob("*.yaml")))
            + " (python examples/train.py --help lists them)."
        )
    legacy = find_legacy_keys(OmegaConf.to_container(cfg, resolve=True))
    data = resolve_block(cfg)
    block = parse_config(data.get("activation_checkpointing"))
    callbacks = callbacks_from_config(
        block,
        layer_offloading=data.get("layer_offloading", False),
        layer_offloading_resident_layers=data.get("layer_offloading_resident_layers", 0),
        # the job's own switches, checked under the names the user writes (report=no is an error, not "on")
        copy_on_host=parse_bool(data.get("offload_copy_on_host", False), "offload_copy_on_host"),
        verify_steps=parse_count(data.get("offload_verify_steps", 0), "offload_verify_steps"),
        verbose=parse_bool(data.get("report", False), "report"),
    )

    pl.seed_everything(cfg.seed, workers=True)
    model = build_model(cfg.model, cfg.lora)
    module = CausalLM(model, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    loader = make_dataloader(cfg.data, vocab_size=cfg.model.config.vocab_size, seed=cfg.seed)
    metrics = StepMetrics(measure_step=cfg.measure.memory_step, warmup_steps=cfg.measure.warmup_steps)
    trainer = pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),
        callbacks=[
            *callbacks,
            metrics,
            LossPrinter(every=1, time_left=True) if progress == "lines" else LossPrinter(every=cfg.print_every),
        ],
        enable_progress_bar=progress == "bar",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)

    peak = metrics.peak
    summary = {
        **_job_identity(),
        # what ran, labelled from the resolved block (a legacy key under the default "off" option recomputes)
        "mode": mode_label(block, choice, bool(legacy)),
        "activation_checkpointing": config_to_dict(block),
        "layer_offloading": bool(data.get("layer_offloading", False)),
        "layer_offloading_resident_layers": data.get("layer_offloading_resident_layers", 0),
        "offload": next((cb.last_step for cb in callbacks if isinstance(cb, ActivationOffload)), None),
        "budget": next((cb.budget_plan for cb in callbacks if isinstance(cb, ActivationCheckpointing)), None),
        "layer_offload": next((cb.last_step for cb in callbacks if isinstance(cb, LayerOffload)), None),
        "steps": trainer.global_step,
        "first_loss": metrics.losses[0] if metrics.losses else None,
        "final_loss": metrics.losses[-1] if metrics.losses else None,
        "peak_memory_bytes": peak.peak_bytes if peak else None,
        "peak_activation_bytes": peak.activation_bytes if peak else None,
        "memory_source": peak.source if peak else None,
        "step_time_s": metrics.median_step_time,
        # torch's CPU kernels are chosen by the vector instructions the CPU has (AVX2, AVX512...), and sum in another
        # order on each: the losses depend on it as well as on the Python version (1 and 2 threads gave the same)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info(
        "done: %d steps, loss %.3f -> %.3f, %s, %s",
        summary["steps"],
        summary["first_loss"] or float("nan"),
        summary["final_loss"] or float("nan"),
        _measured_peak(summary, cfg),
        _measured_step(summary, cfg),
    )
    log.info("summary: %s", out_dir / "summary.json")
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep_dir = Path(HydraConfig.get().sweep.dir)
        write_sweep_summary(sweep_dir)
        log.info("sweep so far: %s, %s", sweep_dir / "sweep_summary.csv", sweep_dir / "sweep_summary.png")
    return summary


def _measured_peak(summary: Dict[str, Any], cfg: DictConfig) -> str:
    if summary["peak_activation_bytes"] is not None:
        return f"activation peak {summary['peak_activation_bytes'] / 2**20:.1f} MiB"
    return (
        f"activation peak not measured (measure.memory_step={cfg.measure.memory_step} is not below "
        f"trainer.max_steps={summary['steps']})"
    )


def _measured_step(summary: Dict[str, Any], cfg: DictConfig) -> str:
    if summary["step_time_s"] is not None:
        return f"median step {summary['step_time_s']:.3f} s"
    return (
        f"step time not measured (trainer.max_steps={summary['steps']} leaves no step after the "
        f"measure.warmup_steps={cfg.measure.warmup_steps} warm-up steps and the memory step; train longer or lower "
        "measure.warmup_steps)"
    )


def _job_identity() -> Dict[str, Any]:
    """What names this job in a sweep: the mode and model chosen, and its overrides."""
    hydra_cfg = HydraConfig.get()
    choices = hydra_cfg.runtime.choices
    return {
        "mode": choices.get("activation_checkpointing"),
        "model": choices.get("model"),
        "overrides": hydra_cfg.job.override_dirname,
    }


def _record_failure(error: str) -> None:
    """In a sweep: this job's summary says how it ended, and the sweep summary includes it."""
    failed = {**_job_identity(), "error": error}
    (Path(HydraConfig.get().runtime.output_dir) / "summary.json").write_text(json.dumps(failed, indent=2) + "\n")
    write_sweep_summary(Path(HydraConfig.get().sweep.dir))


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        run(cfg)
    except ConfigError as err:
        # A bad value is the user's to fix: say what and how, without a traceback; the run's log keeps it too.
        print(f"error: {err}", file=sys.stderr)
        _append_to_job_log(f"error: {err}")
        if not multirun:
            sys.exit(2)
        # In a sweep the other jobs still run: this one is recorded as failed in the sweep summary, and the
        # sweep exits with status 2 once every job has run (sweep.FailedJobs).
        _record_failure(str(err))
    except Exception as err:
        if multirun:  # Hydra runs the other jobs and then reports this one; the sweep summary shows it too
            _record_failure(f"crashed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        raise


def _append_to_job_log(line: str) -> None:
    """Write ``line`` to the job's own log file (``<output dir>/<job name>.log``), which Hydra created."""
    hydra_cfg = HydraConfig.get()
    path = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"
    if path.exists():  # Hydra's job logging made it (not when logging is off or elsewhere)
        with path.open("a") as f:
            f.write(line + "\n")


def _check_block_keys(argv: List[str]) -> None:
    """An override of a field the block lacks fails on the key the user wrote, with the block's own message, where
    Hydra would name the structured config behind it (``Key 'foo' not in 'BlockSchema'``)."""
    for arg in argv[1:]:
        key, sep, _ = arg.partition("=")
        if sep:
            check_block_key(key.lstrip("+~"))


if __name__ == "__main__":
    try:
        _check_block_keys(sys.argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv = _selective_true_with_its_fields(_boolean_choices_as_options(sys.argv))
    main()
