"""One measured training step of an 8B-shaped Llama (random weights, LoRA r=32 on all seven linears, adapters in
bf16, AdamW, batch 1) in one mode at one length, printed as one JSON line, ``LONGCTX {...}``: the allocator's peak
(``measured_total``), the activation peak above what the step started with, step times and losses. The estimator's
figures for the same case come from ``python -m lightning_ac.estimate`` with the same model, ``--set`` values,
``--lora 32 --lora-targets <the seven> --adapter-dtype bfloat16`` (``--qlora-as-loaded`` for ``--qlora``);
``scripts/verdicts.py`` sets the two side by side.

    python scripts/longctx.py MODE SEQ [--qlora] [--model llama3-8b] [--set num_hidden_layers=2 ...]

Made from the 2026-12-04 GPU run's script (``gpu-runs/2026-12-04/longctx.py``); the GPU check
(``scripts/gpu_check.sh``) runs its 8B cases, and its dry run a two-layer model on the CPU (``--set``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import List, Optional

import lightning.pytorch as pl
import torch

from lightning_ac.bench.memory import StepMetrics
from lightning_ac.estimate.models import Training, build_model, load_config, parse_set
from lightning_ac.estimate.modes import resolve_modes
from lightning_ac.estimate.optimizers import optimizer_choice
from lightning_ac.estimate.step import _StepModule, mode_callbacks

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 32


def four_bit(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """The decoder's linears as bitsandbytes nf4 ``Linear4bit``, quantized from the random bf16 weights (what
    ``from_pretrained`` with ``load_in_4bit`` makes of a checkpoint); the head stays bf16."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                q.weight = q.weight.to(device)
                setattr(parent, name, q)
    model.is_loaded_in_4bit = True
    return model


def _model(config, qlora: bool, device: str) -> torch.nn.Module:
    if not qlora:
        return build_model(config, torch.bfloat16, Training(RANK, TARGETS, adapter_dtype="bfloat16"), device=device)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_ac.estimate.models import adapters_in

    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(TARGETS))
    return adapters_in(get_peft_model(four_bit(base, device), lora), "bfloat16")


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", help="an estimator mode, e.g. offload_hidden+chunked_loss+tiled_mlp")
    parser.add_argument("seq", type=int, help="tokens in the one sequence of each step")
    parser.add_argument("--qlora", action="store_true", help="the base's decoder linears in 4-bit nf4 (bitsandbytes)")
    parser.add_argument("--model", default="llama3-8b", help="an estimator preset or config (default llama3-8b)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="a config value"
    )
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_config(args.model, dict(parse_set(item) for item in args.overrides))
    mode = resolve_modes([args.mode], False)[0]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = _model(config, args.qlora, device)
    model.train()
    if device == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    metrics = StepMetrics(measure_step=1, warmup_steps=1)
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[*mode_callbacks(mode, config.num_hidden_layers), metrics],
    )
    ids = torch.randint(0, config.vocab_size, (1, args.seq))
    module = _StepModule(model, optimizer_choice("adamw", device))
    trainer.fit(module, torch.utils.data.DataLoader([ids, ids, ids], batch_size=None))
    peak = metrics.peak
    record = dict(
        mode=args.mode,
        seq=args.seq,
        qlora=args.qlora,
        build_s=round(build_s, 1),
        measured_total=peak.peak_bytes if peak else None,
        measured_activation=peak.activation_bytes if peak else None,
        source=peak.source if peak else None,
        step_times=metrics.step_times,
        warmup_times=metrics.warmup_times,
        losses=metrics.losses,
        # ru_maxrss is in KiB on Linux
        host_rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    if device == "cuda":
        record.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())
    print("LONGCTX " + json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
