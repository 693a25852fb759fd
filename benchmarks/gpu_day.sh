#!/usr/bin/env bash
# The first GPU day in one call: machine facts, the fused-loss tests on CUDA's compiled kernels, the
# GPU check (exactness on CUDA, speed and memory, siglip-kernel and Inf-CL measured beside ours and
# open_clip on the same GPU, their distributed entry points on a 1-rank group), the ring model fed with
# this GPU's block times, every file under $OUT, and a short summary as the last lines of output.
#
# Runs from a bare checkout: the package is not installed, PYTHONPATH is set to the checkout. The
# libraries compared against come as wheels from $GPU_DAY_WHEELS (default .whl/, git-ignored; fill
# it with `bash benchmarks/gpu_day.sh --fetch-wheels` where pip can reach PyPI), installed into a
# temporary --target: pure-Python wheels of open_clip_torch, ftfy, wcwidth, siglip-kernel, inf-cl, and
# einops (the package's one dependency besides torch, there too, so that a machine with torch alone runs
# it; open_clip's other needs, numpy, torchvision, timm, huggingface_hub, regex, safetensors and tqdm, and
# triton, which siglip-kernel and inf-cl need too, are on the GPU machine already). A library missing
# costs its own rows ("skipped: <why>"), never the day. Without CUDA it says so and exits 0
# (GPU_DAY_DRY_RUN=1: it then runs the check's CPU sections at tiny sizes instead, and the ring model
# with its placeholder block time, as a dry run of the whole pipeline).
#
#   OUT=/tmp/out bash benchmarks/gpu_day.sh        # sized for about 7 minutes on one H200
#
# Variables: OUT (default gpu_day_out/), GPU_DAY_WHEELS, GPU_DAY_BUDGET (seconds of measurement,
# default 300), GPU_DAY_TEST_SECONDS (the fused-loss checks on CUDA, default 150), GPU_DAY_DRY_RUN,
# PYTHON (default python3). After the check, at most 3.5 minutes more: the kernels' tile sweep and
# NT-Xent and SupCon's profiles.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_DAY_WHEELS:-$REPO/.whl}"
PINS=(open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.2.13 siglip-kernel==0.1.2 inf-cl==1.2.1 einops==0.8.2)

if [[ "${1:-}" == "--fetch-wheels" ]]; then  # here, where PyPI is reachable; not on the GPU machine
    exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" "${PINS[@]}"
fi

OUT="${OUT:-gpu_day_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/gpu_day.log"
BUDGET="${GPU_DAY_BUDGET:-300}"
TEST_SECONDS="${GPU_DAY_TEST_SECONDS:-150}"
START=$SECONDS
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1 OUT

main() {
echo "== gpu_day: $(date -u '+%Y-%m-%d %H:%M:%S') UTC, checkout $REPO ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
SITE=""
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$(mktemp -d /tmp/gpu_day_site.XXXXXX)"
    trap 'rm -rf "$SITE"' EXIT
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl; then
        echo "wheels: installed into $SITE: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    else
        echo "wheels: pip install from $WHEELS failed; the comparisons will say what is missing"
    fi
else
    echo "wheels: none in $WHEELS (bash benchmarks/gpu_day.sh --fetch-wheels fills it); open_clip, siglip-kernel and Inf-CL rows will be skipped"
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}"

echo "== machine"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
        --format=csv 2>&1 | tee "$OUT/machine.txt"
