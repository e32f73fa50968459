"""``python -m lightning_ac.estimate``: the estimate's table on stdout, a progress line per fake step on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

from lightning_ac.estimate import (
    DTYPES,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    Estimate,
    EstimateError,
    estimate,
    known_modes,
    presets,
)
from lightning_ac.estimate.attention import ATTENTIONS
from lightning_ac.estimate.gpu_plan import plan_markdown
from lightning_ac.estimate.models import ADAPTER_DTYPES, LOSSES, parse_set
from lightning_ac.estimate.render import markdown
from lightning_ac.estimate.timing import GPUS, GpuRates
from lightning_ac.units import size_from_text

__all__ = ["main", "parser"]

JSON_FIELDS = (
    "mode",
    "seq",
    "batch",
    "parameter_bytes",
    "buffer_bytes",
    "gradient_bytes",
    "optimizer_bytes",
    "activation_peak_bytes",
    "activation_peak_at",
    "head_bytes",
    "layer_saved_bytes",
    "layer_input_bytes",
    "outside_bytes",
    "streamed_weight_bytes",
    "host_bytes",
    "flops",
    "device_total_bytes",
    "workspace_bytes",
    "margin_bytes",
    "fits",
    "fits_on",
    "seconds",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_ac.estimate",
        description="Will it fit? Every mode's memory for one training step of a model at the target scale, counted "
        "on the CPU on fake tensors (no memory allocated, nothing downloaded).",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(presets())}), a config.json or model directory, or a transformers model type",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config value (repeatable): --set hidden_size=64 --set num_hidden_layers=2; dotted keys reach nested "
        "configs, and on a multimodal config (gemma3, llama4) an undotted key is its language model's",
    )
    p.add_argument("--seq", type=int, nargs="+", required=True, help="tokens per sequence (one or more lengths)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="the weights' dtype, every op run in it (default bfloat16); not with --precision",
    )
    p.add_argument(
        "--precision",
        default=None,
        metavar="PRECISION",
        help=f"the precision as Trainer(precision=...) takes it: {', '.join(PRECISIONS)} (mixed: float32 weights, "
        "gradients and optimizer state, the step under autocast); not with --dtype",
    )
    training = p.add_mutually_exclusive_group()
    training.add_argument("--lora", type=int, default=16, metavar="R", help="LoRA's rank (default 16)")
    training.add_argument("--full-finetune", action="store_true", help="train every parameter instead of LoRA")
    p.add_argument(
        "--lora-targets", nargs="+", default=None, help="the modules LoRA adapts (default: PEFT's for the model type)"
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="LoRA's dropout (default 0): a dropped copy of each adapted linear's input and its mask (1 byte an "
        "element on a CUDA target, full-size on --target cpu)",
    )
    qlora = p.add_mutually_exclusive_group()
    qlora.add_argument(
        "--qlora",
        action="store_true",
        help="the QLoRA recipe: the frozen base's decoder linears in bitsandbytes 4-bit, LoRA on top, after PEFT's "
        "prepare_model_for_kbit_training (embeddings, norms and head in float32)",
    )
    qlora.add_argument(
        "--qlora-as-loaded",
        action="store_true",
        help="in place of --qlora: the 4-bit model as loaded, for runs that skip prepare_model_for_kbit_training",
    )
    p.add_argument(
        "--adapter-dtype",
        choices=ADAPTER_DTYPES,
        default=None,
        help="LoRA's adapters in this dtype (default: as PEFT makes them, float32 on a 4-bit or half-precision base, "
        "each adapted linear then saving a float32 copy of its input); bfloat16: the adapters compute in bf16 too",
    )
    p.add_argument("--double-quant", action="store_true", help="with --qlora: bnb_4bit_use_double_quant")
    p.add_argument("--quant-type", choices=("nf4", "fp4"), default="nf4", help="with --qlora: default nf4")
    p.add_argument(
        "--attn",
        choices=ATTENTIONS,
        default=None,
        help="the attention implementation (default: what transformers picks for the model: sdpa where it supports "
        "it, else eager); flash_attention_2 is counted as SDPA's flash kernel, which saves what it saves",
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="causal_lm",
        help="causal_lm (labels=input_ids, default) or last_logit_mean (logits_to_keep=1, logits.float().mean())",
    )
    p.add_argument(
        "--first-step",
        action="store_true",
        help="the step starts without gradients or optimizer state (a first step, or after zero_grad(set_to_none="
        "True)): they are allocated in it",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    p.add_argument(
        "--strategy",
        choices=[s for s in STRATEGIES if s != "single"],
        default=None,
        help="how --devices ranks train: ddp (each rank holds the whole model and DDP's gradient buckets) or fsdp "
        "(FSDP2's fully_shard on each decoder layer and the root, as under Lightning's ModelParallelStrategy: each "
        "rank holds 1/N of the states and gathers a layer as it runs); the figures are then one rank's, at the "
        "per-rank --batch (default: one device)",
    )
    p.add_argument("--devices", type=int, default=None, metavar="N", help="the number of ranks, with --strategy")
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help=f"default: every mode ({', '.join(known_modes())}; and budget, with --device-memory); "
        "NAME+chunked_loss; chunked_loss adds each with it; budget, with --device-memory, is the memory budget's plan "
        "for each device",
    )
    p.add_argument(
        "--device-memory",
        nargs="+",
        default=None,
        metavar="SIZE",
        help="the device's size (80GiB, 24GB), or several: fits or not, and the longest length that fits",
    )
    p.add_argument(
        "--seq-step", type=int, default=512, help="granularity of the longest-length search (default 512 tokens)"
    )
    p.add_argument(
        "--no-longest", action="store_true", help="with --device-memory, skip the search for the longest length"
    )
    p.add_argument("--target", choices=("cuda", "cpu"), default="cuda", help="cuda rounds allocations to 512 bytes")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    plan = p.add_argument_group("the budget's plan on a GPU (--plan)")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the block the memory budget would settle on for the first --device-memory on --gpu: per layer "
        "keep / selective / recompute / recompute with the input in host memory, the chunked loss and the tiled MLP "
        "weighed; its predicted device peak, host bytes and step against off's and full's",
    )
    plan.add_argument("--gpu", choices=sorted(GPUS), default=None, help="the GPU whose rates price the step")
    plan.add_argument("--tflops", type=float, default=None, help="another GPU: its dense bf16 TFLOP/s")
    plan.add_argument("--memory-gbps", type=float, default=None, help="another GPU: its memory bandwidth, GB/s")
    plan.add_argument("--link-gbps", type=float, default=None, help="the host link, GB/s each way (a pinned copy)")
    plan.add_argument(
        "--host-memory", default=None, metavar="SIZE", help="the host memory the offloaded inputs may hold (256GiB)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write estimate.md, estimate.json and estimate.png (activation peak and device total against the "
        "length, per mode, with the devices' lines; needs matplotlib)",
    )
    return p


def _plan_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple:
    """``--plan``'s GPU (named, or its rates given; a name's rates may be overridden) and host memory."""
    given = {"bf16_tflops": args.tflops, "memory_gbps": args.memory_gbps, "link_gbps": args.link_gbps}
    if not args.plan:
        if args.gpu or any(v is not None for v in given.values()) or args.host_memory:
            p.error("--gpu, --tflops, --memory-gbps, --link-gbps and --host-memory go with --plan")
        return None, None
    if args.gpu is None and any(v is None for v in given.values()):
        p.error(f"--plan needs --gpu ({', '.join(sorted(GPUS))}), or --tflops, --memory-gbps and --link-gbps")
    base = GPUS[args.gpu] if args.gpu else GpuRates(0, 0, 0)
    rates = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    flags = {"--tflops": rates.bf16_tflops, "--memory-gbps": rates.memory_gbps, "--link-gbps": rates.link_gbps}
    bad = [f"{flag} {value}" for flag, value in flags.items() if not (math.isfinite(value) and value > 0)]
    if bad:  # NaN passes a "<= 0" test, and would price every step at NaN
        p.error(f"--tflops, --memory-gbps and --link-gbps must be positive and finite, got {', '.join(bad)}")
    host = size_from_text(args.host_memory) if args.host_memory else None
    if args.host_memory and host is None:
        p.error(f"--host-memory {args.host_memory!r}: expected a size such as 256GiB")
    return (args.gpu or "custom", rates), host


def to_json(result: Estimate) -> dict:
    """The JSON the CLI writes: the run's description, one object per mode and length, and the longest fits."""
    return {
        "model": result.model,
        "description": result.description,
        "dtype": result.dtype,
        "training": result.training,
        "optimizer": result.optimizer,
        "target": result.target,
        "ranks": result.ranks,
        "device_memory_bytes": result.device_memory_bytes,
        "steps": [{k: step.as_dict()[k] for k in JSON_FIELDS} for step in result.steps],
        "longest": [vars(fit) for fit in result.longest],
        "search_steps": [{k: step.as_dict()[k] for k in JSON_FIELDS} for step in result.search_steps],
        "budget_plans": [{**vars(p), "setting": p.setting, "layers": p.layers} for p in result.budget_plans],
        "notes": result.notes,
    }


