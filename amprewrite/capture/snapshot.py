"""The model state a converted graph was captured for, frozen, and the per-call check that it holds.

A :class:`StateSnapshot` is taken from the reads of one capture (:mod:`amprewrite.capture.reads`):
the value of each attribute the forward read, the tables of submodules it walked, the config
objects it consulted, and the slots it found empty. Each call of the converted module asks
:meth:`StateSnapshot.holds`; where it does not, the module captures again or raises
(:mod:`amprewrite.module.cache`), and :meth:`StateSnapshot.changes` names what changed::

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
model's own ``_parameters`` and ``_buffers`` dicts (:func:`amprewrite.module.model_watch.share_tensor_dicts`),
so a tensor replaced on the model, by ``setattr`` or written straight into the dict, is what the
converted module reads. Only the slots a capture found empty (``bias=None``) are compared, and
only after something registered a tensor somewhere (:data:`amprewrite.module.model_watch`'s
stamp), since filling one goes through ``register_parameter``.
"""

from __future__ import annotations

import copy
import enum
import operator
import types
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from .reads import Reads, Slot, is_config

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
    if isinstance(value, tuple) and all(type(v) in _PLAIN for v in value):
        return value  # immutable: the same object (torch.Size, a named tuple too)
    if kind is list or kind is tuple:
        return kind(freeze(v, configs) for v in value)
    if kind is dict:
        return {k: freeze(v, configs) for k, v in value.items()}
    if kind is set or kind is frozenset:
        return kind(value)
    if configs is not None and is_config(value):
        configs.setdefault(id(value), value)
    if isinstance(value, nn.Module) or kind.__eq__ is object.__eq__:
        return value  # compared by identity anyway, and in C
    return Same(value)


