#!/usr/bin/env bash
# One device run: the gpu-marked tests, the gpu-8k benchmark table, then its torch.compile rows. Meant for the
# `device` tool:
#   run(command="bash scripts/gpu_check.sh", timeout_s=590)
# The device image has torch, transformers, lightning and peft; lightning_ac's CUDA paths need nothing more
# (omegaconf/hydra are only imported by the Hydra job and the legacy YAML printer).
set -uo pipefail
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, lightning; print(torch.__version__, transformers.__version__, lightning.__version__)" | tee -a "$OUT/gpu.txt"
# 1. correctness and memory on the real stream path (a few minutes at most)
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
# 2. the gpu-8k table: ~1B-parameter Llama, bf16, 8k tokens; every mode and anchor, and the layer-offloading
#    modes (k = 0 and k = L/4 resident layers) against the same LoRA run; 2 alternating repetitions
timeout 220 python3 -m lightning_ac.bench --preset gpu-8k --no-compiled --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
# 3. the compiled rows apart (inductor compiles a 16-layer model afresh in each repetition): one repetition of the
#    two that matter most, with their activation peaks from the CUDA allocator, against eager full (the table is
#    written at the end: a timeout here leaves the rep lines in the log)
timeout 110 python3 -m lightning_ac.bench --preset gpu-8k --reps 1 --modes full full_compiled torchtitan_compiled \
  --out "$OUT/bench_compiled" 2>&1 | tee "$OUT/bench_compiled.log"
