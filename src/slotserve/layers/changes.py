"""A count of the changes made to watched modules: what code holding raw pointers into a model (the fused
decode step's kernel, models/fused_decode.py) compares on every call, in place of walking the model.

Counted: a parameter, buffer or submodule assigned to or registered on a watched module (torch's global
registration hooks see every one), and an attribute our layers keep other tensors or packings in (`note`
from their `__setattr__`: Linear's `amx`, Attention's caches). Not seen: a tensor's `.data` swapped in
place, an entry written straight into a module's `_parameters`, a deleted attribute. Walking the model
instead (an identity check of every attribute read, ~700 of them on the default model) took 0.25-0.3 ms
of each ~27 ms batch-1 decode step here: run after the weight stream, every lookup missed the caches.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import nn

_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_count = 0


def watch(modules: Iterable[nn.Module]) -> int:
    """Watches these modules from now on; the count now."""
    _watched.update(modules)
    return _count


def count() -> int:
    return _count


def note(module: nn.Module, *_: object) -> None:
    """Counts a change to `module` where it is watched (the registration hooks' signature: module, name,
    value; returning None keeps the value)."""
    global _count
    if module in _watched:
        _count += 1


nn.modules.module.register_module_parameter_registration_hook(note)
nn.modules.module.register_module_buffer_registration_hook(note)
nn.modules.module.register_module_module_registration_hook(note)
