"""Shared fixtures: one relay cache folder for the whole test run, the default model once.

The tests folder is one package, so package-scoped fixtures live as long as the run.
"""

from __future__ import annotations

import os

import pytest
import torch

# One intra-op thread: on a 2-core machine OpenMP spin-waits make small ops 10-100x
# slower as soon as anything else runs (a subprocess CLI test, another job).
torch.set_num_threads(1)


@pytest.fixture(scope="package", autouse=True)
def relay_cache_dir(tmp_path_factory):
    """Tests never touch the user's cache; subprocesses (CLI tests) inherit this too."""
    if "RELAY_CACHE_DIR" not in os.environ:
        os.environ["RELAY_CACHE_DIR"] = str(tmp_path_factory.mktemp("relay-cache"))
    return os.environ["RELAY_CACHE_DIR"]


@pytest.fixture(scope="package")
def default_model(relay_cache_dir):
    """The embedded default model (SmolLM2-135M-Instruct) in fp32 on CPU."""
    from relaycli.models.registry import load_model
    return load_model(None, dtype="float32", device="cpu")
