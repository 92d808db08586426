#!/usr/bin/env bash
# The one prepared GPU check of the kernels (issue #3), for a machine with CUDA, torch and triton
# already installed (the device machines' image: python3 with torch 2.11 / triton 3.6, no network).
# It needs nothing else from this project's pins: kernels/, its tests and bench/kernels.py import
# only torch, triton, numpy and pytest.
#
#   bash bench/gpu_check.sh            # writes to $OUT if set, else ./gpu-check-out
#
# Steps, each with its own time limit, all run even if one fails; the exit status is the first
# failure's. Sized for well under 10 minutes on an H200 (the largest shapes dominate):
#   1. nvidia-smi and the versions seen;
#   2. the `gpu`-marked tests (production shapes against the torch references) and the triton
#      kernels' tests on the real device (no interpreter);
#   3. bench/kernels.py: its tables in bench.log, the same figures in kernels.json (decode attention
#      against copy bandwidth and SDPA, the quantizers).
set -u
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

step() {  # step NAME LIMIT_S CMD...: runs CMD with a limit, logs to $out/NAME.log, keeps the first failure
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 40 "$out/$name.log"
    echo "== $name: exit $rc in $(( $(date +%s) - t0 ))s"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

step env 60 bash -c "nvidia-smi; $py -c 'import torch, triton, sys; print(sys.version); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); \
print(\"triton\", triton.__version__)'"
# -p no:cacheprovider: the checkout may be read-only there. The gpu marker selects the large shapes;
# the triton test files also run their small shapes on the device instead of the interpreter.
step tests 240 "$py" -m pytest -q -p no:cacheprovider -o addopts= \
    tests/kernels/test_gpu_large.py tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_kv_write.py tests/kernels/test_quant.py tests/kernels/test_dispatch.py \
    tests/transfer/test_codec.py
step bench 240 "$py" bench/kernels.py --json-out "$out/kernels.json"
echo "gpu_check: exit $status; logs in $out"
exit "$status"
