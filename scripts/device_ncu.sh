#!/usr/bin/env bash
# Nsight Compute on single attention launches of a llama3-8b decode step (H200 machines
# run Firecracker, where ncu reads the hardware counters; clocks are left as they are).
# Parts (default: times profile):
#   times    graph-replayed times of the launches profiled below (device_ncu.py --time)
#   profile  one profiled launch of each: speed of light, occupancy, scheduler, memory
#   stalls   stall ratios, tensor pipe, registers and spills of the system and context kernels at batch 256
#   regs     the context kernel timed without and with its register cap, twice (alternating)
#   l2       what the system and context kernels of a llama3 step at prefix 8,192 + 128 own keys ask of
#            the L2, the DRAM, the issue slots and the tensor pipe (twenty-first session)
# Writes $OUT/ncu_*.log (./out when OUT is unset) and prints the headline lines last.
# Usage: bash scripts/device_ncu.sh [times] [profile] [stalls] [regs] [l2]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(times profile)
kernel_of() { case "$1" in *"what sys"*) echo _gluon_system_kernel ;; *"what ctx"*) echo _paged_kernel ;; *) echo _merge_kernel ;; esac; }
timed() { timeout 60 python3 scripts/device_ncu.py "$@" --time 2>&1 | grep -E "^(time|case|context)|Error" | tee -a "$OUT/ncu_times.log"; }
for part in "${parts[@]}"; do
  case "$part" in
    times)
      for c in "--what sys --batch 64 --system 512" "--what sys --batch 64 --system 2048" \
               "--what sys --batch 256 --system 2048" "--what sys --batch 256 --system 8192" \
               "--what sys --batch 256 --system 2048 --splits 1" "--what sys --batch 256 --system 2048 --stages 2" \
               "--what ctx --batch 256 --own 300" "--what merge --batch 256 --own 300" "--what relay --batch 256 --own 300"; do
        timed $c
      done ;;
    profile)
      sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
      for c in "--what sys --batch 64 --system 512" "--what sys --batch 256 --system 2048" "--what sys --batch 256 --system 8192" \
               "--what ctx --batch 256 --own 300" "--what merge --batch 256 --own 300"; do
        echo "=== ncu $c" | tee -a "$OUT/ncu.log"
        timeout 150 "$NCU" --clock-control none --kernel-name "$(kernel_of "$c")" --launch-skip 2 --launch-count 1 \
          $sections --import-source no python3 scripts/device_ncu.py $c >> "$OUT/ncu.log" 2>&1
        echo "rc $?" >> "$OUT/ncu.log"
      done
      grep -E "^===|Duration|SM Active Cycles|Compute \(SM\) Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Waves Per SM|rc " "$OUT/ncu.log" ;;
    stalls)
      "$NCU" --query-metrics 2>/dev/null | grep -iE "gmma|warps_issue_stalled" | head -60 > "$OUT/ncu_metric_names.log"
      for c in "--what sys --batch 256 --system 2048" "--what ctx --batch 256 --own 300" "--what ctx --batch 256 --own 300 --maxnreg 0"; do
        echo "=== stalls $c" | tee -a "$OUT/ncu_stalls.log"
        timeout 150 "$NCU" --clock-control none --kernel-name "$(kernel_of "$c")" --launch-skip 2 --launch-count 1 \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,smsp__sass_inst_executed_op_local_st.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed" \
          python3 scripts/device_ncu.py $c >> "$OUT/ncu_stalls.log" 2>&1
        echo "rc $?" >> "$OUT/ncu_stalls.log"
      done
      grep -E "^===|stalled|qgmma|duration|warps_active|dram__|registers|local_st|rc " "$OUT/ncu_stalls.log" | awk '$NF != "0" && $NF != "0.00"' ;;
    regs)
      for shape in "--batch 256 --own 300" "--batch 128 --own 450" "--batch 256 --own 128"; do
        for r in 0 128 0 128; do timed --what ctx $shape --maxnreg $r; done
      done ;;
    l2)
      metrics="gpu__time_duration.sum,lts__t_bytes.sum,lts__t_bytes.sum.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread"
      for c in "--what sys --batch 256 --system 8192 --own 128" "--what ctx --batch 256 --system 8192 --own 128" \
               "--what sys --batch 64 --system 8192 --own 128" "--what ctx --batch 64 --system 8192 --own 128"; do
        echo "=== l2 $c" | tee -a "$OUT/ncu_l2.log"
        timeout 150 "$NCU" --clock-control none --kernel-name "$(kernel_of "$c")" --launch-skip 2 --launch-count 1 \
          --metrics "$metrics" python3 scripts/device_ncu.py $c >> "$OUT/ncu_l2.log" 2>&1
        echo "rc $?" >> "$OUT/ncu_l2.log"
      done
      grep -E "^===|gpu__|lts__|dram__|pipe_tensor|issue_active|wavefronts|warps_active|registers|rc " "$OUT/ncu_l2.log" ;;
    *) echo "unknown part $part (times, profile, stalls, regs, l2)"; exit 2 ;;
  esac
done
