#!/usr/bin/env bash
# The GPU check of issue 11, on one NVIDIA GPU (H100 / H200 class): unattended, under 5 minutes
# after set-up, every figure in one results file (default gpu_check_results.txt, or $1):
#   1. the kernel tests (tests/attention/triton) compiled and run on the device, no interpreter;
#   2. decode attention bandwidth against a device-to-device copy (64 x 4,096 and mixed
#      63 x 256 + 1 x 32,768), paged vs dense SDPA, decode launch configurations, prefill;
#   3. engine tokens/s (pagedkv.LLM, random ~1B Llama, bf16) against transformers generate;
#   4. the engine's greedy tokens and logprobs against transformers' logits (float32, fp8 KV,
#      speculative decoding, LoRA adapters merged).
# Parts 2 to 4 are bench/gpu_check.py. Each part runs under its own time limit (480 s in
# all), and a part that fails is recorded with its exit status while the others still run.
#
# Set-up is the project's own: `make .venv/.installed` (torch==2.13.0, whose Linux x86-64 wheel
# on the package index is the CUDA build, and triton 3.9.0 from the test extra). On a machine
# without network whose python already has CUDA torch, triton, pytest and transformers, set
# PYTHON=/path/to/python: nothing is installed and pagedkv is imported from src/.
# Without a GPU, GPU_CHECK_DEVICE=cpu runs the same steps at tiny shapes (Triton's interpreter,
# the engine on the CPU): a check of the script, whose figures mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-gpu_check_results.txt}
: >"$results"

log() { echo "$*" | tee -a "$results"; }

# run_part NAME COMMAND...: run, output and exit status to the results file.
run_part() {
    local name=$1 start=$SECONDS status
    shift
    log "== $name"
    "$@" 2>&1 | tee -a "$results"
    status=${PIPESTATUS[0]}
    log "== $name: exit status $status after $((SECONDS - start)) s"
}

# The kernel tests in three processes at once: on the device their time is Triton compiling
# the kernel variants the tests need, one CPU core each (compiled kernels are shared through
# Triton's cache).
kernel_tests() {
    local attention=tests/attention/triton/test_triton_attention.py shards pids=() status=0 i
    shards=("$attention::test_decode_matches_reference" "$attention::test_prefill_matches_reference"
        "tests/attention/triton --deselect $attention::test_decode_matches_reference --deselect $attention::test_prefill_matches_reference")
    for i in "${!shards[@]}"; do
        # shellcheck disable=SC2086 # each shard is a list of pytest arguments
        timeout "$test_limit" "$PYTHON" -m pytest ${shards[$i]} -q -p no:cacheprovider \
            >"$results.shard$i" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { status=$?; echo "pytest ${shards[$i]}: exit status $status"; }
        cat "$results.shard$i" && rm -f "$results.shard$i"
    done
    return $status
}

if [[ -z ${PYTHON:-} ]]; then
    make .venv/.installed || { log "set-up failed: make .venv/.installed"; exit 1; }
    PYTHON=.venv/bin/python
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

# GPU_CHECK_DEVICE=cpu dry-runs the whole script here: interpreter tests, tiny shapes.
device=${GPU_CHECK_DEVICE:-cuda}
test_limit=120
[[ $device == cpu ]] && test_limit=900 # the interpreter on a small CPU, not a device budget
log "# pagedkv GPU check ($device), $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ $device == cuda ]]; then
    log "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
    if ! "$PYTHON" - 2>&1 <<'EOF' | tee -a "$results"; then
import torch, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if not torch.cuda.is_available():
    raise SystemExit("torch sees no CUDA device: a CPU build of torch, or no driver")
print(f"device: {torch.cuda.get_device_name()}")
EOF
        log "no usable CUDA device: stopping (GPU_CHECK_DEVICE=cpu dry-runs the script)"
        exit 1
    fi
fi

start=$SECONDS
run_part "kernel tests (limit $test_limit s)" kernel_tests
run_part "kernel figures (limit 80 s)" timeout 80 "$PYTHON" bench/gpu_check.py kernels --device "$device"
run_part "engine figures (limit 180 s)" timeout 180 "$PYTHON" bench/gpu_check.py engine --device "$device"
run_part "engine agreement (limit 100 s)" timeout 100 "$PYTHON" bench/gpu_check.py agreement --device "$device"
log "== summary (all parts: $((SECONDS - start)) s)"
log "$(grep -E "goal|passed|failed|Error" "$results" | grep -v "^==")"