def cost_line(result: Estimate, seconds: float) -> str:
    """What the estimate cost this machine: its fake steps, the slowest, the wall time, and the most memory this
    process held (the estimator's own: fake tensors allocate none of the model's)."""
    steps = result.steps + result.search_steps
    slowest = max(steps, key=lambda s: s.seconds, default=None)
    line = f"estimate: {len(steps)} fake steps in {seconds:.0f} s"
    if slowest is not None:
        line += f", the slowest {slowest.seconds:.1f} s ({slowest.mode} at {slowest.seq} x {slowest.batch})"
    try:
        import resource
    except ImportError:  # not on Windows
        return line
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    return line + f"; this process held at most {peak_kib / 2**20:.2f} GiB (maximum resident set)"


def main(argv: Optional[List[str]] = None) -> Estimate:
    p = parser()
    args = p.parse_args(argv)
    if args.out is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--out plots with matplotlib, which is not installed: pip install 'lightning_ac[examples]'")
    started = time.perf_counter()
    plan_on, host_memory = _plan_arguments(p, args)
    try:
        overrides = dict(parse_set(item) for item in args.sets)
        result = estimate(
            args.model,
            args.seq,
            batch=args.batch,
            dtype=args.dtype,
            precision=args.precision,
            lora=None if args.full_finetune else args.lora,
            full_finetune=args.full_finetune,
            lora_targets=args.lora_targets,
            lora_dropout=args.lora_dropout,
            optimizer=args.optimizer,
            modes=args.modes,
            device_memory=args.device_memory,
            overrides=overrides,
            target=args.target,
            longest=not args.no_longest,
            seq_step=args.seq_step,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            attention=args.attn,
            qlora=args.qlora or args.qlora_as_loaded,
            qlora_as_loaded=args.qlora_as_loaded,
            double_quant=args.double_quant,
            adapter_dtype=args.adapter_dtype,
            quant_type=args.quant_type,
            loss=args.loss,
            first_step=args.first_step,
            strategy=args.strategy,
            plan_on=plan_on,
            host_memory=host_memory,
            devices=args.devices,
        )
    except EstimateError as err:
        p.error(str(err))
    print(markdown(result) + (plan_markdown(result.gpu_plans) if result.gpu_plans else ""), end="")
    print(cost_line(result, time.perf_counter() - started), file=sys.stderr)
    data = json.dumps(to_json(result), indent=2) + "\n"
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(data)
    if args.out is not None:
        from lightning_ac.estimate.plot import plot

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "estimate.md").write_text(markdown(result))
        (args.out / "estimate.json").write_text(data)
        plot(result, args.out / "estimate.png")
        print(f"written: {args.out / 'estimate.md'}, {args.out / 'estimate.json'}, {args.out / 'estimate.png'}",
              file=sys.stderr)  # fmt: skip
    return result
