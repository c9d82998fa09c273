"""The model state a converted graph was captured for, frozen, and the per-call check that it holds.

A :class:`StateSnapshot` is taken from the reads of one capture (:mod:`amprewrite.capture.reads`):
the value of each attribute the forward read, the tables of submodules it walked, the config
objects it consulted, and the slots it found empty. Each call of the converted module asks
:meth:`StateSnapshot.holds`; where it does not, the module captures again or raises
(:mod:`amprewrite.capture.variants`), and :meth:`StateSnapshot.changes` names what changed::

    block.use_gate: True -> False
    config.output_hidden_states: False -> True
    classifier: replaced (Linear)

**The check is cheap on purpose**: it runs on every call. Each kind of item is one list held
side by side with the live containers, compared in C: ``frozen == list(map(getitem, dicts,
keys))`` for attribute values, ``frozen_tables == live_tables`` for submodule tables (dicts
compared entry by entry, submodules by identity), ``frozen_configs == live_config_dicts``.
How values are frozen decides what a change is (:func:`freeze`): plain values and containers of
them by equality (a copy of a list, so that ``merged_adapters.append(...)`` is seen),
everything else by identity (a replaced submodule, config or tensor), never by a tensor's own
``==``.

Parameter and buffer slots are not compared here: the converted module's submodules hold the
model's own ``_parameters`` and ``_buffers`` dicts (:func:`amprewrite.runtime.model_watch.share_tensor_dicts`),
so a tensor replaced on the model, by ``setattr`` or written straight into the dict, is what the
converted module reads. Only the slots a capture found empty (``bias=None``) are compared, and
only after something registered a tensor somewhere (:data:`amprewrite.runtime.model_watch`'s
stamp), since filling one goes through ``register_parameter``.
"""

from __future__ import annotations

import copy
import enum
import operator
from typing import Any

import torch
import torch.nn as nn

from ..capture.reads import Reads, is_config

__all__ = ["StateSnapshot", "freeze", "Same"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, type, range, slice, type(Ellipsis))


