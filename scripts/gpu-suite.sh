#!/usr/bin/env bash
# Everything that needs a GPU, in sections of under nine minutes each on one H100 or
# H200, writing a log and JSON per section under OUT (default ./out):
#   OUT=/tmp/results bash scripts/gpu-suite.sh SECTION [SECTION ...]
#   bash scripts/gpu-suite.sh list          # the sections, one line each
# A section's pytest arguments come after `--`: gpu-suite.sh tests-ops -- -x
# Exit status: nonzero when any step of any section failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

# GPU test files by section; tests-rest runs every other test marked gpu (the ones in
# CPU test files included), so the sections together are the whole GPU suite.
OPS_TESTS="tests/ops/test_ops_gpu.py tests/ops/test_qk_norm_rope_gpu.py
 tests/ops/test_qk_norm_rope_fp8_gpu.py tests/ops/test_merge_split_kv_gpu.py
 tests/ops/test_adaln_gpu.py tests/ops/test_causal_layout_gpu.py
 tests/engine/test_fused_glue_gpu.py tests/ops/test_rms_silu_gpu.py
 tests/ops/test_copy_rows_gpu.py"
ENGINE_TESTS="tests/engine/attention/test_attention_gpu.py
 tests/engine/attention/test_attention_fp8_gpu.py tests/engine/attention/test_packing_gpu.py
 tests/engine/attention/test_split_kv_gpu.py tests/engine/cache/test_cache_gpu.py
 tests/engine/cache/test_kv_fp8_gpu.py tests/engine/cache/test_snapshot_gpu.py
 tests/engine/cache/test_sequences_gpu.py tests/engine/test_arena_gpu.py
 tests/graphs/test_graphs_gpu.py tests/engine/test_warmup_gpu.py tests/bench/test_clocks_gpu.py"
V2V_TESTS="tests/engine/wan/test_vae_encoder_gpu.py tests/engine/wan/test_tiny_encoder.py
 tests/engine/test_fused_conv.py"

sections() {
  cat <<'EOF'
tests-ops      GPU tests of the kernels (ops/)
tests-engine   GPU tests of attention, caches, graphs
tests-rest     every other GPU test (models, Wan, VAE, rollouts, serving)
bench-core     framekv bench (attention, chunk, e2e, streams, breakdown) and the micro benches
fp8            framekv bench --sections fp8: forward, reference DiT, WanRollout 1.3B
fp8-14b        WanRollout 14B, bf16 beside fp8 where it fits
snapshots      a stream's export and import, sessions swapped over fewer slots
vae            the Wan VAE's decode: the fused program against diffusers' modules
pixels         prompt to pixels: both decoders alone and end to end, in turn and overlapped
pixels-fp8     prompt to pixels with fp8 K/V and the tiny decoder
v2v            video in: the encoders' GPU tests (their convs' too), the encoders alone, video to video end to end
ulysses        sequence-parallel attention over 2 GPUs (skipped on fewer)
EOF
}

# run NAME CMD...: one step, its output in OUT/NAME.log; a failure marks the suite failed
run() {
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "== $name FAILED"; status=1; }
}

pytest_gpu() {
  local name=$1; shift
  run "$name" "$PY" -m pytest -m gpu -q -rfEs --durations=10 --junitxml "$OUT/$name.xml" "$@"
}

section() {
  case "$1" in
    tests-ops) pytest_gpu tests-ops $OPS_TESTS "${ARGS[@]}" ;;
    tests-engine) pytest_gpu tests-engine $ENGINE_TESTS "${ARGS[@]}" ;;
    tests-rest)
      local ignore=()
      for f in $OPS_TESTS $ENGINE_TESTS $V2V_TESTS; do ignore+=(--ignore "$f"); done
      pytest_gpu tests-rest tests "${ignore[@]}" "${ARGS[@]}" ;;
    bench-core)
      run bench-core "$PY" -m framekv.tools.cli bench --sections attention,chunk,e2e,streams,breakdown \
        --json "$OUT/bench-core.json"
      for name in commit graphs launch merge ops wait; do
        run "bench-$name" "$PY" -m "framekv.bench.$name" --json "$OUT/bench-$name.json"
      done ;;
    fp8) run fp8 "$PY" -m framekv.tools.cli bench --sections fp8 --json "$OUT/fp8.json" ;;
    fp8-14b) run fp8-14b "$PY" -m framekv.bench.fp8 --parts wan --wan-configs 14b \
               --wan-chunks 6 --rounds 3 --json "$OUT/fp8-14b.json" ;;
    snapshots) run snapshots "$PY" -m framekv.bench.snapshots --json "$OUT/snapshots.json" ;;
    vae) run vae "$PY" -m framekv.bench.vae_decode --json "$OUT/vae.json" ;;
    pixels) run pixels "$PY" -m framekv.bench.pixels --json "$OUT/pixels.json" ;;
    pixels-fp8) run pixels-fp8 "$PY" -m framekv.bench.pixels --decoders tiny --kv-dtype fp8 \
                  --json "$OUT/pixels-fp8.json" ;;
    v2v)
      pytest_gpu v2v-tests $V2V_TESTS "${ARGS[@]}"
      run v2v-encoders "$PY" -m framekv.bench.v2v --parts encoders --json "$OUT/v2v-encoders.json"
      run v2v-e2e "$PY" -m framekv.bench.v2v --parts e2e --json "$OUT/v2v-e2e.json" ;;
    ulysses)
      local gpus
      gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
      if [ "${gpus:-0}" -ge 2 ]; then
        run ulysses "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 \
          -m framekv.bench.ulysses --json "$OUT/ulysses.json"
      else
        echo "ulysses: skipped, it needs 2 GPUs and this machine has ${gpus:-0}"
      fi ;;
    *) echo "gpu-suite.sh: no section $1; the sections:"; sections; exit 2 ;;
  esac
}

if [ $# -eq 0 ] || [ "$1" = list ]; then
  sections
  exit 0
fi
names=(); ARGS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; ARGS=("$@"); break; fi
  names+=("$1"); shift
done
"$PY" -m framekv.tools.cli info > "$OUT/info.txt" 2>&1 || true
for name in "${names[@]}"; do section "$name"; done
exit $status
