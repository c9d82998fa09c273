"""Threads that each need a new capture at the same moment all finish, right.

A server's dynamic batcher calls one converted module from several threads with the batch
sizes it formed; each new size is a capture, made as the writer of the capture lock by a
thread that was running a call (a reader). A read upgraded in place deadlocks two such
threads; the lock sets a reader's reads aside while it waits (``module/isolation.py``).
Each round runs under a deadline that fails the test rather than hanging the suite.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.module.isolation import CaptureLock

DEADLINE_S = 120.0
THREADS = 8


class ConvReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


def _run_at_once(work: list) -> list:
    """Run each callable on its own thread, released together; their results in order, or
    the test fails when one has not finished by the deadline (a deadlock)."""
    start = threading.Barrier(len(work))
    results: list = [None] * len(work)
    errors: list = []

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = work[i]()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, f"{stuck} of {len(work)} threads still waiting after {DEADLINE_S} s"
    assert not errors, errors[0]
    return results


@pytest.mark.parametrize("capture", ["export", "symbolic", "first_call"])
def test_threads_each_bringing_a_new_size_all_finish_right(capture: str) -> None:
    torch.manual_seed(0)
    model = ConvReLU()
    x = torch.randn(2, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if capture == "first_call":
            gm = amprewrite.convert(model, capture="export")
        else:
            gm = amprewrite.convert(model, (x,) if capture == "export" else None,
                                    capture=capture)
        gm(x)
        for round_ in range(3):  # sizes no capture has seen, every thread at once
            inputs = [torch.randn(3 + round_ * THREADS + i, 3, 8 + round_, 8)
                      for i in range(THREADS)]
            got = _run_at_once([lambda t=t: gm(t) for t in inputs])
            for t, out in zip(inputs, got):
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    want = model(t)
                assert out.dtype == want.dtype and out.shape == want.shape
                torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_reader_that_writes_sets_its_read_aside_and_takes_it_back() -> None:
    lock = CaptureLock()
    both_read = threading.Barrier(2)

    def read_then_write() -> tuple[bool, int]:
        lock.acquire_read()
        both_read.wait()  # each holds a read, then each writes
        with lock.writing():  # waits past its own read only
            alone = lock._writer == threading.get_ident() and not lock._readers
        held = lock._readers.get(threading.get_ident(), 0)  # taken back
        lock.release_read()
        return alone, held

    assert _run_at_once([read_then_write, read_then_write]) == [(True, 1), (True, 1)]
    assert lock._readers == {} and lock._writer is None
