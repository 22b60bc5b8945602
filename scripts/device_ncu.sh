#!/usr/bin/env bash
# Nsight Compute on single attention launches of a llama3-8b decode step (H200 machines
# run Firecracker, where ncu reads the hardware counters; clocks are left as they are).
# First the graph-replayed times of the same launches (scripts/device_ncu.py --time),
# then one profiled launch of each case. Writes $OUT/ncu_times.log and $OUT/ncu.log
# (./out when OUT is unset) and prints the headline metrics last.
# Usage: bash scripts/device_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
cases=(
  "--what sys --batch 64 --system 512"
  "--what sys --batch 64 --system 2048"
  "--what sys --batch 256 --system 2048"
  "--what sys --batch 256 --system 8192"
  "--what sys --batch 256 --system 2048 --splits 1"
  "--what sys --batch 256 --system 2048 --stages 2"
  "--what ctx --batch 256 --system 2048 --own 300"
  "--what merge --batch 256 --system 2048 --own 300"
  "--what relay --batch 256 --system 2048 --own 300"
)
for c in "${cases[@]}"; do
  timeout 60 python3 scripts/device_ncu.py $c --time 2>&1 | grep -E "^(time|case)|Error" | tee -a "$OUT/ncu_times.log"
done
kernel_of() { case "$1" in *"what sys"*) echo _gluon_system_kernel ;; *"what ctx"*) echo _paged_kernel ;; *) echo _merge_kernel ;; esac; }
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
for c in "--what sys --batch 64 --system 512" "--what sys --batch 256 --system 2048" "--what sys --batch 256 --system 8192" \
         "--what ctx --batch 256 --system 2048 --own 300" "--what merge --batch 256 --system 2048 --own 300"; do
  echo "=== ncu $c" | tee -a "$OUT/ncu.log"
  timeout 150 "$NCU" --clock-control none --kernel-name "$(kernel_of "$c")" --launch-skip 2 --launch-count 1 \
    $sections --import-source no python3 scripts/device_ncu.py $c >> "$OUT/ncu.log" 2>&1
  echo "rc $?" >> "$OUT/ncu.log"
done
grep -E "^===|Duration|Elapsed Cycles|SM Active Cycles|Compute \(SM\) Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|Block Limit|Stall|No Eligible|Issued Warp|Tensor|One or More Eligible|rc " "$OUT/ncu.log" | head -150
