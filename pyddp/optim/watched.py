"""The parameters of wrapped models that one of pyddp's process-wide optimizer
step hooks of torch's looks for among any optimizer's (optim/fused.py: fused
steps over replica 0's; unsynced.py: steps of unreduced gradients;
guard.py: steps of sharded ones). The hook is registered at the first
watched parameter; which of an optimizer's parameters are watched is found
once per optimizer, its parameter count and the watches since, so a step
costs a dictionary look-up."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .._link.weak import LenientWeakKeys

Found = List[Tuple[torch.Tensor, Any]]  # (parameter, what it was watched with)


class WatchedParams:
    def __init__(
        self,
        register: Callable[[Callable[..., Any]], Any],
        collect: Callable[[Found], Any] = list,
        groups: Optional[Callable[[Dict[str, Any]], bool]] = None,
    ) -> None:
        """`register`: torch's register_optimizer_step_pre_hook or _post_hook;
        `collect` makes what found() gives of an optimizer's watched
        parameters; `groups` picks the param groups looked in (all: None)."""
        # id(parameter) -> the parameter (weak: a dropped model leaves nothing)
        self._params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._tags: Dict[int, Any] = {}
        self._seen = LenientWeakKeys()  # optimizer -> ((parameter count, watches), collected)
        self._watches = 0
        self._register, self._collect, self._groups = register, collect, groups
        self._handle: Any = None

    def watch(
        self, params: Iterable[torch.Tensor], hook: Callable[..., Any], tag: Any = None
    ) -> None:
        """From now on `hook` runs at every optimizer step (registered once)
        and found() gives `params` among an optimizer's, each with `tag`."""
        for p in params:
            self._params[id(p)] = p
            if tag is not None:
                self._tags[id(p)] = tag
                weakref.finalize(p, self._tags.pop, id(p), None)
        self._watches += 1
        if self._handle is None:
            self._handle = self._register(hook)

    def __bool__(self) -> bool:
        return bool(self._params)

    def found(self, optimizer: Any) -> Any:
        """collect() of `optimizer`'s watched parameters (in its groups' order)."""
        groups = optimizer.param_groups
        key = (sum(len(g["params"]) for g in groups), self._watches)
        seen: Tuple[Tuple[int, int], Any] = self._seen.get(optimizer, ((-1, -1), None))
        if seen[0] != key:
            pick = self._groups
            found = [
                (p, self._tags.get(id(p)))
                for g in groups if pick is None or pick(g) for p in g["params"]
                if self._params.get(id(p)) is p
            ]  # fmt: skip
            seen = (key, self._collect(found))
            self._seen[optimizer] = seen
        return seen[1]