class StateSnapshot:
    """The state one capture read (module docstring), with the model's qualified names for
    messages."""

    def __init__(self, reads: Reads, root: nn.Module) -> None:
        path: dict[int, str] = {}
        for name, module in root.named_modules(remove_duplicate=False):
            path.setdefault(id(module), name)
        configs: dict[int, Any] = dict(reads.configs)

        def named(slot: Slot) -> _Item:
            owner, table, key = slot
            where = _qualname(owner) if isinstance(owner, type) else path.get(id(owner), "?")
            return _Item(owner, table, key, _join(where, key))

        self._values = [named(slot) for slot in reads.values.values()]
        self._frozen_values = [freeze(_holder(i)[i.key], configs) for i in self._values]
        self._absent = [named(slot) for slot in reads.absent.values()]
        self._walked = [(m, path.get(id(m), "?")) for m in reads.walked.values() if m._modules]
        self._frozen_walked = [dict(m._modules) for m, _ in self._walked]
        self._empty_slots = [named(slot) for slot in reads.tensors.values()
                             if _holder(named(slot)).get(slot[2]) is None]
        self._full_slots = [named(slot) for slot in reads.tensors.values()
                            if _holder(named(slot)).get(slot[2]) is not None]
        self._slot_classes = [type(item.owner) for item in self._full_slots]
        """The class of each module a tensor was read from: a parametrization (weight_norm,
        spectral_norm, ``register_parametrization``) swaps it, and moves the tensor."""
        self._configs: list[tuple[Any, str]] = []
        self._frozen_configs: list[dict[str, Any]] = []
        seen: set[int] = set()
        while len(seen) < len(configs):  # nested configs join as they are frozen
            for key, config in list(configs.items()):
                if key in seen:
                    continue
                seen.add(key)
                self._configs.append((config, _config_name(config, root)))
                self._frozen_configs.append(_freeze_config(config, configs))
        self._bind()

    def _bind(self) -> None:
        """Generate the check (:func:`_generate_check`) over the live containers."""
        self._check = _generate_check(
            [(_holder(item), item.key, frozen)
             for item, frozen in zip(self._values, self._frozen_values)],
            [(_holder(item), item.key) for item in self._absent],
            [(module._modules, frozen) for (module, _), frozen
             in zip(self._walked, self._frozen_walked)]
            + [(config.__dict__, frozen) for (config, _), frozen
               in zip(self._configs, self._frozen_configs)])
        self._slot_dicts = [_holder(item) for item in self._empty_slots]
        self._slot_keys = [item.key for item in self._empty_slots]

    @property
    def size(self) -> int:
        """How many things the check compares."""
        return (len(self._values) + len(self._absent) + sum(map(len, self._frozen_walked))
                + sum(map(len, self._frozen_configs)))

    def holds(self) -> bool:
        """Whether every value, submodule and config the capture read is as it was (not the
        empty tensor slots: :meth:`slots_hold`)."""
        try:
            return self._check()
        except Exception:  # a read that now raises (a tensor's ==)
            return False

    def slots_hold(self) -> bool:
        """Whether the tensor slots the capture found empty still are, and the ones it found
        filled still are, on modules of the same class (checked only after some tensor was
        registered somewhere: :func:`amprewrite.module.model_watch.changes`)."""
        return not any(map(operator.is_not, map(dict.get, self._slot_dicts, self._slot_keys),
                           [None] * len(self._slot_keys))) and not self._moved_slots()

    def _moved_slots(self) -> list[str]:
        """The tensor slots read filled that are now empty (pruning moves ``weight`` to
        ``weight_orig``) or whose module changed class (a parametrization)."""
        return [item.name for item, cls in zip(self._full_slots, self._slot_classes)
                if type(item.owner) is not cls or _holder(item).get(item.key) is None]

    def changes(self, limit: int = 8) -> list[str]:
        """What differs from the snapshot, one line each, at most ``limit``."""
        out: list[str] = []
        for item, frozen in zip(self._values, self._frozen_values):
            live = _holder(item).get(item.key, _GONE)
            if item.table == "_modules" and live is not frozen:
                out.append(f"{item.name}: " + ("removed" if live is _GONE else
                                                f"replaced ({type(frozen).__name__} -> "
                                                f"{type(live).__name__})"))
            elif item.table != "_modules" and not _same(frozen, live):
                out.append(f"{item.name}: {_describe(frozen)} -> {_describe(live)}")
        for item in self._absent:
            if item.key in _holder(item):
                where = {"__dict__": "set on the instance (it shadows what its class provides)",
                         "_modules": "a submodule added"}.get(item.table, "a tensor added")
                out.append(f"{item.name}: {where}")
        for (module, name), frozen in zip(self._walked, self._frozen_walked):
            out.extend(_table_changes(name, frozen, module._modules))
        for (config, name), frozen in zip(self._configs, self._frozen_configs):
            live = config.__dict__
            for key in sorted(set(frozen) | set(live), key=str):
                if not _same(frozen.get(key, _GONE), live.get(key, _GONE)):
                    out.append(f"{name}.{key}: {_describe(frozen.get(key, _GONE))} -> "
                               f"{_describe(live.get(key, _GONE))}")
        for item in self._empty_slots:
            if _holder(item).get(item.key) is not None:
                out.append(f"{item.name}: was None, now a tensor")
        out.extend(f"{name}: no longer a plain tensor of its module (a parametrization or "
                   "pruning)" for name in self._moved_slots())
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def union(self, other: StateSnapshot) -> StateSnapshot:
        """One snapshot of both captures' reads (two captures that gave one graph: it depends
        on what either read). A value the two read differently does not decide the graph,
        which both gave: it is dropped (the submodules' ``training`` flags of the captures of
        two modes that gave the same code)."""
        new = object.__new__(StateSnapshot)
        for items, frozen in _PARTS:
            key = _key if items != "_walked" and items != "_configs" else _owner_key
            new.__dict__[items], new.__dict__[frozen] = _merged(
                self.__dict__[items], self.__dict__[frozen],
                other.__dict__[items], other.__dict__[frozen], key)
        theirs = {_key(item): value for item, value
                  in zip(other._values, other._frozen_values)}
        return new._keeping(lambda item, value: _key(item) not in theirs
                            or _same(value, theirs[_key(item)]))

    def without_flags(self) -> StateSnapshot:
        """This snapshot without the submodules' ``training`` flags: for a copy of the graph
        that computes its mode whatever the flags (a converted module converted again)."""
        return self._keeping(
            lambda item, _: not (item.table == "__dict__" and item.key == "training"))

    def _keeping(self, keep: Any) -> StateSnapshot:
        """A snapshot of the attribute values ``keep(item, frozen)`` keeps, the rest as here."""
        new = object.__new__(StateSnapshot)
        new.__dict__.update(self.__dict__)
        kept = [(i, v) for i, v in zip(self._values, self._frozen_values) if keep(i, v)]
        new._values, new._frozen_values = [i for i, _ in kept], [v for _, v in kept]
        new._bind()
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> StateSnapshot:
        # NB: the live containers are rebuilt from the copied owners (a deep copy of a module
        # makes its __dict__ afresh, so copying the dicts themselves would watch orphans).
        new = object.__new__(StateSnapshot)
        for items, frozen in _PARTS:
            new.__dict__[items] = copy.deepcopy(self.__dict__[items], memo)
            if frozen != items:
                new.__dict__[frozen] = copy.deepcopy(self.__dict__[frozen], memo)
        new._bind()
        return new

    def __reduce__(self) -> Any:
        return (_not_saved, ())  # a loaded converted module keeps its saved graph only


def _not_saved() -> None:
    return None


