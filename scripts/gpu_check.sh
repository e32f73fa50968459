#!/usr/bin/env bash
# The GPU check, all of it in one command of at most 9 minutes on the lent machine (one H200, no network, at most 8
# files back from $OUT). Its image has torch 2.11 and transformers 5.17 (below this project's floor) and lacks
# bitsandbytes, trl, hydra-core and omegaconf: they come as wheels beside the project, downloaded here first:
#
#   bash scripts/gpu_wheels.sh                                   # -> .gpu_wheels/ (git-ignored, ~22 MiB)
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=590)
#
# Steps, in order, each under its own time limit (their sum, the estimates overlapping the tests, fits in 540 s):
# the wheels unpacked onto PYTHONPATH and the versions; the estimator's figures for the 8B cases (on the CPU, in the
# background while the GPU runs the tests); the gpu-marked tests; the gpu-8k benchmark (the modes the goals compare);
# the 8B long-context cases (scripts/longctx.py); the compiled rows; the verdicts (scripts/verdicts.py). Back in $OUT:
# gpu_check.tgz (every log and result), verdicts.md (each goal: measured, target, pass/fail) and steps.log,
# refreshed after every step, so a run cut short still returns what it measured.
#
#   bash scripts/gpu_check.sh --dry-run     # on a CPU: the same steps in order, CUDA work replaced by tiny stand-ins
set -uo pipefail
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_check.sh [--dry-run]  (unknown argument: $1)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
R="$WORK/gpu_check"  # everything the steps write; archived into $OUT/gpu_check.tgz
SITE="$WORK/site"    # the unpacked wheels
mkdir -p "$R"
trap 'rm -rf "$WORK"' EXIT
WHEELS="$ROOT/.gpu_wheels"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Time limits (s). The estimates run on the CPU beside the tests, so the two count once, as the longer.
T_SETUP=30 T_ESTIMATES=100 T_TESTS=100 T_BENCH=200 T_LONGCTX=60 T_COMPILED=80 T_VERDICTS=10
TOTAL=$(( T_SETUP + (T_ESTIMATES > T_TESTS ? T_ESTIMATES : T_TESTS) + T_BENCH + 2 * T_LONGCTX + T_COMPILED + T_VERDICTS ))
LIMIT=540
if (( TOTAL > LIMIT )); then
  echo "error: the steps' time limits add up to $TOTAL s, over the $LIMIT s the check has in one device call:" \
    "lower a T_* limit at the top of this script" >&2
  exit 2
fi

# The 8B cases (scripts/longctx.py and the estimator), the gpu-8k modes the goals compare, and the compiled rows
SEQ=32768
SET=()
LONGCTX_MODES=("offload_hidden+chunked_loss+tiled_mlp" "offload_hidden+chunked_loss")
BENCH_MODES=(off full every_2 selective_attn torch_sac offload_hidden offload_all offload_only lora_full layer_offload
  auto_25 auto_50 auto_75)
COMPILED_MODES=(full_compiled selective_attn_compiled)
BENCH_ARGS=(--preset gpu-8k)
if (( DRY )); then
  # a two-layer model of the 8B's kind and a short sequence; in the benchmark, a two-layer Llama and one step of
  # the modes a CPU runs (the offload modes need an accelerator)
  SEQ=128
  SET=(--set num_hidden_layers=2 --set hidden_size=64 --set intermediate_size=128 --set num_attention_heads=4
       --set num_key_value_heads=2 --set vocab_size=256)
  BENCH_MODES=(off full every_2 selective_attn torch_sac lora_full layer_offload auto_25 auto_50 auto_75)
  echo '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}' \
    >"$R/tiny_model.json"
  BENCH_ARGS=(--preset cpu-small --model "$R/tiny_model.json" --seq 32 --reps 1 --steps 1)
fi
LORA=(--lora 32 --lora-targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj --adapter-dtype bfloat16)

N=0
M=9  # the step lines: setup, estimates started, gpu_tests, estimates joined, bench, 2 x longctx, compiled, verdicts
pack() {
  cp "$R/steps.log" "$OUT/steps.log" 2>/dev/null
  tar czf "$OUT/gpu_check.tgz" -C "$WORK" gpu_check 2>/dev/null
}
report() {  # NAME LIMIT RC SECONDS
  echo "step $N/$M: $1 ... rc=$3 ($4 s of $2 s)" | tee -a "$R/steps.log"
  pack
}
# run_step NAME LIMIT LOG COMMAND...: COMMAND under `timeout LIMIT`, its output appended to $R/LOG
run_step() {
  local name=$1 limit=$2 log=$3 start rc
  shift 3
  N=$(( N + 1 ))
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >>"$R/$log" 2>&1
  rc=$?
  report "$name" "$limit" "$rc" $(( $(date +%s) - start ))
  return 0
}
# start_background NAME LIMIT LOG COMMAND...: the same, while the next steps run; join_background reports it
start_background() {
  local limit=$2 log=$3
  BG_NAME=$1 BG_LIMIT=$2 BG_START=$(date +%s)
  shift 3
  N=$(( N + 1 ))
  ( timeout -k 5 "$limit" "$@" >>"$R/$log" 2>&1; echo $? >"$R/.background_rc" ) &
  BG_PID=$!
  echo "step $N/$M: $BG_NAME ... started in the background (limit $BG_LIMIT s)" | tee -a "$R/steps.log"
}
join_background() {
  N=$(( N + 1 ))
  wait "$BG_PID"
  report "$BG_NAME (joined)" "$BG_LIMIT" "$(cat "$R/.background_rc" 2>/dev/null || echo '?')" \
    $(( $(date +%s) - BG_START ))
}

