#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (one GPU, no network, a few minutes of device time):
#
#   scripts/gpu-device-run.sh WHEELS FASTMOE_SRC [OUT]
#
# In the checkout's root. WHEELS: a folder from scripts/gpu-wheels.sh; FASTMOE_SRC: a fastmoe source
# tree (docs/gpu.md says how both are prepared and carried). Runs `make gpu-check` with the machine's
# own python3 (its torch), bounded to GPU_CHECK_LIMIT_S (default 540 s), then prints the report's GPU
# section and puts what docs/gpu.md's table needs under OUT (default $OUT, else ./gpu-out): the
# gpucheck.json, REPORT.md, and one archive of the step logs and the fastmoe build log.
set -uo pipefail
wheels=${1:?usage: scripts/gpu-device-run.sh WHEELS FASTMOE_SRC [OUT]}
src=${2:?usage: scripts/gpu-device-run.sh WHEELS FASTMOE_SRC [OUT]}
out=${3:-${OUT:-gpu-out}}
limit=${GPU_CHECK_LIMIT_S:-540}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MOEBENCH_RESULTS=${MOEBENCH_RESULTS:-$PWD/results}
t0=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
"$py" -c 'import sys, torch; print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda)'
command -v nvcc >/dev/null && nvcc --version | tail -1 || echo "nvcc: not on PATH"
echo "cores: $(nproc)"

echo "== make gpu-check (at most ${limit} s)"
if command -v make >/dev/null; then
    timeout "$limit" make gpu-check PYTHON="$py" GPU_VENV=/tmp/moebench-gpu-venv WHEELS="$wheels" FASTMOE_SRC="$src" \
        2>&1 | tee "$out/gpu-check.log"
    rc=${PIPESTATUS[0]}
else  # the Makefile's three lines, without make
    export PYTHONDONTWRITEBYTECODE=1
    (PYTHONPATH=$PWD "$py" -m moebench.gpucheck.preflight && \
     PYTHONPATH=$PWD "$py" -m moebench.gpucheck.install --python "$py" --venv /tmp/moebench-gpu-venv \
        --wheels "$wheels" --constraints moebench/constraints.txt && \
     { timeout "$limit" /tmp/moebench-gpu-venv/bin/python -m moebench gpu-check --fastmoe-src "$src"; r=$?; \
       /tmp/moebench-gpu-venv/bin/python -m moebench report; exit $r; }) 2>&1 | tee "$out/gpu-check.log"
    rc=${PIPESTATUS[0]}
fi
echo "== make gpu-check: exit $rc after $(( $(date +%s) - t0 )) s"

run=$(ls -d "$MOEBENCH_RESULTS"/gpu-check/*/ 2>/dev/null | sort | tail -1)
report=$(ls -d "$MOEBENCH_RESULTS"/report/*/ 2>/dev/null | sort | tail -1)
if [ -n "$run" ]; then
    cp "$run/gpucheck.json" "$out/" 2>/dev/null
    tar -czf "$out/gpu-check-logs.tar.gz" -C "$run" steps $(cd "$run" && ls -d fastmoe/build.log 2>/dev/null) \
        2>/dev/null
fi
if [ -n "$report" ]; then
    cp "$report/REPORT.md" "$out/" 2>/dev/null
    echo "== the report's GPU section"
    sed -n '/^## On a GPU/,/^## [^O]/p' "$report/REPORT.md"
fi
echo "== done in $(( $(date +%s) - t0 )) s; files in $out: $(ls "$out" | tr '\n' ' ')"
exit "$rc"
