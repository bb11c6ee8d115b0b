#!/usr/bin/env bash
# The CUDA checks in one short script, for a machine with a CUDA device: the tests that
# skip without CUDA (pinned arena, copies to and from the device, the activation codec's
# re-projection on a low-priority stream, the adapter on the GPU), then one round of the
# end-to-end serving benchmark with the model on the GPU (FCFS + LRU, Bidaw and all in
# memory), then the whole test suite.
#
#     bash benchmarks/cuda_check.sh            # up to 9 minutes (each step is capped)
#
# Run it from the repository root with tieredkv importable (an installed venv, or
# PYTHONPATH=src). Each step has its own time limit, so one step that hangs does not
# take the others with it; the script's exit status is the first failing step's (the
# benchmark's step fails when a configuration answers differently or a target is missed,
# as bench_serve.py does).
set -u
PY=${PYTHON:-python3}
status=0
step() {  # step SECONDS NAME COMMAND...: run with a time limit, report, keep the first failure
    local limit=$1 name=$2 rc
    shift 2
    echo "=== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: nothing to check here" >&2
    exit 2
fi
nvidia-smi -L || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())"
bench_dir=$(mktemp -d "$PWD/.cuda-check-XXXXXX")  # on the repository's filesystem, not tmpfs
trap 'rm -rf "$bench_dir"' EXIT
df -h "$bench_dir" | tail -1

step 90 "CUDA tests" "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/unit/test_cuda_paths.py tests/unit/test_codecs.py tests/unit/test_vllm_parts.py \
    tests/integration/test_transformers_adapter.py tests/contract/test_tier_contract.py
targets=(--only "FCFS + LRU" --only Bidaw --only "all in memory")
step 150 "serving benchmark on the GPU: default workload, one round" "$PY" \
    benchmarks/bench_serve.py --device cuda --repeat 1 --dir "$bench_dir" "${targets[@]}"
# the crash tests start a Python process per kill round: on a CUDA build of torch each
# import takes seconds, so the whole suite needs minutes there
step 300 "whole test suite with CUDA present" "$PY" -m pytest -q -p no:cacheprovider
exit "$status"
