"""Shared test fixtures."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster, and deterministically on a busy machine, on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
