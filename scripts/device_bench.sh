#!/usr/bin/env bash
# On a GPU machine: the named parts in order, the long ones each under its own time limit, each leaving its
# log (and the JSON its script writes) under $OUT, so a part that runs long still leaves the others' results.
# Models and the compile cache are built under $WORK. A part that trains copies the checkpoint it wrote to
# $OUT/tiny-code; the tokenizer stays out of that copy: it is jdspark/assets/tiny-code/tokenizer.json, which
# no part changes.
# Environment: CORPUS (build/corpus), TARGET_MINUTES (3.2), DRAFTER_MINUTES (1.8 in `train`, 4.5 in
# `drafter`), TARGET_ARGS / DRAFTER_ARGS / EVAL_ARGS (more arguments for those scripts), STEP_VARIANTS
# (auto kernel), WHEELS (.whl), MODEL (the model `eval` measures; default: the embedded one or, after a part
# that trains, the model it wrote).
#   bash scripts/device_bench.sh train            (target + drafter from scratch)
#   bash scripts/device_bench.sh corpus-large target   (the shipped target trained further on the larger
#       corpus, build/corpus_large from build_corpus.py --extra-root; TARGET_ARGS="--init jdspark/assets/tiny-code")
#   bash scripts/device_bench.sh drafter eval     (train the embedded drafter further, then measure it)
#   bash scripts/device_bench.sh sampler adaptive serve
#   bash scripts/device_bench.sh step             (D, V(k), step wall vs device busy time, kernel counts)
#   bash scripts/device_bench.sh startup serve-engine   (issue 26: start-up cold / warm, then the
#       speculation modes under load; SERVE_ARGS, CONCURRENCY, REQUESTS, ROUNDS, STARTUP_SECONDS,
#       SERVE_SECONDS, MODES; the 2026-12-02 runs: SERVE_ARGS="--max-running 16 --buckets 1 16"
#       CONCURRENCY="1 16" MODES="none fixed5 per_request" ROUNDS=2)
#   bash scripts/device_bench.sh serve-ab         (issue 26: the newest unmeasured change, A/B)
#   bash scripts/device_bench.sh serve-env        (issue 26: one serve-engine level under each of SERVE_ENVS)
#   bash scripts/device_bench.sh cmdbuf-serve     (issue 26: which allocation makes XLA update a serving step's graph)
#   bash scripts/device_bench.sh segments         (issue 26: a prompt chunk inside the verify call, Flash dims)
#   bash scripts/device_bench.sh segment-serve    (issue 26: the engine serving with prompt segments, Flash dims c = 16)
#   bash scripts/device_bench.sh prefill-ab       (issue 26: Flash dims at c = 16, prefill buckets 16 64 against
#       1 4 16 64, one process each on one compile cache)
#   bash scripts/device_bench.sh sweep            (issue 23: routed-expert kernel tilings, then the model)
#   bash scripts/device_bench.sh serve-engine keep-cache   (then XLA's compile cache comes back, its newest KEEP_MIB
#       (44) MiB: copy its parts into build/device-cache and carry that folder; the next machine's serve parts find
#       the programs they compile there)
#   bash scripts/device_bench.sh dispatch        (a call's host cost by leaves and launches; the GIL)
#   bash scripts/device_bench.sh kernel-tests many-rows   (the kernel's grouped form and missing slots compiled,
#       then timed against the slot form and the former padding)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jdspark-out}; WORK=${WORK:-/tmp/jdspark-work}; mkdir -p "$OUT" "$WORK"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JDSPARK_CACHE=$WORK/cache
CORPUS=${CORPUS:-build/corpus}; MODEL=${MODEL:-}
ASSETS=jdspark/assets/tiny-code
CARRIED=build/device-cache  # the serving benches' compile cache a `keep-cache` part brought back, carried in
if ls "$CARRIED"/serve-xla.tar.gz.part* >/dev/null 2>&1 && [ ! -d "$WORK/serve-cache/xla" ]; then
  mkdir -p "$WORK/serve-cache" && cat "$CARRIED"/serve-xla.tar.gz.part* | tar -xzf - -C "$WORK/serve-cache" \
    && echo "compile cache from $CARRIED: $(du -sh "$WORK/serve-cache/xla" | cut -f1)"
fi

xla_libraries() {  # the jax plugin's and jaxlib's large shared objects (XLA is in them): the flags they know
  python3 -c "import importlib.util as u, pathlib as p; [print(f) for n in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jaxlib') if u.find_spec(n) for f in p.Path(u.find_spec(n).origin).parent.rglob('*.so') if f.stat().st_size > 5e7]"
}

