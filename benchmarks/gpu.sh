#!/usr/bin/env bash
# The GPU checks in one prepared run (about 10 minutes on one CUDA GPU, SGLang's step aside): the
# gpu-marked tests, then those that start real SGLang servers (DFLASH for DFlash and Domino, DSPARK for
# DSpark; skipped without DFLASH_OPS_SGLANG_PYTHON, the python of an SGLang environment), then the
# online and offline benchmarks on CUDA in bfloat16 (the drafter's batched path uses flex_attention
# there), then the DDTree sweep on the hybrid demo pair in bfloat16 (the target's forward with the
# tree mask, the Gated DeltaNet tree recurrence through fla where installed) with its
# speedup-vs-budget table, then one table. Without a CUDA GPU it says so and exits 0. The embedded
# demo pair is built once, in DFLASH_OPS_TEST_EMBEDDED (default: under LOG_DIR), for the tests and
# the sweep.
#
#   benchmarks/gpu.sh            (PYTHON=... to pick the interpreter; LOG_DIR=... to keep the logs;
#                                 DFLASH_OPS_SGLANG_PYTHON=... for the SGLang step)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
mkdir -p "$LOG_DIR"
export DFLASH_OPS_TEST_EMBEDDED=${DFLASH_OPS_TEST_EMBEDDED:-$LOG_DIR/embedded}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "benchmarks/gpu.sh: no CUDA GPU here (torch.cuda.is_available() is false); nothing run."
    exit 0
fi

gpu=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
fla=$("$PY" -c 'import importlib.util as u; print("installed" if u.find_spec("fla") else "not installed")')
flex=$("$PY" -c 'import torch.nn.attention.flex_attention; print("available")' 2>/dev/null || echo "unavailable")
echo "GPU: $gpu   date: $(date -u +%Y-%m-%dT%H:%MZ)   torch $("$PY" -c 'import torch; print(torch.__version__)')"
echo "flash-linear-attention: $fla   flex_attention: $flex   logs: $LOG_DIR"

rows=()
step() {                      # step NAME TIMEOUT_S GREP_PATTERN COMMAND...
    local name=$1 limit=$2 pattern=$3; shift 3
    local log="$LOG_DIR/$name.log" t0=$SECONDS rc
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 8 "$log"
    local line
    line=$(grep -E "$pattern" "$log" | tail -n 1 | tr -s ' ')
    case $rc in
        0) status=ok ;;
        124) status="timed out" ;;
        *) status="failed (rc $rc)" ;;
    esac
    rows+=("$(printf '%-16s %-14s %5ss  %s' "$name" "$status" "$((SECONDS - t0))" "${line:-"-"}")")
}

step gpu-tests 300 "passed|failed|skipped" "$PY" -m pytest -q -m gpu tests/test_gpu.py -k "not sglang"
step sglang 900 "passed|failed|skipped" "$PY" -m pytest -q -s -m gpu tests/test_gpu.py -k sglang
step online 120 "ratio ours" "$PY" benchmarks/bench_online.py --device cuda --dtype bfloat16 \
    --hidden 1024 --layers 16 --new-tokens 128 --prompts 4 --repeats 2
step offline 150 "ratio ours" "$PY" benchmarks/bench_offline.py --device cuda --dtype bfloat16 \
    --hidden 1024 --completion 2048 --full
step ddtree 300 "^fastest" "$PY" benchmarks/bench_ddtree.py --device cuda --dtype bfloat16 \
    --budgets 1,2,4,8,16,32,64 --prompts 4 --new-tokens 128 --pair "$DFLASH_OPS_TEST_EMBEDDED"
echo
echo "== DDTree: speedup vs budget"
sed -n '/^DDTree sweep/,$p' "$LOG_DIR/ddtree.log"

echo
echo "== summary ($gpu)"
printf '%-16s %-14s %6s  %s\n' step status time "result"
for r in "${rows[@]}"; do echo "$r"; done
exit 0
