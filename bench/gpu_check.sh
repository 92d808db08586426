#!/usr/bin/env bash
# The one prepared GPU acceptance run (issues 3 and 19), for a machine with CUDA and torch, triton,
# transformers, safetensors, cupy and pytest already installed, and nothing else of this project's
# pins: no Ray, no nixl, no gguf, no network. The engine runs on random weights of SmolLM2-135M's
# shapes written on the spot (the GGUF does not travel with the checkout).
#
#   bash bench/gpu_check.sh            # writes to $OUT if set, else ./gpu-check-out
#
# Steps, each with its own time limit (cut to what is left of a ${GPU_CHECK_BUDGET_S:-460} s budget,
# so the whole run stays under 8 minutes), all run even if one fails; the exit status is the first
# failure's. Each writes NAME.log; JSON-producing ones write their stdout to NAME.json:
#   env                nvidia-smi, versions, which of the project's modules import without Ray (env.json)
#   engine_tests       tests/gpu: the engine on CUDA against transformers (float32 tokens, bf16
#                      agreement, CUDA graphs vs eager, the planned KV pool)            engine_tests.xml
#   gpu_tests          every other `gpu`-marked test file under tests/ (-m gpu)           gpu_tests.xml
#   bench_engine       bench/engine.py --device cuda: decode tok/s at B=1/32/256 vs transformers
#                      generate, B=1 against the HBM weight-streaming bound, eager B=1  bench_engine.json
#   bench              bench/kernels.py: decode attention and quantizers vs copy bandwidth  kernels.json
#   transfer_cuda_ipc  bench/transfer.py --transport cuda_ipc: KV between two processes  transfer_cuda_ipc.json
#   tests              the triton kernels' tests on the device and their large `gpu` shapes   tests.xml
# Then gpu_check.json: every step's exit status and time, test counts and failures, the figures,
# and the issue's targets with pass/fail (a target not met does not change the exit status).
set -u
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
budget_s="${GPU_CHECK_BUDGET_S:-460}"
t_start=$(date +%s)
status=0
# a step that does not run must not leave an earlier run's figures behind for the summary
rm -f "$out"/{env,bench_engine,kernels,transfer_cuda_ipc,gpu_check}.json "$out"/{engine_tests,tests,gpu_tests}.xml
printf 'name\trc\tseconds\tlimit_s\tnote\n' > "$out/steps.tsv"

run_step() {  # run_step NAME LIMIT_S STDOUT CMD...: STDOUT "-" keeps stdout in NAME.log
    local name=$1 limit=$2 stdout=$3 t0 rc left note=""
    shift 3
    left=$(( budget_s - ($(date +%s) - t_start) ))
    if [ "$left" -lt "$limit" ]; then limit=$left; note="limit cut to the budget left"; fi
    if [ "$limit" -lt 5 ]; then
        echo "== $name: exit 125 in 0s (not run: the ${budget_s}s budget is spent)"
        printf '%s\t125\t0\t0\tnot run: budget spent\n' "$name" >> "$out/steps.tsv"
        if [ "$status" -eq 0 ]; then status=125; fi
        return
    fi
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    if [ "$stdout" = - ]; then
        timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    else
        timeout -k 10 "$limit" "$@" > "$stdout" 2> "$out/$name.log"
    fi
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note="timed out after ${limit}s"; fi
    tail -n 30 "$out/$name.log"
    echo "== $name: exit $rc in $(( $(date +%s) - t0 ))s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$note" >> "$out/steps.tsv"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
step() { local name=$1 limit=$2; shift 2; run_step "$name" "$limit" - "$@"; }
step_json() { local name=$1 limit=$2; shift 2; run_step "$name" "$limit" "$out/$name.json" "$@"; }
# -p no:cacheprovider: the checkout may be read-only there; faulthandler dumps a hung test's stack
pytest_args=(-m pytest -q -rfEs -p no:cacheprovider -o addopts= -o faulthandler_timeout=60)

read -r -d '' env_py <<'EOF'
import importlib, json, shutil, subprocess, sys
info = {"python": sys.version.split()[0], "nvidia_smi": shutil.which("nvidia-smi") is not None}
if info["nvidia_smi"]:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "cupy", "pytest", "numpy",
             "ray", "nixl", "gguf"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "present")
    except Exception as e:  # absent here, and the project must cope
        info[name] = None