keep_model() {  # the checkpoint just trained in $WORK/tiny-code -> $OUT/tiny-code, and `eval` measures it
  [ -f "$WORK/tiny-code/config.json" ] || return 1
  MODEL=$WORK/tiny-code
  [ -f "$MODEL/tokenizer.json" ] || cp "$ASSETS/tokenizer.json" "$MODEL/"
  rm -rf "$OUT/tiny-code"; mkdir -p "$OUT/tiny-code"
  for f in "$MODEL"/*; do [ "$(basename "$f")" = tokenizer.json ] || cp -r "$f" "$OUT/tiny-code/"; done
}

python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case $part in
    train)
      rm -rf "$WORK/target" "$WORK/tiny-code"
      python3 scripts/train_target.py --corpus "$CORPUS" --minutes "${TARGET_MINUTES:-3.2}" --out "$WORK/target" 2>&1 \
        | grep -v Warning | tee "$OUT/train.log"
      python3 scripts/train_drafter.py --target "$WORK/target" --corpus "$CORPUS" --minutes "${DRAFTER_MINUTES:-1.8}" \
        --out "$WORK/tiny-code" 2>&1 | grep -v Warning | tee -a "$OUT/train.log"
      cp "$WORK/target/train_target.json" "$WORK/tiny-code/" && keep_model ;;
    corpus-large)  # the stdlib plus site-packages text (scripts/build_corpus.py --extra-root), tokenized here
      LARGE=build/corpus_large  # train.jsonl, or train.jsonl.xz; its held-out split is the default corpus's
      { [ -f "$LARGE/train.jsonl" ] || xz -dk "$LARGE/train.jsonl.xz"; } \
        && { [ -f "$LARGE/heldout.jsonl" ] || cp "$CORPUS/heldout.jsonl" "$LARGE/"; } \
        && python3 scripts/train_tokenizer.py --corpus "$LARGE" --existing "$ASSETS/tokenizer.json" \
        && CORPUS=$LARGE ;;
    target)
      rm -rf "$WORK/tiny-code"
      python3 scripts/train_target.py --corpus "$CORPUS" --minutes "${TARGET_MINUTES:-3.2}" ${TARGET_ARGS:-} \
        --out "$WORK/tiny-code" 2>&1 | grep -v Warning | tee "$OUT/target.log"
      keep_model ;;
    drafter)
      rm -rf "$WORK/tiny-code"
      python3 scripts/train_drafter.py --target "$ASSETS" --corpus "$CORPUS" --minutes "${DRAFTER_MINUTES:-4.5}" \
        ${DRAFTER_ARGS:-} --out "$WORK/tiny-code" 2>&1 | grep -v Warning | tee "$OUT/drafter.log"
      keep_model ;;
    eval)
      timeout 330 python3 scripts/eval_acceptance.py ${MODEL:+--model "$MODEL"} --corpus "$CORPUS" ${EVAL_ARGS:-} \
        --json "$OUT/eval_acceptance.json" 2>&1 | grep -v Warning | tee "$OUT/eval.log" ;;
    sampler-tests)
      timeout 170 python3 -m pytest -q -W ignore -p no:cacheprovider tests/pallas_kernels 2>&1 | tail -5 | tee "$OUT/sampler_gpu_tests.log" ;;
    sampler)
      timeout 280 python3 scripts/bench_rejection_sampler.py --profile 2>&1 | grep -v Warning | tee "$OUT/bench_sampler.log" ;;
    load)
      timeout 150 python3 scripts/bench_load.py --preset flash --layers 2 --experts 32 --json "$OUT/bench_load.json" 2>&1 \
        | grep -v -E "Warning|it/s|B/s" | tee "$OUT/bench_load.log" ;;
    load-placement)  # issue 24: a Flash checkpoint written to disk, loaded into a GPU / host placement
      # (PLACEMENT_ARGS, default 2 layers x 256 experts with one layer's experts on the host)
      timeout ${PLACEMENT_SECONDS:-240} python3 scripts/bench_load.py ${PLACEMENT_ARGS:---preset flash --layers 2 --gpu-memory 9.4} \
        --workdir "$WORK/load" --json "$OUT/bench_load_placement.json" 2>&1 | grep -v -E "Warning|it/s|B/s" \
        | tee "$OUT/bench_load_placement.log" ;;
    adaptive)
      timeout 400 python3 scripts/bench_adaptive.py --tokens 128 --repeats 7 2>&1 | grep -v Warning | tee "$OUT/bench_adaptive.log" ;;
    serve)  # jdspark's FastAPI / uvicorn dependencies, installed from the wheels in $WHEELS where they are missing
      SITE=$PWD
      if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
          "${WHEELS:-.whl}"/*.whl && SITE=$PWD:$WORK/site
      fi
      PYTHONPATH=$SITE timeout 170 python3 scripts/bench_serve.py --requests 16 --max-tokens 64 --max-seconds 25 \
        --out "$OUT/bench_serve.json" 2>&1 | grep -v Warning | tee "$OUT/bench_serve.log" ;;
    step)
      timeout 300 python3 scripts/bench_step.py --variants ${STEP_VARIANTS:-auto kernel} 2>&1 \
        | grep -v Warning | tee "$OUT/bench_step.log" ;;
    engine)
      timeout 420 python3 -m pytest -q -W ignore -p no:cacheprovider tests/engine/test_engine.py tests/engine/test_lossless.py \
        -k "greedy or lossless" 2>&1 | tail -5 | tee "$OUT/engine_gpu_tests.log" ;;
    gpu-tests)  # every gpu-marked test (the kernels compiled, the engine's precision) and greedy equality on the
      # shipped model; tests/server is left out: the GPU machine has no FastAPI
      timeout 360 python3 -m pytest -q -W ignore -p no:cacheprovider -m gpu tests/pallas_kernels tests/engine \
        tests/test_profile.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
      timeout 120 python3 -m pytest -q -W ignore -p no:cacheprovider tests/engine/test_exe_cache.py 2>&1 | tail -5 \
        | tee -a "$OUT/gpu_tests.log"
      timeout 120 python3 -m pytest -q -W ignore -p no:cacheprovider tests/test_assets.py -k greedy 2>&1 | tail -5 \
        | tee -a "$OUT/gpu_tests.log" ;;
    decode)  # issue 23: decode at Flash dimensions (8 layers, 256 experts, FP8 + ds_fp4), the variants in one run,
      # the per-sublayer split of the first; FP8_ROWS: first Flash's FP8 linears alone at these row counts;
      # DECODE_ARGS: more arguments (e.g. --params packed scales-apart)
      timeout ${DECODE_SECONDS:-420} python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 \
        --storage fp8+fp4 --rows ${DECODE_ROWS:-1 6} --context ${DECODE_CONTEXT:-4096} --runs 10 \
        $([ "${DECODE_PROFILE:-1}" = 1 ] && echo --profile) \
        --variants ${DECODE_VARIANTS:-current fp8_xla} ${FP8_ROWS:+--fp8-linears $FP8_ROWS} ${DECODE_ARGS:-} \
        --json "$OUT/bench_decode_${DECODE_CONTEXT:-4096}.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_decode_${DECODE_CONTEXT:-4096}.log" ;;
    versus-hf)  # issue 23: bf16, 8 layers, 64 experts: huggingface transformers, then jdspark (one process each)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${HF_SECONDS:-240} python3 scripts/bench_hf.py --preset flash \
        --layers 8 --experts 64 --storage bf16 --context 4096 --json "$OUT/bench_hf.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_hf.log"
      timeout ${BF16_SECONDS:-240} python3 scripts/bench_decode.py --preset flash --layers 8 --experts 64 \
        --storage bf16 --rows 1 6 --context 4096 --runs 10 --json "$OUT/bench_decode_bf16.json" 2>&1 \
        | grep -v Warning | tee "$OUT/bench_decode_bf16.log" ;;
    kernel-tests)  # the FP8 linear and routed-expert kernels compiled against their references, batch invariance
      # (65 of its ~90 tests took 170 s on the H100)
      # (KERNEL_TEST_K: a pytest -k expression)
      timeout ${KERNEL_TEST_SECONDS:-330} python3 -m pytest -q -W ignore -p no:cacheprovider -m gpu \
        tests/pallas_kernels/test_fp8_linear.py tests/pallas_kernels/test_moe.py ${KERNEL_TEST_K:+-k "$KERNEL_TEST_K"} 2>&1 | tail -12 \
        | tee "$OUT/kernel_gpu_tests.log" ;;
    many-rows)  # issues 23 / 26: one routed-expert layer per row count (xla, the model's kernel form, the grouped
      # form below GROUPED_MIN_ROWS, every expert), then the 8-layer model at batch 1 / 4 / 16 with unused expert slots
      # missing (current) and re-read (padding_read), S = 6 also keeping 1 and 3 rows (a narrower verify)
      timeout ${MANY_ROWS_SECONDS:-420} python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 \
        --storage fp8+fp4 --moe-layer 6 16 32 64 96 384 --rows 1 6 --kept 1 3 --batch 1 4 16 --runs 10 \
        --variants current padding_read --json "$OUT/bench_decode_many_rows.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_decode_many_rows.log" ;;
    sweep)  # issue 23: the routed-expert kernel's tilings alone (R = 1, 2, 6), then the 8-layer model with the
      # default tiling at S = 1, 2, 6 with the per-sublayer split
      timeout ${SWEEP_SECONDS:-330} python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 \
        --storage fp8+fp4 --moe-layer 1 2 6 --sweep --rows ${SWEEP_ROWS:-1 2 6} --runs 10 --profile \
        --params ${SWEEP_PARAMS:-packed} --json "$OUT/bench_decode_sweep.json" 2>&1 \
        | grep -v Warning | tee "$OUT/bench_decode_sweep.log" ;;
    hlo)  # issue 23: the optimized HLO of the Flash-dims extend at S = 1 (each fusion's op_name names its source)
      XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_module_re=jit_extend" timeout ${HLO_SECONDS:-150} \
        python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 --storage fp8+fp4 --rows 1 \
        --context 4096 --runs 3 --variants current 2>&1 | grep -v Warning | tail -5
      find "$OUT/hlo" -type f ! -name '*jit_extend*after_optimizations.txt' -delete; gzip -r "$OUT/hlo" ;;
    cmdbuf)  # issue 23: which buffers make XLA update the step's command buffer (CUDA graph) on every call:
      # the XLA build's command-buffer flags, then the S = 1 extend with the update log and the buffer assignment,
      # then S = 1 under each of CMDBUF_ENVS ('|'-separated environment settings) with the host/GPU split;
      # e.g. CMDBUF_ENVS="XLA_FLAGS=--xla_gpu_enable_command_buffer=-DYNAMIC_SLICE_FUSION|XLA_PYTHON_CLIENT_ALLOCATOR=bfc"
      for so in $(xla_libraries); do
        echo "$so"; grep -aoE "xla_gpu_(command_buffer|graph)[a-z_]*|(SKIP_TEMP|VMM_PERSISTENT_TEMP|DYNAMIC_ALLOCATE|ALWAYS_UPDATE|NEVER_UPDATE)" "$so" | sort -u
      done 2>&1 | tee "$OUT/cmdbuf_flags.log"
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=3,command_buffer_cmd=3,gpu_executable_buffer_allocator=3,gpu_executable=3 \
        XLA_FLAGS="--xla_dump_to=$WORK/cmdbuf-dump --xla_dump_hlo_module_re=jit_extend" timeout 150 \
        python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 --storage fp8+fp4 --rows 1 \
        --context 4096 --runs 6 --variants current > "$WORK/cmdbuf_vlog.txt" 2>&1
      grep -iE "updated_allocs|needs_update|Updated [0-9]+ command|copy.protect|command buffer" "$WORK/cmdbuf_vlog.txt" \
        | cut -d']' -f2- | sed -E 's/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -25 | cut -c1-250 \
        | tee "$OUT/cmdbuf_updates.log"
      grep -iE "updated_allocs|needs_update" "$WORK/cmdbuf_vlog.txt" | tail -4 | cut -c1-400 | tee -a "$OUT/cmdbuf_updates.log"
      python3 scripts/cmdbuf_updates.py "$WORK/cmdbuf_vlog.txt" 2>&1 | tee -a "$OUT/cmdbuf_updates.log"
      for f in "$WORK"/cmdbuf-dump/*jit_extend*buffer-assignment.txt; do  # allocation indices -> buffers
        [ -f "$f" ] && gzip -c "$f" > "$OUT/cmdbuf_buffer_assignment.txt.gz" && break
      done
      IFS='|' read -ra SETTINGS <<< "${CMDBUF_ENVS:-}"
      for setting in "" "${SETTINGS[@]}"; do  # each: environment assignments, e.g. XLA_FLAGS=--xla_gpu_graph_level=0
        echo "--- $setting"
        env $setting timeout 150 python3 scripts/bench_decode.py --preset flash --layers 8 --experts 256 \
          --storage fp8+fp4 --rows ${CMDBUF_ROWS:-1} --context 4096 --runs 10 --profile --variants current 2>&1 \
          | grep -E "^ +current|wall |state buffers|command_buffer::|cuGraph|kernels, busy|Error|error" | cut -c1-250
      done 2>&1 | tee "$OUT/cmdbuf_flags_timing.log" ;;
    moe-probe)  # issue 23: the routed-expert kernel alone, per kernel (scripts/probe_moe_kernel.py): the default
      # tiling and those of PROBE_TILES at R = 1 and 6 (PROBE_ROWS). `ncu` under JAX ended in a segmentation fault
      # on the H100 (2026-12-06) and XLA's dump held no PTX of the kernels, so this part times only.
      timeout ${PROBE_SECONDS:-240} python3 scripts/probe_moe_kernel.py --rows ${PROBE_ROWS:-1 6} \
        --tiles "" ${PROBE_TILES:-} --json "$OUT/probe_moe.json" 2>&1 | grep -v Warning | tee "$OUT/probe_moe.log" ;;
    moe-tests)  # the routed-expert kernel compiled against its reference (every form, format and decoder)
      timeout ${MOE_TEST_SECONDS:-200} python3 -m pytest -q -W ignore -p no:cacheprovider -m gpu \
        tests/pallas_kernels/test_moe.py 2>&1 | tail -8 | tee "$OUT/moe_gpu_tests.log" ;;
    dispatch)  # issue 26: the host time one call costs its thread, by leaves and launches, and the GIL held or not
      timeout 240 python3 scripts/bench_dispatch.py ${DISPATCH_ARGS:-} --json "$OUT/dispatch.json" 2>&1 \
        | grep -v Warning | tee "$OUT/dispatch.log" ;;
    bw)  # the host expert pool's bandwidths on this host (16 cores): host read, PCIe, CPU and GPU expert GEMV;
      # BW_PREFETCH="1 0 1 0" alternates the CPU GEMV's prefetch (groups of rows ahead; 0: none), BW_DTYPES the
      # model dtype (bfloat16: ds_fp4 by vdpbf16ps where the CPU has it; float32: the fp32 decoders), BW_HINTS="t1 t0"
      # the cache level ds_fp4 rows are prefetched into (JDSPARK_CPU_FP4_PREFETCH_HINT), BW_ARGS adds flags
      for h in ${BW_HINTS:-t1}; do
        for p in ${BW_PREFETCH:-1}; do
          for dt in ${BW_DTYPES:-bfloat16 float32}; do
            JDSPARK_CPU_FP4_PREFETCH_HINT=$h JDSPARK_CPU_PREFETCH=$p timeout ${BW_SECONDS:-150} python3 -m jdspark.cli bench bw \
              --dtype $dt ${BW_ARGS:-} --json "$OUT/bench_bw_${h}_prefetch${p}_$dt.json" 2>&1 | grep -v Warning \
              | tee -a "$OUT/bench_bw.log"
          done
        done
      done ;;
    host-tests)  # the host experts' FFI custom call (its CUDA handler) and the hybrid layers, on this GPU
      timeout ${HOST_TEST_SECONDS:-240} python3 -m pytest -q -W ignore -p no:cacheprovider tests/experts/test_host_ffi.py \
        tests/experts/test_hybrid.py 2>&1 | tail -12 | tee "$OUT/host_gpu_tests.log" ;;
    hybrid)  # issue 24: a Flash-dims step with host experts, the FFI custom call against the pure_callback
      # (HYBRID_ARGS: e.g. --layers 8 --host-layers 4 --host-experts 1.0)
      timeout ${HYBRID_SECONDS:-300} python3 scripts/bench_hybrid.py ${HYBRID_ARGS:---layers 8 --host-layers 4 --host-experts 1.0} \
        --rows 1 6 --json "$OUT/bench_hybrid.json" 2>&1 | grep -v Warning | tee "$OUT/bench_hybrid.log" ;;
    flash)  # issue 24: the full-size synthetic DeepSeek-V4-Flash-0731 on this GPU and its host, served by the engine
      # (FLASH_ARGS: more arguments, e.g. --widths 0 5 --gpu-memory 136)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${FLASH_MEM_FRACTION:-0.95} timeout ${FLASH_SECONDS:-560} python3 \
        scripts/bench_flash.py ${FLASH_ARGS:-} --json "$OUT/bench_flash.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_flash.log" ;;
    overlap-tests)  # overlapped engine steps and the shipped model's greedy equality, on this GPU
      timeout ${OVERLAP_TEST_SECONDS:-200} python3 -m pytest -q -W ignore -p no:cacheprovider tests/engine/test_overlap.py \
        2>&1 | tail -8 | tee "$OUT/overlap_gpu_tests.log"
      timeout 120 python3 -m pytest -q -W ignore -p no:cacheprovider tests/test_assets.py -k greedy 2>&1 | tail -5 \
        | tee -a "$OUT/overlap_gpu_tests.log" ;;
    startup)  # issue 26: the embedded engine's start-up on a fresh cache (cold), then in a second process (warm)
      rm -rf "$WORK/serve-cache"
      for run in cold warm; do
        JDSPARK_CACHE=$WORK/serve-cache timeout ${STARTUP_SECONDS:-330} python3 scripts/bench_serve_engine.py \
          --startup-only ${SERVE_ARGS:---max-running 64} --out "$OUT/startup_$run.json" 2>&1 | grep -v Warning \
          | tee "$OUT/startup_$run.log"
      done ;;
    compile)  # issue 26: the embedded 1-slot engine's 8 programs compiled in 8 threads, with its Pallas kernels
      # and with their jnp references (PROBE_IMPLEMENTATIONS), on an empty cache each, under each XLA_FLAGS set of
      # PROBE_FLAG_SETS ('|'-separated; the first, empty, is XLA's defaults), e.g.
      # PROBE_FLAG_SETS="|--xla_llvm_disable_expensive_passes=true|--xla_gpu_disable_gpuasm_optimizations=true"
      IFS='|' read -ra FLAG_SETS <<< "${PROBE_FLAG_SETS:-}"
      [ ${#FLAG_SETS[@]} -eq 0 ] && FLAG_SETS=("")
      n=0
      for flags in "${FLAG_SETS[@]}"; do
        for impl in ${PROBE_IMPLEMENTATIONS:-auto xla}; do
          echo "--- $impl XLA_FLAGS=$flags"
          XLA_FLAGS="$flags" timeout ${PROBE_SECONDS:-150} python3 scripts/compile_probe.py --threads 8 \
            --implementation $impl --json "$OUT/compile_probe_${impl}_$n.json" 2>&1 | grep -v Warning | tail -12
        done
        n=$((n + 1))
      done 2>&1 | tee "$OUT/compile_probe.log" ;;
    compile-phases)  # issue 26: where one program's compile time goes: XLA's phase timers (VLOG 1 of the
      # GPU compiler's files) for decode and step[5], compiled one at a time, then each under PHASE_FLAGS
      for flags in "" ${PHASE_FLAGS:-}; do
        echo "--- XLA_FLAGS=$flags"
        XLA_FLAGS="$flags" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=${PHASE_VMODULE:-gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1} \
          timeout ${PROBE_SECONDS:-150} python3 scripts/compile_probe.py --threads 1 --only decode 5 2>&1 \
          | grep -E "time|took|program|threads=" | grep -v -E "Warning|loading" | cut -c1-220 | tail -${PHASE_LINES:-80}
      done 2>&1 | tee "$OUT/compile_phases.log" ;;
    switch)  # issue 26: what switching step executables costs a lone request (1-slot embedded engine):
      # fixed3 / alternate35 / fixed5 / per_request_queued with and without the learnt switch cost, with XLA's
      # defaults and under each of SWITCH_FLAGS (set it empty for XLA's defaults alone); SWITCH_ARGS: more
      # arguments of bench_serve_engine.py (e.g. --single-executables)
      for flags in "" ${SWITCH_FLAGS---xla_gpu_command_buffer_update_mode=SKIP_TEMP}; do
        echo "--- XLA_FLAGS=$flags"
        XLA_FLAGS="$flags" JDSPARK_CACHE=$WORK/switch-cache timeout ${SWITCH_SECONDS:-200} python3 scripts/bench_serve_engine.py \
          --max-running 1 --buckets 1 --concurrency 1 --modes fixed5 fixed3 alternate35 per_request_queued \
          per_request_queued_unpriced --rounds 3 \
          --requests 8 ${SWITCH_ARGS:-} 2>&1 | grep -E "^round|^\| |start-up|Error|error" | cut -c1-260
      done 2>&1 | tee "$OUT/switch.log" ;;
    serve-ab)  # issue 26: the engine's newest change against the engine without it, interleaved: prompts
      # riding in the verify calls (per_request_queued_riding, the default since 90e7f04) against prefill
      # calls for every prompt (per_request_queued); SERVE_ARGS, CONCURRENCY, REQUESTS, ROUNDS, AB_MODES
      JDSPARK_CACHE=$WORK/serve-cache timeout ${SERVE_SECONDS:-300} python3 scripts/bench_serve_engine.py \
        ${SERVE_ARGS:---max-running 16 --buckets 1 4 16} --concurrency ${CONCURRENCY:-16 4 1} --requests ${REQUESTS:-32} \
        --modes ${AB_MODES:-none fixed5 per_request_queued per_request_queued_riding} --rounds ${ROUNDS:-2} \
        --out "$OUT/serve_ab.json" 2>&1 | grep -E "^round|^\||start-up|Error|error" | cut -c1-600 | tee "$OUT/serve_ab.log" ;;
    prefill-ab)  # issue 26: the Flash-dims engine (decode buckets 16 64) prefilling in its decode buckets, then in
      # prefill buckets of its own (1 4 16 64); the second process loads the first's executables and compiles two
      # prefills; per_request_queued_eager: prompts never held back to share a call (is the hold still worth its
      # wait with cheap bucket-1 prefills?); PREFILL_AB_SECONDS each, CONCURRENCY, REQUESTS, ROUNDS, MODES; PREFILL_AB_ENGINE and
      # PREFILL_AB_BUCKETS replace the engine's arguments and the prefill buckets (e.g. "... --max-running 16
      # --buckets 16 ..." and "1 4 16": fewer programs)
      F=${PREFILL_AB_ENGINE:---synthetic flash --layers 8 --acceptance 0.8 --max-running 64 --buckets 16 64 --widths 3 5}
      for extra in "" "--prefill-buckets ${PREFILL_AB_BUCKETS:-1 4 16 64}"; do
        label=$([ -z "$extra" ] && echo decode_buckets || echo own_buckets)
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 JDSPARK_CACHE=$WORK/flash-cache timeout ${PREFILL_AB_SECONDS:-290} \
          python3 scripts/bench_serve_engine.py $F $extra --concurrency ${CONCURRENCY:-16} --requests ${REQUESTS:-64} \
          --modes ${MODES:-none fixed5 per_request_queued per_request_queued_eager} --rounds ${ROUNDS:-2} --out "$OUT/prefill_ab_$label.json" 2>&1 \
          | grep -E "^round|^\||start-up|Error|error" | cut -c1-600 | tee "$OUT/prefill_ab_$label.log"
      done ;;
    segments)  # issue 26: a prompt chunk inside the verify call against a prefill call of its own (Flash dims,
      # scripts/bench_segments.py); SEGMENTS_CASES: verify slots x rows + prompt slots x tokens
      timeout ${SEGMENTS_SECONDS:-300} python3 scripts/bench_segments.py --preset flash --layers 8 --experts 256 \
        --storage fp8+fp4 --cases ${SEGMENTS_CASES:-16x6+1x64 16x1+1x64 1x6+1x64 4x6+1x64 16x6+4x64} --context 4096 \
        --json "$OUT/bench_segments.json" 2>&1 | grep -v Warning | tee "$OUT/bench_segments.log" ;;
    segment-serve)  # issue 26: the Flash-dims engine (16 slots, c = 16, equal lengths, 64-token prompts) with the
      # oldest pending prompt in the verify calls' prompt segments (SEGMENT_TOKENS a call) against prefill calls
      # and riding, interleaved; then tests/engine/test_prompt_segments.py on this GPU (a tiny float32 model)
      F="--synthetic flash --layers 8 --acceptance 0.8 --max-running 16 --buckets 16 --widths 3 5 --prefill-buckets 1 4 16"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 JDSPARK_CACHE=$WORK/flash-cache timeout ${SEGMENT_SERVE_SECONDS:-400} \
        python3 scripts/bench_serve_engine.py $F --prompt-segment ${SEGMENT_TOKENS:-64} --concurrency ${CONCURRENCY:-16} \
        --requests ${REQUESTS:-64} --modes ${MODES:-none fixed5 per_request_queued per_request_queued_riding \
        per_request_queued_segment fixed5_segment} --rounds ${ROUNDS:-2} --out "$OUT/segment_serve.json" 2>&1 \
        | grep -E "^round|^\||start-up|Error|error|Traceback" | cut -c1-600 | tee "$OUT/segment_serve.log"
      timeout ${SEGMENT_TEST_SECONDS:-150} python3 -m pytest -q -W ignore -p no:cacheprovider \
        tests/engine/test_prompt_segments.py 2>&1 | tail -4 | tee "$OUT/segment_gpu_tests.log" ;;
    serve-engine)  # issue 26: the speculation modes, interleaved rounds, on the engine `startup` left warm
      LABEL=${SERVE_LABEL:-$(echo "${CONCURRENCY:-all}" | tr ' ' _)}
      JDSPARK_CACHE=$WORK/serve-cache timeout ${SERVE_SECONDS:-400} python3 scripts/bench_serve_engine.py \
        ${SERVE_ARGS:---max-running 64} --concurrency ${CONCURRENCY:-1 4 16 64} --requests ${REQUESTS:-32} ${MODES:+--modes $MODES} \
        --rounds ${ROUNDS:-3} --out "$OUT/bench_serve_engine_${LABEL}.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench_serve_engine_${LABEL}.log" ;;
    serve-env)  # issue 26: the serve-engine level (SERVE_ARGS, CONCURRENCY, REQUESTS, ROUNDS, MODES) once under each of
      # SERVE_ENVS ('|'-separated environment settings, the first run with none), each under SERVE_SECONDS (170);
      # one log for all ($OUT/serve_env.log) and the levels' JSON in one tarball. A setting that changes XLA_FLAGS
      # compiles cold (the flags are part of the compile cache's key): give SERVE_SECONDS the cold start-up. E.g.
      # the allocator and XLA's command-buffer update mode, SERVE_ENVS="XLA_PYTHON_CLIENT_ALLOCATOR=vmm
      # XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP|XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async"
      for so in $(xla_libraries); do
        echo "$so: $(grep -aoE "(SKIP_TEMP|SKIP_PROFILED|NEVER_UPDATE|ALWAYS_UPDATE|xla_gpu_command_buffer_update_mode)" "$so" | sort -u | tr '\n' ' ')"
      done 2>&1 | tee "$OUT/serve_env.log"
      IFS='|' read -ra SETTINGS <<< "${SERVE_ENVS:-}"
      mkdir -p "$WORK/serve-env"; i=0
      for setting in "" "${SETTINGS[@]}"; do
        i=$((i + 1)); echo "--- [$i] ${setting:-defaults} ($(date +%T))"
        env $setting JDSPARK_CACHE=$WORK/serve-cache timeout ${SERVE_SECONDS:-170} python3 scripts/bench_serve_engine.py \
          ${SERVE_ARGS:---max-running 64} --concurrency ${CONCURRENCY:-64} --requests ${REQUESTS:-128} \
          ${MODES:+--modes $MODES} --rounds ${ROUNDS:-1} --out "$WORK/serve-env/level_$i.json" 2>&1 | grep -v Warning
      done 2>&1 | tee -a "$OUT/serve_env.log"
      tar -czf "$OUT/serve_env_json.tar.gz" -C "$WORK/serve-env" . ;;
    cmdbuf-serve)  # issue 26: which allocation makes XLA update a serving step's CUDA graph. The serve-engine level
      # untraced (the profiler changes when buffers are freed: traced levels update on nearly every call), XLA's
      # command-buffer files logged at level 3, then scripts/cmdbuf_updates.py: per graph, the commands each update
      # re-recorded (1: the call's output; a few: its slot inputs; nearly all: its temporaries)
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=3,command_buffer_cmd=3 \
        JDSPARK_CACHE=$WORK/serve-cache timeout ${SERVE_SECONDS:-200} python3 scripts/bench_serve_engine.py \
        ${SERVE_ARGS:---max-running 64 --buckets 64} --concurrency ${CONCURRENCY:-64} --requests ${REQUESTS:-128} \
        --modes ${MODES:-none per_request_queued_riding} --rounds 1 > "$WORK/cmdbuf_serve_vlog.txt" 2>&1
      grep -E "^round|^start-up" "$WORK/cmdbuf_serve_vlog.txt" | cut -c1-200 | tee "$OUT/cmdbuf_serve.log"
      python3 scripts/cmdbuf_updates.py "$WORK/cmdbuf_serve_vlog.txt" 2>&1 | tee -a "$OUT/cmdbuf_serve.log" ;;
    keep-cache)  # the serving benches' XLA compile cache back through $OUT, in parts of 15 MiB (files come back up to
      # 16 MiB, 64 MiB in all): put them in build/device-cache and carry it, and a fresh machine of the same kind and
      # jax finds the programs its serve parts compile there (Flash dims, 64 slots, 16 programs: 248 s cold on an
      # H100). Only XLA's entries (jdspark's store of whole executables, xla/jdspark, is keyed by the sources too,
      # so the next commit would not load it, and it doubles the size), newest first, each that still fits in
      # KEEP_MIB (44) MiB. Their -atime files stay behind: jax reads them only with its cache's eviction on.
      (cd "$WORK/serve-cache" && find xla -maxdepth 1 -type f -name '*-cache' -printf '%T@ %s %p\n' \
        | LC_ALL=C sort -rn | awk -v limit=$(( ${KEEP_MIB:-44} << 20 )) '
            { if (t + $2 <= limit) { t += $2; n++; print $3 } }
            END { printf "keeping %d of %d XLA cache entries, %.1f MiB\n", n, NR, t / 2^20 > "/dev/stderr" }' \
        > "$WORK/keep.list")
      if [ ! -s "$WORK/keep.list" ]; then
        echo "no XLA cache entry kept"
      elif tar -czf "$WORK/serve-xla.tar.gz" -C "$WORK/serve-cache" -T "$WORK/keep.list" \
          && [ "$(stat -c %s "$WORK/serve-xla.tar.gz")" -gt $((45 << 20)) ]; then
        echo "compile cache $(( $(stat -c %s "$WORK/serve-xla.tar.gz") >> 20 )) MiB compressed: over the 45 MiB" \
          "kept back, not returned (lower KEEP_MIB)"
      else
        split -b 15M -d -a 1 "$WORK/serve-xla.tar.gz" "$OUT/serve-xla.tar.gz.part" && ls -l "$OUT"/serve-xla.tar.gz.part*
      fi ;;
    *)
      echo "unknown part: $part" ;;
  esac
done
