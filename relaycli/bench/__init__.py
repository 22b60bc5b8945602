"""`relay bench`: reproducible throughput and kernel benchmarks.

workloads.py  request lengths (ShareGPT-like log-normal, fixed) from a seed
roofline.py   the roofline model of a decode step (pure arithmetic) and the ceilings
              measured in the same run (copy bandwidth, matmul rate)
e2e.py        relay, --no-relay and transformers' generate on one workload
hf_peer.py    the transformers peer: relay's weights in a transformers Llama, batched generate
kernels.py    relay attention against the baseline (Triton on CUDA, reference on CPU)
report.py     rich tables, JSON, the PNG plot
cli.py        the typer sub-app (the only part that prints)
"""