# 1. the wheels onto PYTHONPATH (ahead of the image's packages), the machine and the versions. The dry run unpacks
#    them too (whether they unpack) but keeps its own environment.
setup() {
  local failed=0
  if [ -d "$WHEELS" ]; then
    python3 - "$WHEELS" "$SITE" <<'PY' || failed=1
import glob, os, sys, zipfile
wheels = sorted(glob.glob(os.path.join(sys.argv[1], "*.whl")))
for wheel in wheels:
    zipfile.ZipFile(wheel).extractall(sys.argv[2])
print(f"unpacked {len(wheels)} wheels into {sys.argv[2]}: {', '.join(os.path.basename(w) for w in wheels)}")
PY
  else
    echo "no $WHEELS: nothing to unpack (bash scripts/gpu_wheels.sh makes it; name it in the call's carry)"
    (( DRY )) || failed=1
  fi
  if (( DRY )); then
    echo "dry run: no CUDA step runs"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    nproc
    free -g | head -2
  fi
  python3 - <<'PY' || failed=1
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "transformers", "lightning", "peft", "trl", "bitsandbytes", "hydra", "omegaconf"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), getattr(getattr(module, "version", None), "cuda", "") or "")
    except Exception as err:  # a missing package is reported, not fatal: the steps that need it say so
        print(name, "not importable:", type(err).__name__, err)
import torch
import lightning_ac
print("lightning_ac imported; CUDA available:", torch.cuda.is_available())
PY
  if (( ! DRY )) && ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no CUDA device here; on a CPU run bash scripts/gpu_check.sh --dry-run"
    failed=1
  fi
  return $failed
}
export -f setup
export DRY WHEELS SITE
if (( ! DRY )); then
  export PYTHONPATH="$ROOT:$SITE"
fi
echo "gpu check$( (( DRY )) && echo ' (dry run)'): $M steps, time limits $TOTAL s of $LIMIT s; results in $R" \
  | tee "$R/steps.log"
run_step setup "$T_SETUP" setup.log bash -c setup

# 2. the estimator's figures for the 8B cases (CPU only), beside the tests
start_background estimates "$T_ESTIMATES" estimate.log python3 -m lightning_ac.estimate --model llama3-8b "${SET[@]}" \
  "${LORA[@]}" --seq "$SEQ" --modes "${LONGCTX_MODES[@]}" --no-longest --target cuda --json "$R/estimate.json"

# 3. the gpu-marked tests, the offload oracle on real streams among them (4 workers where pytest-xdist is installed);
# the dry run collects them
GPU_TESTS=(tests/test_gpu.py tests/test_offload_residency.py)
if (( DRY )); then
  run_step gpu_tests "$T_TESTS" gpu_tests.log python3 -m pytest -m gpu "${GPU_TESTS[@]}" -q -p no:cacheprovider \
    --collect-only
else
  XDIST=()
  python3 -c "import xdist" 2>/dev/null && XDIST=(-n 4)
  run_step gpu_tests "$T_TESTS" gpu_tests.log python3 -m pytest -m gpu "${GPU_TESTS[@]}" -q -p no:cacheprovider \
    -rA --durations=20 "${XDIST[@]}"
fi
join_background

# 4. the gpu-8k benchmark: the modes the goals compare that this benchmark knows (a row added later, torch_sac, is
#    left out until it exists), 2 alternating repetitions; the modes are sorted out in the benchmark's own process
bench_known() {
  python3 - "$@" <<'PY'
import sys

from lightning_ac.bench.cli import main
from lightning_ac.bench.modes import ALL_ANCHORS, ALL_SUITE_MODES

split = sys.argv.index("--modes")
args, wanted = sys.argv[1:split], sys.argv[split + 1 :]
known = [m for m in wanted if m in ALL_SUITE_MODES or m in ALL_ANCHORS]
print("modes:", *known, "| not in this benchmark:", *(sorted(set(wanted) - set(known)) or ["none"]), flush=True)
main([*args, "--modes", *known])
PY
}
export -f bench_known
run_step bench "$T_BENCH" bench.log bash -c 'bench_known "$@"' bench_known "${BENCH_ARGS[@]}" --no-compiled \
  --out "$R/bench" --modes "${BENCH_MODES[@]}"

# 5, 6. the 8B cases at 32k tokens, untiled and tiled, one process each
for mode in "${LONGCTX_MODES[@]}"; do
  run_step "longctx $mode" "$T_LONGCTX" longctx.log python3 scripts/longctx.py "$mode" "$SEQ" "${SET[@]}"
done

# 7. the compiled rows, one repetition (inductor compiles the 16-layer model afresh in each); the dry run asks the
#    benchmark for its usage only (compiling takes minutes on a CPU)
if (( DRY )); then
  run_step bench_compiled "$T_COMPILED" bench_compiled.log python3 -m lightning_ac.bench --help
else
  run_step bench_compiled "$T_COMPILED" bench_compiled.log python3 -m lightning_ac.bench --preset gpu-8k --reps 1 \
    --modes "${COMPILED_MODES[@]}" --out "$R/bench_compiled"
fi

# 8. the verdicts: each goal's figure, target and pass/fail
run_step verdicts "$T_VERDICTS" verdicts.log python3 scripts/verdicts.py "$R" -o "$R/verdicts.md"
cp "$R/verdicts.md" "$OUT/verdicts.md" 2>/dev/null || echo "no verdicts.md: see verdicts.log in the archive" >&2
pack
echo "gpu check done: $OUT/gpu_check.tgz, $OUT/verdicts.md, $OUT/steps.log"