import torch
info["cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
if info["cuda_available"]:
    info["device"] = torch.cuda.get_device_name()
    info["device_free_bytes"], info["device_total_bytes"] = torch.cuda.mem_get_info()
info["imports"], info["imports_ray"] = {}, []  # modules the device needs without Ray (and which pull it in)
for mod in ("actors.engine.engine", "bench.engine", "bench.kernels", "transfer.cuda_ipc"):
    had_ray = "ray" in sys.modules
    try:
        importlib.import_module(mod)
        info["imports"][mod] = "ok"
    except Exception as e:
        info["imports"][mod] = f"{type(e).__name__}: {e}"
    if not had_ray and "ray" in sys.modules:
        info["imports_ray"].append(mod)
info["engine_imports_ray"] = "actors.engine.engine" in info["imports_ray"]
print(json.dumps(info, indent=2))
json.dump(info, open(sys.argv[1], "w"), indent=2)
sys.exit(0 if info["nvidia_smi"] and info["cuda_available"] and info["imports"]["actors.engine.engine"] == "ok"
         and not info["engine_imports_ray"] else 1)
EOF
step env 30 "$py" -c "$env_py" "$out/env.json"

# Order: what issue 19 accepts first (the engine, graphs, the plan, cuda_ipc), the kernels' own
# device tests last, on what is left of the budget.
step engine_tests 110 "$py" "${pytest_args[@]}" --junitxml="$out/engine_tests.xml" tests/gpu
# Every other file with a `gpu` mark (other folders add theirs), its gpu tests only.
mapfile -t gpu_files < <(grep -rlE --include='*.py' 'mark\.gpu' tests | sort | grep -v -x -e 'tests/gpu/.*' \
    -e tests/kernels/test_gpu_large.py -e tests/transfer/test_codec.py)
if [ "${#gpu_files[@]}" -gt 0 ]; then
    step gpu_tests 70 "$py" "${pytest_args[@]}" -m gpu --junitxml="$out/gpu_tests.xml" "${gpu_files[@]}"
fi
step_json bench_engine 90 "$py" bench/engine.py --device cuda --model random-smollm2 --json
step bench 50 "$py" bench/kernels.py --json-out "$out/kernels.json"

# cuda_ipc between two processes on one GPU vs a device-to-device copy of the same bytes in one
# process (both as bytes moved per second). Its figure is the smallest `cuda_ipc_vs_d2d` ratio over
# sizes >= 16 MiB. Never fatal to the other steps.
step_json transfer_cuda_ipc 45 "$py" bench/transfer.py --transport cuda_ipc --device cuda:0 --sizes-mib 1,16,256 --json

# The triton kernels' own test files on the device instead of the interpreter, with their gpu shapes.
step tests 65 "$py" "${pytest_args[@]}" --junitxml="$out/tests.xml" \
    tests/kernels/test_gpu_large.py tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_kv_write.py tests/kernels/test_quant.py tests/kernels/test_dispatch.py \
    tests/transfer/test_codec.py

read -r -d '' summary_py <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

steps = {}
for line in (out / "steps.tsv").read_text().splitlines()[1:]:
    name, rc, seconds, limit, note = (line.split("\t") + [""])[:5]
    steps[name] = {"rc": int(rc), "seconds": int(seconds), "limit_s": int(limit), "note": note or None}
for name, step in steps.items():  # pytest steps: counts and what failed
    try:
        root = ET.parse(out / f"{name}.xml").getroot()
    except (OSError, ET.ParseError):
        continue
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    step["pytest"] = counts

def target(value, minimum, source, **extra):
    return {"min": minimum, "value": value, "met": value is not None and value >= minimum, "source": source,
            **extra}

targets, figures = {}, {}
b32 = b1 = None
eng = load("bench_engine.json")
d = (eng or {}).get("dtypes", {}).get("bfloat16") or next(iter((eng or {}).get("dtypes", {}).values()), None)
if d:
    t = d["targets"]
    figures["engine"] = {
        "device": eng.get("device"), "device_copy_bytes_per_s": eng.get("device_copy_bytes_per_s"),
        "weight_bytes_per_decode_step": d["weight_bytes_per_decode_step"],
        "decode_bound_tok_s": d["decode_bound_tok_s"],
        "ferry_decode_tok_s": {b: v["tok_s"] for b, v in d["ferry"]["decode"].items()},
        "transformers_decode_tok_s": {b: v["tok_s"] for b, v in ((d["transformers"] or {}).get("decode") or {}).items()},
        "ratio_decode": (d["ratio"] or {}).get("decode"),
        "ferry_prefill_tok_s": d["ferry"]["prefill_tok_s"],
        "eager_b1_tok_s": (d["ferry"].get("decode_eager_b1") or {}).get("tok_s"),
        "cuda_graph_speedup_b1": d["ferry"].get("cuda_graph_speedup_b1"),
        "kv_plan": d["ferry"].get("kv_plan"),
    }
    b32, b1 = t.get("b32_vs_transformers"), t.get("b1_fraction_of_bound")
targets["engine_decode_b32_vs_transformers"] = target(
    (b32 or {}).get("value"), 2.0, "bench_engine.json", unit="x transformers generate, bf16")
targets["engine_decode_b1_of_hbm_weight_bound"] = target(
    (b1 or {}).get("value"), 0.6, "bench_engine.json",
    unit="fraction of weight bytes per step / device copy bandwidth, CUDA graphs, bf16")

kern = load("kernels.json")
kt = ((kern or {}).get("targets") or {}).get("decode_attention_of_copy_bw") or {}
if kern:
    figures["kernels"] = {"copy_GB_per_s": kern.get("copy_GB_per_s"), "decode_summary": kern.get("decode_summary"),
                          "target_shape": kt.get("shape")}
targets["paged_decode_attention_of_copy_bw"] = target(kt.get("value"), 0.7, "kernels.json",
                                                      unit="fraction of device copy bandwidth")

def ipc_value(doc):  # the cuda_ipc figure, whatever the layout settles on (to confirm)
    if not isinstance(doc, dict):
        return None
    for name, t in (doc.get("targets") or {}).items():
        if "cuda_ipc" in name and isinstance(t, dict) and "value" in t:
            return t["value"]
    by_mib = doc.get("cuda_ipc_vs_d2d")  # {size in MiB: cuda_ipc GB/s / d2d copy GB/s}
    if isinstance(by_mib, dict):
        big = [v for k, v in by_mib.items() if float(k) >= 16]
        return min(big) if big else None
    found = []
    def walk(x):
        if isinstance(x, dict):
            if "cuda_ipc" in json.dumps(x) and not any(isinstance(v, (dict, list)) for v in x.values()):
                size = x.get("size_bytes") or (x.get("size_mib") or x.get("MiB") or 0) * (1 << 20)
                frac = next((x[k] for k in ("of_device_copy_bw", "of_copy_bw", "fraction_of_device_copy",
                                            "of_device_copy") if k in x), None)
                if frac is not None and size >= 16 << 20:
                    found.append(frac)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return min(found) if found else None

ipc = load("transfer_cuda_ipc.json")
if ipc is not None:
    figures["transfer_cuda_ipc"] = ipc
targets["cuda_ipc_of_device_copy_bw_at_16mib"] = target(
    ipc_value(ipc) if ipc is not None else None, 0.5, "transfer_cuda_ipc.json",
    unit="fraction of device copy bandwidth, smallest over sizes >= 16 MiB")

summary = {
    "ok": all(s["rc"] == 0 for s in steps.values()),
    "all_targets_met": all(t["met"] for t in targets.values()),
    "targets": targets, "steps": steps, "env": load("env.json"), "figures": figures,
}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print("step               exit  seconds  tests")
for name, s in steps.items():
    p = s.get("pytest")
    tests = f"{p['passed']} passed, {p['failures'] + p['errors']} failed, {p['skipped']} skipped" if p else ""
    print(f"{name:18} {s['rc']:>4}  {s['seconds']:>7}  {tests}")
print("\ntarget                                   value     min  met")
for name, t in targets.items():
    value = "-" if t["value"] is None else f"{t['value']:.3f}"
    print(f"{name:40} {value:>6}  {t['min']:>6}  {'yes' if t['met'] else 'NO'}")
EOF
echo "== summary"
"$py" -c "$summary_py" "$out" || echo "summary: could not be written (see above)"
echo "gpu_check: exit $status in $(( $(date +%s) - t_start ))s; summary in $out/gpu_check.json, logs in $out"
exit "$status"
