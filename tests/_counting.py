"""A dict that counts its reads: a test swaps it in for a cache's entries to show that a fast
path made no lookup per entry."""

from __future__ import annotations

from typing import Any


class CountingDict(dict):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reads = 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, *args: Any) -> Any:
        self.reads += 1
        return super().get(*args)

    def items(self) -> Any:
        self.reads += 1
        return super().items()
