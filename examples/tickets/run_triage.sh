#!/usr/bin/env bash
# Triage support tickets into fixed labels (choices) with a confidence (logprobs), and pull
# their fields out as JSON (a JSON schema). Needs xgrammar: pip install 'relay-batch[structured]'.
# Run from the repository root:  bash examples/tickets/run_triage.sh
# The embedded default model (135M parameters) shows the mechanics, not good labels: pass a
# larger model (--model to both commands) for those.
set -euo pipefail
relay compile-prompt examples/tickets/triage_prompt.txt --out triage.relaykv
relay run --in examples/tickets/tickets.jsonl --out triage.parquet --prompt triage.relaykv
python examples/tickets/confidence.py triage.parquet
