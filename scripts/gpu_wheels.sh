#!/usr/bin/env bash
# The wheels the GPU check installs on the lent machine (scripts/gpu_check.sh), downloaded here, where the package
# index is reachable. That machine has no network; its image holds torch 2.11, Lightning 2.6.6, accelerate,
# huggingface_hub, tokenizers, safetensors, pytest-xdist, but transformers 5.17 (below this project's floor) and no
# bitsandbytes, trl, hydra-core or omegaconf. Run from the repository root:
#
#   bash scripts/gpu_wheels.sh            # -> .gpu_wheels/ (git-ignored), about 25 MiB
#
# then name the folder in the device call: run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], ...).
# A call carries at most 64 MiB with the project, so bitsandbytes keeps only its CUDA 13 libraries (the image's torch
# is a cu130 build) and its CPU one: 7 MiB of its 43.
set -euo pipefail
DEST="${1:-.gpu_wheels}"
# The lent machine's interpreter (CPython 3.12 on x86-64 Linux) and the releases the project is tested with
# (lightning_ac/_compat.py TESTED; trl and bitsandbytes as the 2026-12-04 run had them). hydra-core and omegaconf
# are only imported by the Hydra job and the YAML printer, whose tests are among the gpu run's imports.
PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"
PACKAGES=(transformers==5.24.0 peft==0.21.2 trl==1.16.0 bitsandbytes==0.50.2 hydra-core==1.3.8 omegaconf==2.3.1)
# omegaconf and hydra-core pin antlr4-python3-runtime 4.9.*, published as a source archive only: built here into a
# pure-Python wheel
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)
# pip matches manylinux_2_N exactly: every N the downloads above use is named
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)
LIMIT_MIB=50  # what may travel beside a ~3 MiB project under the call's 64 MiB

rm -rf "$DEST"
mkdir -p "$DEST"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  "${platform_args[@]}" -d "$DEST" "${PACKAGES[@]}"
python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "${SOURCE_ONLY[@]}"

# bitsandbytes: drop every native library but the CUDA 13 ones and the CPU one (and their RECORD lines, so that
# the wheel still describes its contents)
python3 - "$DEST" <<'PY'
import glob
import os
import re
import sys
import zipfile

KEEP = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
for wheel in glob.glob(os.path.join(sys.argv[1], "bitsandbytes-*.whl")):
    trimmed = wheel + ".tmp"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {n for n in src.namelist() if n.endswith(".so") and not KEEP.search(n)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
            dst.writestr(info, data)
    os.replace(trimmed, wheel)
    kept = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
    if not any("cuda13" in n for n in kept):
        sys.exit(f"{wheel}: no CUDA 13 library left in it ({kept}); the GPU machine's torch is a cu130 build")
    print(f"{os.path.basename(wheel)}: kept {', '.join(os.path.basename(n) for n in kept)}")
PY

ls -l "$DEST"
total_kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: $(( total_kib / 1024 )) MiB"
if (( total_kib > LIMIT_MIB * 1024 )); then
  echo "error: $DEST holds $(( total_kib / 1024 )) MiB, over the ${LIMIT_MIB} MiB that can travel beside the project" \
    "(a device call carries 64 MiB in all): trim another wheel or bring fewer packages" >&2
  exit 1
fi
