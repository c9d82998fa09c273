"""torch's own log records during a conversion stay out of the terminal unless the user
configured those loggers (or TORCH_LOGS); other threads and later records are untouched."""

from __future__ import annotations

import logging
import threading
from typing import Iterator

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import AmpRewriteError, OpCategory, Policy
from amprewrite.capture.logs import CAPTURE_LOGGERS

SHAPES = "torch.fx.experimental.symbolic_shapes"


class Chatty(nn.Module):
    """Logs on torch's shape logger while it is traced, as torch does when it cannot
    simplify a size expression; and from another thread, which the filter must not touch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logging.getLogger(SHAPES).warning("Failed to reduce inequalities (this thread)")
        other = threading.Thread(target=lambda: logging.getLogger(SHAPES).warning(
            "a record of another thread"))
        other.start()
        other.join()
        return self.fc(x)


class Records(logging.Handler):
    """Collects the messages that reach the handlers of torch's capture loggers."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> Iterator[Records]:
    """torch's own setup, whatever an earlier test configured (levels unset, no TORCH_LOGS),
    and a handler on each capture logger next to torch's."""
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    handler = Records()
    loggers = [logging.getLogger(name) for name in CAPTURE_LOGGERS]
    for logger in loggers:
        monkeypatch.setattr(logger, "level", logging.NOTSET)
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def test_capture_records_are_dropped_in_the_converting_thread_only(records: Records) -> None:
    model = Chatty()
    amprewrite.convert(model, (torch.randn(2, 4),))
    assert records.messages == ["a record of another thread"]
    assert all(not logger.filters for logger in map(logging.getLogger, CAPTURE_LOGGERS))
    model(torch.randn(2, 4))  # not converting: the model's own records get through
    assert "Failed to reduce inequalities (this thread)" in records.messages


def test_a_logger_the_user_configured_keeps_its_records(records: Records) -> None:
    logger = logging.getLogger(SHAPES)
    logger.setLevel(logging.WARNING)
    try:
        amprewrite.convert(Chatty(), (torch.randn(2, 4),))
    finally:
        logger.setLevel(logging.NOTSET)
    assert "Failed to reduce inequalities (this thread)" in records.messages


def test_torch_logs_keeps_every_record(records: Records,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_LOGS", "dynamic")
    amprewrite.convert(Chatty(), (torch.randn(2, 4),))
    assert "Failed to reduce inequalities (this thread)" in records.messages


class VectorWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 4))

    def forward(self, h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return h.masked_scatter(h > 0, torch.mv(self.w, v))


def test_a_failed_conversion_says_it_in_one_error_not_in_torchs_tracebacks(
        records: Records) -> None:
    """A meta kernel that rejects the casts' dtypes makes torch's fake tensors log the
    traceback at ERROR; amprewrite's error says what matters."""
    policy = Policy().override(ops={"masked_scatter": OpCategory.PASSTHROUGH})
    with pytest.raises(AmpRewriteError, match="masked_scatter"):
        amprewrite.convert(VectorWrite(), (torch.randn(3, 4), torch.randn(4)), policy=policy)
    assert records.messages == []


def test_a_size_one_dimension_is_not_reported_in_torchs_words(
        records: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    """An example batch of one: torch.export specializes it and logs "Dim.AUTO was specified
    along with a sample input with hint = 1", which the user did not write; the converted
    module's own error names the captured shapes when other sizes come."""
    export_logger = logging.getLogger("torch._export.non_strict_utils")
    seen = Records()
    monkeypatch.setattr(export_logger, "level", logging.NOTSET)
    export_logger.addHandler(seen)
    try:
        gm = amprewrite.convert(nn.Sequential(nn.Linear(4, 4)), (torch.randn(1, 4),))
    finally:
        export_logger.removeHandler(seen)
    assert not [m for m in seen.messages if "specialized" in m]
    with pytest.warns(amprewrite.RecaptureWarning, match=r"captured for float32 of shape "
                                                         r"\(1, 4\)"):
        assert gm(torch.randn(3, 4)).shape == (3, 4)