fi
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/machine.txt"
import importlib, importlib.util, os, sys
import torch
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}; cuda available: {cuda}")
if cuda:
    print(f"GPU {torch.cuda.get_device_name()}; capability {torch.cuda.get_device_capability()}; "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
print(f"TF32: matmul {torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.allow_tf32}, "
      f"float32 matmul precision {torch.get_float32_matmul_precision()}")
for name in ("CONTRASTIVE_DIST_PRODUCTS", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"):
    print(f"{name}={os.environ.get(name, '(unset)')}")
# siglip_kernel asks the driver for the GPU's architecture when imported: without one it raises.
for module in ("triton", "contrastive_dist", "open_clip", "open_clip.loss", "siglip_kernel", "inf_cl"):
    try:
        imported = importlib.import_module(module)
        print(f"import {module}: ok {getattr(imported, '__version__', '')} ({getattr(imported, '__file__', '')})")
    except Exception as error:
        spec = importlib.util.find_spec(module.split(".")[0])
        where = f"installed at {spec.origin}" if spec else "not installed"
        print(f"import {module}: FAILED ({where}) {type(error).__name__}: {str(error).splitlines()[0][:120]}")
device = torch.device("cuda" if cuda else "cpu")
try:
    from contrastive_dist.losses import product_route
    print(f"product route on {device.type}: bf16 {product_route(torch.bfloat16, device)}; "
          f"fp32 {product_route(torch.float32, device)}")
except Exception as error:
    print(f"product route: unknown, the package does not import: {type(error).__name__}: {error}")
sys.exit(0 if cuda else 3)
PY
CUDA_STATUS=${PIPESTATUS[0]}

CHECK=("$PYTHON" benchmarks/gpu_check.py --out "$OUT")
if [[ $CUDA_STATUS -ne 0 && $CUDA_STATUS -ne 3 ]]; then
    echo "gpu_day: the machine facts failed (exit status $CUDA_STATUS; torch does not import?)"
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'
    CUDA_STATUS=$?
fi
if [[ $CUDA_STATUS -ne 0 ]]; then
    echo "gpu_day: no CUDA device on this machine: nothing to measure"
    if [[ "${GPU_DAY_DRY_RUN:-0}" == "1" ]]; then
        echo "== dry run: the check's CPU sections at tiny sizes"
        OMP_NUM_THREADS=1 "${CHECK[@]}" --device cpu --tiny --point-seconds 0.02
        echo "dry run: gpu_check exit status $?"
        "$PYTHON" benchmarks/ring_model.py >"$OUT/ring_model.md" 2>&1
        echo "dry run: ring model (placeholder block times) exit status $?: $OUT/ring_model.md"
    fi
    echo "== gpu_day: done in $((SECONDS - START)) s (no CUDA: nothing measured); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    return 0
fi

echo "== the fused-loss checks on this GPU's compiled kernels (tests/test_losses_fused_epilogue.py)"
# The checks the suite runs in Triton's interpreter on the CPU, here on CUDA tensors: every loss kind,
# reduction and product route against the float64 loops; the whole log comes back as cuda_tests.log.
CONTRASTIVE_DIST_FUSED_LOSS_CHECKS=1 CONTRASTIVE_DIST_TEST_DEVICE=cuda timeout --kill-after=10 "$TEST_SECONDS" \
    "$PYTHON" -m pytest tests/test_losses_fused_epilogue.py -k test_fused_path -q -p no:cacheprovider \
    -o addopts="-ra" --tb=short >"$OUT/cuda_tests.log" 2>&1
echo "cuda tests: exit status $? (124: stopped at $TEST_SECONDS s): $(tail -n 1 "$OUT/cuda_tests.log")"

echo "== gpu_check: one GPU, measurement budget $BUDGET s"
# The check stops measuring at its budget; the timeout is the backstop that keeps the summary below.
timeout --signal=INT --kill-after=20 $((BUDGET + 120)) "${CHECK[@]}" --time-budget "$BUDGET" --point-seconds 1 \
    --precisions bf16 tf32 fp32
STATUS=$?
echo "== gpu_day: gpu_check exit status $STATUS (1: a section failed; 124: stopped at the backstop)"

echo "== the epilogue kernels' tiles, and NT-Xent and SupCon's step (gpu_tiles.txt, profile_<loss>.txt)"
# Each bounded: what they measure (the tile table of _triton_launch.py, the two losses gpu_check leaves
# out) is worth a minute, not the summary below.
timeout --kill-after=10 90 "$PYTHON" benchmarks/gpu_tiles.py --rows 4096 --columns 65536 >"$OUT/gpu_tiles.txt" 2>&1
echo "gpu_tiles: exit status $? ($(grep -c ' \*$' "$OUT/gpu_tiles.txt") chosen tiles timed)"
for loss in nt_xent supcon; do
    timeout --kill-after=10 60 "$PYTHON" benchmarks/gpu_profile.py --loss "$loss" --batch 32768 --chunk-size default \
        --rows 12 >"$OUT/profile_$loss.txt" 2>&1
    echo "profile $loss: exit status $?: $(grep -m 1 ' ms a step' "$OUT/profile_$loss.txt")"
done
# The multi-GPU ring predicted from this GPU's siglip-kernel block times (a model, not a measurement).
"$PYTHON" benchmarks/ring_model.py --csv "$OUT/gpu_check_1gpu.csv" >"$OUT/ring_model.md" 2>&1
echo "ring model: exit status $? ($OUT/ring_model.md): $(grep -m 1 '^| 4 GPUs, 1 node' "$OUT/ring_model.md")"
echo "== gpu_day: done in $((SECONDS - START)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
# Last: the summary, rebuilt from the CSV on disk (so it comes even when the check was stopped).
"$PYTHON" benchmarks/gpu_check_summary.py "$OUT/gpu_check_1gpu.csv"
return 0
}

main 2>&1 | tee "$LOG"  # everything in the log too; the pipeline ends only when tee has written it all
exit "${PIPESTATUS[0]}"
