"""Input and output of relay jobs: request rows in, result rows out (see DESIGN.md, Contracts)."""

from relaycli.io.reader import InputError, RequestSource, detect_format, open_requests, read_requests
from relaycli.io.requests import (RequestDefaults, RequestRow, ResultRow, SamplingParams, derive_seed,
                                  parse_request)
from relaycli.io.writer import OUTPUT_COLUMNS, OUTPUT_SCHEMA, OutputError, ResultWriter, output_format

__all__ = [
    "InputError", "OutputError", "OUTPUT_COLUMNS", "OUTPUT_SCHEMA", "RequestDefaults", "RequestRow",
    "RequestSource", "ResultRow", "ResultWriter", "SamplingParams", "derive_seed", "detect_format",
    "open_requests", "output_format", "parse_request", "read_requests",
]
