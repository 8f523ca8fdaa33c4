#!/usr/bin/env bash
# The GPU check of the vLLM path, for a fresh Linux machine with one CUDA GPU and PyPI in reach. UNVERIFIED: no GPU
# was lent while it was written; its CPU-checkable parts are tested (tests/test_gpu_check.py).
#
#     bash benchmarks/gpu_check.sh [RUN_DIR]              # default RUN_DIR: runs/gpu_check
#     PYTHON=/path/to/python bash benchmarks/gpu_check.sh  # an environment that already has requirements-vllm.txt
#     GENERATOR=hf PYTHON=python3 bash benchmarks/gpu_check.sh  # no vLLM: the Hugging Face engine, requirements.txt
#
# 1. installs requirements-vllm.txt (vllm==0.32.0, CUDA) into .venv-gpu, unless PYTHON is given;
# 2. builds a random model of Qwen3-0.6B's shape from its config (benchmarks/gpu_check.py: nothing downloaded);
# 3. runs each of the six trainers 3 steps on it with --generator $GENERATOR (vllm: sleep mode on), 16 prompts,
#    256-token responses, an evaluation of 32 problems x 1 sample at the first and last step, bf16 compute
#    (the flags: benchmarks/gpu_check.py RUN_FLAGS);
# 4. runs benchmarks/bench_update.py on the same shape (update tokens/s and MFU, bf16);
# 5. prints one table (benchmarks/gpu_check.py table). Aimed at under 10 minutes; each run is cut at 150 s.
set -uo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/gpu_check}
GENERATOR=${GENERATOR:-vllm}
mkdir -p "$RUN_DIR"
start=$SECONDS
if [ -z "${PYTHON:-}" ]; then
    python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install -q --upgrade pip
    .venv-gpu/bin/pip install -q -r requirements-vllm.txt || { echo "installing requirements-vllm.txt failed"; exit 1; }
    PYTHON=.venv-gpu/bin/python
fi
export PYTHONUNBUFFERED=1
if [ "$GENERATOR" = vllm ]; then
    "$PYTHON" -c "import vllm; print('vllm', vllm.__version__)" || exit 1
fi
"$PYTHON" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA GPU'; print('torch', \
torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" || exit 1
echo "installed in $((SECONDS - start)) s"
"$PYTHON" benchmarks/gpu_check.py model "$RUN_DIR/model" > /dev/null || exit 1
echo "model built at $((SECONDS - start)) s"

for trainer in $("$PYTHON" benchmarks/gpu_check.py trainers); do  # every trainer file, forks too
    rm -rf "$RUN_DIR/runs/$trainer"
    began=$SECONDS
    mapfile -t flags < <("$PYTHON" benchmarks/gpu_check.py flags "$trainer" "$RUN_DIR" "$GENERATOR")
    timeout 150 "$PYTHON" "$trainer.py" "${flags[@]}" > "$RUN_DIR/$trainer.log" 2>&1
    status=$?
    echo "$status $((SECONDS - began))" > "$RUN_DIR/$trainer.exit"  # exit status, wall seconds
    rm -rf "$RUN_DIR/runs/$trainer/checkpoints"  # float32 weights and Adam states of 0.6B: several GB per run
    echo "$trainer.py: exit $status after $((SECONDS - began)) s (log: $RUN_DIR/$trainer.log)"
done
timeout 120 "$PYTHON" benchmarks/bench_update.py --device cuda --models qwen3-0.6b-shape --min-seconds 5 \
    > "$RUN_DIR/bench_update.txt" 2>&1
echo "total $((SECONDS - start)) s"
"$PYTHON" benchmarks/gpu_check.py table "$RUN_DIR"
