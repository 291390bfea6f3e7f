"""Weak dictionaries keyed by the user's objects (optimizers) in pyddp's
process-wide hooks: an object that cannot be a weak key (unhashable, or not
weak-referable) is simply not remembered, so the hook looks at it afresh
each time instead of raising TypeError inside torch's optimizer step."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any


class LenientWeakKeys(weakref.WeakKeyDictionary):
    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return super().get(key, default)
        except TypeError:
            return default

    def __setitem__(self, key: Any, value: Any) -> None:
        with contextlib.suppress(TypeError):
            super().__setitem__(key, value)
