"""Answer examples/requests.jsonl on Ray Data with relay's engine in each actor.

    relay compile-prompt examples/system_prompt.txt --out sys.relaykv
    python examples/ray_job.py sys.relaykv answers/      # RAY_ADDRESS for a cluster; else a local one

One actor per GPU of the cluster (one on the CPU without GPUs), with its share of the
CPUs. Ray's read tasks read the input in place with relay's reader; rows keep their JSON in
one `request` column, so nested fields (messages, json_schema) reach relay exactly. The
answers are a Parquet dataset with relay's output columns and row_index.
"""

import json
import sys
from pathlib import Path

import ray

from relaycli.ray import RelayPredictor
from relaycli.ray_job import actor_cpus
from relaycli.ray_source import RequestDatasource

artifact, out = sys.argv[1], sys.argv[2]
ray.init()
gpus = int(ray.cluster_resources().get("GPU", 0))
requests = RequestDatasource(Path(__file__).with_name("requests.jsonl"), min_blocks=max(gpus, 1))
ray.data.DataContext.get_current().execution_options.preserve_order = True
# Reading and writing ask for no CPU: the actors ask for their share of them all.
answers = ray.data.read_datasource(requests, num_cpus=0).map_batches(
    RelayPredictor, fn_constructor_kwargs={"prompts": [str(Path(artifact).resolve())], "max_batch": 64,
                                           "max_tokens": 64},
    compute=ray.data.ActorPoolStrategy(size=max(gpus, 1)), num_gpus=1 if gpus else 0,
    num_cpus=actor_cpus(ray.nodes(), ray.available_resources()),  # as many torch threads
    batch_size=256, batch_format="pyarrow")
answers.write_parquet(out, ray_remote_args={"num_cpus": 0})
first = ray.data.read_parquet(out).take(1)[0]
print(json.dumps({k: first[k] for k in ("id", "finish_reason", "text")}, ensure_ascii=False))
