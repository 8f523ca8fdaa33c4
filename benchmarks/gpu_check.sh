#!/usr/bin/env bash
# The GPU check, for a bare offline machine with one CUDA GPU (an H100 or H200 with PyTorch and transformers
# installed, no network, the working tree and at most 64 MiB beside it). NOT YET RUN ON A GPU: its CPU version runs
# in the slow tests (tests/test_gpu_check.py).
#
#     bash benchmarks/gpu_wheels.sh                  # here, beforehand (PyPI): the missing wheels into .gpu-wheels
#     bash benchmarks/gpu_check.sh --out $OUT        # there (the device tool: carry [".gpu-wheels"]), < 10 min
#     bash benchmarks/gpu_check.sh --device cpu      # anywhere: the same check scaled down, < 8 min on 2 cores
#     bash benchmarks/gpu_check.sh --out $OUT -- --parts trainers compare   # some parts only (gpu_check.py --help)
#
# 1. Packages: nothing is installed when `import torch, transformers, tyro, math_verify` works. Else the wheels in
#    --wheels (default .gpu-wheels) go into a folder of their own (pip install --no-index --no-deps --target), put
#    first on PYTHONPATH; --force-wheels installs them even when the imports work (a check of the folder). Then each
#    wheel's requirements are checked against what this machine has (a version too old, a package missing: one
#    line naming them, exit 1), before anything imports them.
# 2. python benchmarks/gpu_check.py --device DEVICE --out OUT, its parts in order of value: real-size updates
#    (Qwen3-4B's width, 16,384-token micro-batches, with and without --offload-optimizer) against the memory plan;
#    the six trainers 3 steps in bf16 on the tiny model, several at once; ppo.py in float32: exact ratios,
#    --offload-optimizer and --resume against a straight run; the HF engine's speed. What each asserts: its
#    docstring. After each part it writes the table so far (gpu_check.md), gpu_check.json and gpu_check.log to OUT;
#    it keeps to a budget of 540 s on a GPU and is cut at 570 s (the device tool allows 600 s a command): a cut
#    leaves the table of what finished.
# Exit status: 0 when every check passed, 1 when one failed, 2 on a bad flag, 3 when the budget left a part out,
# 124 when cut.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda OUT=runs/gpu_check/out WHEELS=.gpu-wheels FORCE_WHEELS=0 PYTHON=${PYTHON:-python3}
usage="usage: bash benchmarks/gpu_check.sh [--device cuda|cpu] [--out DIR] [--wheels DIR] [--force-wheels] \
[-- gpu_check.py's flags, e.g. --parts trainers compare]"
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=${2:?$usage}; shift 2 ;;
        --out) OUT=${2:?$usage}; shift 2 ;;
        --wheels) WHEELS=${2:?$usage}; shift 2 ;;
        --force-wheels) FORCE_WHEELS=1; shift ;;
        --) shift; break ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda) LIMIT=570 ;; cpu) LIMIT=1800 ;; *) echo "$usage" >&2; exit 2 ;; esac
start=$SECONDS
imports="import torch, transformers, tyro, math_verify"
if [ "$FORCE_WHEELS" = 1 ] || ! "$PYTHON" -c "$imports" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
        echo "gpu_check: '$imports' fails and $WHEELS holds no wheels: run bash benchmarks/gpu_wheels.sh where PyPI" \
             "is in reach, and carry $WHEELS" >&2
        exit 1
    fi
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels of $WHEELS failed" >&2; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    "$PYTHON" benchmarks/gpu_check_runs.py requirements "$SITE" || exit 1  # one line: what the wheels need, missing
    "$PYTHON" -c "$imports" || { echo "gpu_check: '$imports' fails after installing $WHEELS" >&2; exit 1; }
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE in $((SECONDS - start)) s"
fi
"$PYTHON" -c "import tyro, math_verify; print('tyro', tyro.__version__, 'from', tyro.__file__)"
export PYTHONUNBUFFERED=1
# In the background so that a SIGTERM to this script (the caller's timeout) reaches the check, which then stops its
# processes and writes what finished; timeout sends it SIGTERM at $LIMIT s, SIGKILL 20 s later.
timeout -k 20 "$LIMIT" "$PYTHON" benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT" "$@" &
child=$!
trap 'kill -TERM $child 2> /dev/null' TERM INT
wait $child
status=$?
if [ $status -gt 128 ] && kill -0 $child 2> /dev/null; then  # the wait was interrupted by a signal: the check ends
    wait $child
    status=$?
fi
echo "gpu_check.sh: exit $status after $((SECONDS - start)) s; table and figures in $OUT"
exit $status
