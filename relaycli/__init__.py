"""relay: batch LLM inference for jobs that share one long system prompt."""

__version__ = "0.1.0"
