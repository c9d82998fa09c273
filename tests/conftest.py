"""Shared test fixtures."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n``), each worker takes its share of the cores for torch's
    threads: two workers with a thread per core each would run twice as many threads as the
    machine has, and each op would wait for the other worker's."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches empty before and after the test: compiled code, guards and counters of
    other tests neither serve nor count here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster, and deterministically on a busy machine, on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _hardware_warning_seen() -> Iterator[None]:
    """Tests run on whatever CPU CI has (often AVX2 only, where bf16 is slow): mark this
    machine's slow-dtype warning as already given, so it does not land in whichever test
    converts first. ``tests/test_hardware.py`` clears the record to test the warning."""
    from amprewrite import hardware as _hardware

    for dtype in (torch.float16, torch.bfloat16):
        _hardware._WARNED.add((_hardware.describe("cpu"), dtype))
    yield