class _Item(NamedTuple):
    owner: Any
    table: str
    """``"__dict__"`` (the owner's attributes) or a module table: ``"_modules"``,
    ``"_parameters"``, ``"_buffers"``."""
    key: str
    name: str
    """Where it is in the model, for messages: ``block.use_gate``."""


def _holder(item: _Item) -> dict[str, Any]:
    own = item.owner.__dict__
    return own if item.table == "__dict__" else own[item.table]


def _key(item: _Item) -> tuple[int, str, str]:
    return id(item.owner), item.table, item.key


def _owner_key(entry: tuple[Any, str]) -> int:
    return id(entry[0])


_PARTS = (("_values", "_frozen_values"), ("_absent", "_absent"), ("_walked", "_frozen_walked"),
          ("_configs", "_frozen_configs"), ("_empty_slots", "_empty_slots"),
          ("_full_slots", "_slot_classes"))
"""Each kind of item and its frozen values (the item list itself where nothing is frozen)."""

_GONE = type("_Gone", (), {"__repr__": lambda self: "<deleted>"})()


CONFIG_RECORDS = frozenset({"architectures", "dtype", "torch_dtype", "transformers_version",
                            "_name_or_path", "_commit_hash"})
"""Config entries that record where a model came from and how it was saved, which no forward
reads: ``save_pretrained`` (and so ``Trainer``'s checkpoints) writes ``architectures`` and
``dtype``, and a graph captured again after every first save would cost a capture and a
warning for nothing."""


class _Unread:
    """A frozen config record (:data:`CONFIG_RECORDS`): equal to whatever it becomes."""

    __slots__ = ()

    def __eq__(self, other: Any) -> bool:
        return True

    def __ne__(self, other: Any) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<not compared>"


_UNREAD = _Unread()


def _freeze_config(config: Any, configs: dict[int, Any]) -> dict[str, Any]:
    """The config's entries frozen, its records (:data:`CONFIG_RECORDS`) as equal to anything:
    the per-call check compares the whole dict in C, so they stay in it, never compared."""
    return {k: _UNREAD if k in CONFIG_RECORDS else freeze(v, configs)
            for k, v in config.__dict__.items()}


def _same(frozen: Any, live: Any) -> bool:
    try:
        return bool(frozen == live)
    except Exception:
        return False


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _config_name(config: Any, root: nn.Module) -> str:
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


def _qualname(obj: Any) -> str:
    """A class's or function's qualified name without the enclosing function's locals."""
    return obj.__qualname__.rpartition("<locals>.")[2]


def _describe(value: Any) -> str:
    if isinstance(value, Same):
        value = value.obj
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, nn.Module):
        return type(value).__name__
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return f"function {_qualname(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _generate_check(values: list[tuple[dict, str, Any]], absent: list[tuple[dict, str]],
                    wholes: list[tuple[dict, dict]]) -> Any:
    """One Python function comparing every item, its containers and frozen values bound as
    its globals::

        def holds():
            return (v0 == d0['eps'] and d1['classifier'] is v1 and 'x' not in d2
                    and w0 == d3 and ...)

    NB: generated code, because it is what the interpreter runs fastest: each term is a
    specialised dict subscript and compare (about 10 ns), where the same comparison through
    ``map`` and list equality costs three times as much. An object compared by identity
    (a submodule, a config, a tensor) is tested with ``is``, never its own ``==``; plain
    values and containers of them with ``==`` (the frozen side on the left)."""
    scope: dict[str, Any] = {}
    terms = []
    for i, (live, key, frozen) in enumerate(values):
        scope[f"d{i}"] = live
        if isinstance(frozen, Same) or _by_identity(frozen):
            scope[f"v{i}"] = frozen.obj if isinstance(frozen, Same) else frozen
            terms.append(f"d{i}[{key!r}] is v{i}")
        else:
            scope[f"v{i}"] = frozen
            terms.append(f"v{i} == d{i}[{key!r}]")
    for i, (live, key) in enumerate(absent):
        scope[f"a{i}"] = live
        terms.append(f"{key!r} not in a{i}")
    for i, (live, frozen) in enumerate(wholes):
        scope[f"l{i}"], scope[f"w{i}"] = live, frozen
        terms.append(f"w{i} == l{i}")
    body = "\n        and ".join(terms) or "True"
    exec(compile(f"def holds():\n    return ({body})\n", "<amprewrite state check>", "exec"),
         scope)
    return scope["holds"]


def _by_identity(frozen: Any) -> bool:
    """Whether :func:`freeze` kept ``frozen`` to be compared by identity (not a plain value
    or a container copy)."""
    kind = type(frozen)
    return not (kind in _PLAIN or isinstance(frozen, (enum.Enum, list, tuple, dict, set,
                                                        frozenset)))


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