class Same:
    """Compares equal to one object only: a frozen value that changes by being replaced."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return other is self.obj

    def __ne__(self, other: object) -> bool:
        return other is not self.obj

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return _describe(self.obj)


def freeze(value: Any, configs: dict[int, Any] | None = None) -> Any:
    """``value`` as a snapshot keeps it: plain values as they are, lists, tuples, dicts and sets
    of them copied, config objects and anything else compared by identity (:class:`Same`),
    noting configs met on the way in ``configs``."""
    kind = type(value)
    if kind in _PLAIN or isinstance(value, enum.Enum):
        return value
    if kind is list or kind is tuple:
        return kind(freeze(v, configs) for v in value)
    if kind is dict:
        return {k: freeze(v, configs) for k, v in value.items()}
    if kind is set or kind is frozenset:
        return kind(value)
    if isinstance(value, tuple) and all(type(v) in _PLAIN for v in value):
        return value  # torch.Size, a named tuple of plain values: immutable
    if configs is not None and is_config(value):
        configs.setdefault(id(value), value)
    if isinstance(value, nn.Module) or kind.__eq__ is object.__eq__:
        return value  # compared by identity anyway, and in C
    return Same(value)


class StateSnapshot:
    """The state one capture read (module docstring). ``names`` gives each module its
    qualified name in the model, for messages."""

    def __init__(self, reads: Reads, root: nn.Module) -> None:
        path = {}
        for name, module in root.named_modules(remove_duplicate=False):
            path.setdefault(id(module), name)
        configs: dict[int, Any] = dict(reads.configs)
        self._values = [(owner, key, _join(path.get(id(owner), "?"), key))
                        for owner, key in reads.values.values()]
        self._frozen_values = [freeze(owner.__dict__[key], configs) for owner, key, _ in self._values]
        self._absent = [(holder, key) for holder, key in reads.absent.values()]
        self._tables = [(m, path.get(id(m), "?")) for m in reads.tables.values()]
        self._frozen_tables = [dict(m._modules) for m, _ in self._tables]
        self._empty_slots = [(module, table, key, _join(path.get(id(module), "?"), key))
                             for module, table, key in reads.tensors.values()
                             if module.__dict__[table].get(key) is None]
        self._configs: list[tuple[Any, str]] = []
        self._frozen_configs: list[dict[str, Any]] = []
        seen: set[int] = set()
        while len(seen) < len(configs):  # nested configs join as they are frozen
            for key, config in list(configs.items()):
                if key in seen:
                    continue
                seen.add(key)
                self._configs.append((config, _config_name(config, root, path)))
                self._frozen_configs.append(freeze(dict(config.__dict__), configs))
        self._bind()

    def _bind(self) -> None:
        """The live containers the check reads, side by side with the frozen lists."""
        self._value_dicts = [owner.__dict__ for owner, _, _ in self._values]
        self._value_keys = [key for _, key, _ in self._values]
        self._absent_dicts = [_dict_of(holder) for holder, _ in self._absent]
        self._absent_keys = [key for _, key in self._absent]
        self._live_tables = [m._modules for m, _ in self._tables]
        self._live_configs = [config.__dict__ for config, _ in self._configs]
        self._slot_dicts = [module.__dict__[table] for module, table, _, _ in self._empty_slots]
        self._slot_keys = [key for _, _, key, _ in self._empty_slots]

    @property
    def size(self) -> int:
        """How many things the check compares."""
        return (len(self._values) + len(self._absent) + sum(map(len, self._frozen_tables))
                + sum(map(len, self._frozen_configs)) + len(self._empty_slots))

    def holds(self) -> bool:
        """Whether every value, table and config the capture read is as it was (not the
        empty tensor slots: :meth:`slots_hold`)."""
        try:
            return (self._frozen_values == list(map(operator.getitem, self._value_dicts,
                                                    self._value_keys))
                    and not any(map(operator.contains, self._absent_dicts, self._absent_keys))
                    and self._frozen_tables == self._live_tables
                    and self._frozen_configs == self._live_configs)
        except Exception:  # a read that now raises (a deleted attribute, a tensor's ==)
            return False

    def slots_hold(self) -> bool:
        """Whether the tensor slots the capture found empty still are."""
        return not any(map(operator.is_not, map(dict.get, self._slot_dicts, self._slot_keys),
                           [None] * len(self._slot_keys)))

    def changes(self, limit: int = 8) -> list[str]:
        """What differs from the snapshot, one line each, at most ``limit``."""
        out: list[str] = []
        for (owner, key, name), frozen in zip(self._values, self._frozen_values):
            live = owner.__dict__.get(key, _GONE)
            if not _same(frozen, live):
                out.append(f"{name}: {_describe(frozen)} -> {_describe(live)}")
        for holder, key in self._absent:
            if key in _dict_of(holder):
                out.append(f"{_holder_name(holder, self)}{key}: set on the instance after "
                           "conversion (it shadows what the class or its parent provided)")
        for (module, name), frozen in zip(self._tables, self._frozen_tables):
            out.extend(_table_changes(name, frozen, module._modules))
        for (config, name), frozen in zip(self._configs, self._frozen_configs):
            live = config.__dict__
            for key in sorted(set(frozen) | set(live), key=str):
                if not _same(frozen.get(key, _GONE), live.get(key, _GONE)):
                    out.append(f"{name}.{key}: {_describe(frozen.get(key, _GONE))} -> "
                               f"{_describe(live.get(key, _GONE))}")
        for module, table, key, name in self._empty_slots:
            if module.__dict__[table].get(key) is not None:
                out.append(f"{name}: was None, now a tensor")
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def union(self, other: StateSnapshot) -> StateSnapshot:
        """One snapshot of both captures' reads (two captures that gave one graph: it depends
        on what either read)."""
        new = object.__new__(StateSnapshot)
        new._values, new._frozen_values = _merged(self._values, self._frozen_values, other._values,
                                                  other._frozen_values, lambda i: (id(i[0]), i[1]))
        new._tables, new._frozen_tables = _merged(self._tables, self._frozen_tables, other._tables,
                                                  other._frozen_tables, lambda i: id(i[0]))
        new._configs, new._frozen_configs = _merged(self._configs, self._frozen_configs,
                                                    other._configs, other._frozen_configs,
                                                    lambda i: id(i[0]))
        new._absent = _merged(self._absent, self._absent, other._absent, other._absent,
                              lambda i: (id(i[0]), i[1]))[0]
        new._empty_slots = _merged(self._empty_slots, self._empty_slots, other._empty_slots,
                                   other._empty_slots, lambda i: (id(i[0]), i[1], i[2]))[0]
        new._bind()
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> StateSnapshot:
        # NB: the live containers are rebuilt from the copied owners (a deep copy of a module
        # makes its __dict__ afresh, so copying the dicts themselves would watch orphans).
        new = object.__new__(StateSnapshot)
        for attr in ("_values", "_frozen_values", "_absent", "_tables", "_frozen_tables",
                     "_empty_slots", "_configs", "_frozen_configs"):
            new.__dict__[attr] = copy.deepcopy(self.__dict__[attr], memo)
        new._bind()
        return new

    def __reduce__(self) -> Any:
        return (_not_saved, ())  # a loaded converted module keeps its saved graph only


def _not_saved() -> None:
    return None


_GONE = type("_Gone", (), {"__repr__": lambda self: "<deleted>"})()


def _same(frozen: Any, live: Any) -> bool:
    try:
        return bool(frozen == live)
    except Exception:
        return False


def _dict_of(holder: Any) -> dict:
    return holder if isinstance(holder, dict) else holder.__dict__


def _holder_name(holder: Any, snapshot: StateSnapshot) -> str:
    for owner, _, name in snapshot._values:
        if owner is holder:
            return name.rpartition(".")[0] + "." if "." in name else ""
    return ""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _config_name(config: Any, root: nn.Module, path: dict[int, str]) -> str:
    for name, module in root.named_modules():
        for attr, value in module.__dict__.items():
            if value is config:
                return _join(name, attr)
    for name, module in root.named_modules():
        for attr, value in module.__dict__.items():
            if is_config(value):
                for sub, inner in value.__dict__.items():
                    if inner is config:
                        return _join(_join(name, attr), sub)
    return type(config).__name__


def _table_changes(name: str, frozen: dict[str, Any], live: dict[str, Any]) -> list[str]:
    out = []
    for key in list(frozen) + [k for k in live if k not in frozen]:
        where = _join(name, key)
        old, new = frozen.get(key), live.get(key)
        if old is new:
            continue
        if key not in live:
            out.append(f"{where}: removed")
        elif key not in frozen:
            out.append(f"{where}: added ({type(new).__name__})")
        else:
            out.append(f"{where}: replaced ({type(old).__name__} -> {type(new).__name__})")
    return out


def _describe(value: Any) -> str:
    if isinstance(value, Same):
        value = value.obj
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, nn.Module):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _merged(items: list[Any], frozen: list[Any], more: list[Any], more_frozen: list[Any],
            key: Any) -> tuple[list[Any], list[Any]]:
    seen = {key(item) for item in items}
    out, out_frozen = list(items), list(frozen)
    for item, value in zip(more, more_frozen):
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
            out_frozen.append(value)
    return out, out_frozen
