#!/usr/bin/env bash
# A relay batch job you can copy: compile the shared system prompt once, then answer
# every request against it. Run from the repository root:  bash examples/run_job.sh
set -euo pipefail

# 1. The system prompt becomes a KV artifact (the default model: SmolLM2-135M-Instruct).
#    Reuse sys.relaykv for every job with the same prompt and model; recompile when either changes.
relay compile-prompt examples/system_prompt.txt --out sys.relaykv

# 2. Answer the requests. Rows without their own max_tokens get 64.
#    If the job is interrupted (Ctrl-C, a killed node), run the same command with --resume:
#    finished rows are kept, none is computed or written twice.
relay run --in examples/requests.jsonl --out answers.parquet --prompt sys.relaykv \
    --max-tokens 64 --stats-json stats.json

# The same job from OpenAI Batch API lines gives OpenAI batch output lines:
#   relay run --in examples/openai_batch.jsonl --out answers.jsonl --prompt sys.relaykv --max-tokens 64
# Look at the answers:
#   python -c "import pyarrow.parquet as pq; [print(r['id'], r['finish_reason'], r['text'][:70]) for r in pq.read_table('answers.parquet').to_pylist()]"
