"""Communication hooks (torch DDP's `register_comm_hook`): torch's built-in
hooks by short name, and how each reaches the buckets. On CPU replicas
across processes the hook itself runs on every summed bucket (the link's
transport calls it). On GPUs the buckets never come back to Python: NCCL
reduces them from pyddp's C++ core, which runs torch's 16-bit compression
hooks itself (cast, scale by 1/ranks, NCCL sum in 16 bits, cast back; the
scaling bitwise the hooks' own arithmetic on CUDA tensors, the sums NCCL's:
docs/across-processes.md), so only those are accepted there."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _default_hooks() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks


def builtin_comm_hook(name: str) -> Callable[..., Any]:
    """torch DDP's built-in compression hooks, by short name."""
    hooks = _default_hooks()
    named = {
        "fp16": hooks.fp16_compress_hook,
        "bf16": hooks.bf16_compress_hook,
        "allreduce": hooks.allreduce_hook,
    }
    if name not in named:
        raise ValueError(f"register_comm_hook: unknown hook {name!r}; built in: {', '.join(named)}")
    return named[name]


def resolve_hook(hook: Any) -> Callable[..., Any]:
    """A hook by name or a callable (state, bucket) -> Future."""
    if isinstance(hook, str):
        hook = builtin_comm_hook(hook)
    if not callable(hook):
        raise TypeError(
            f"register_comm_hook: hook must be callable (state, bucket) -> Future, or "
            f"'fp16'/'bf16', got {type(hook).__name__}"
        )
    return hook


def gpu_wire_dtype(hook: Callable[..., Any]) -> str:
    """The wire type that runs `hook` on GPUs in pyddp's core ("float32":
    the plain all-reduce), or an error naming what is supported."""
    hooks = _default_hooks()
    wire = {
        hooks.fp16_compress_hook: "float16",
        hooks.bf16_compress_hook: "bfloat16",
        hooks.allreduce_hook: "float32",
    }.get(hook)
    if wire is None:
        name = getattr(hook, "__qualname__", type(hook).__name__)
        raise NotImplementedError(
            f"pyddp: on GPUs, NCCL reduces the buckets inside pyddp's C++ core, without Python, "
            f"so it runs torch DDP's built-in hooks there ('fp16', 'bf16', 'allreduce', or "
            f"default_hooks' functions), not {name}; Python hooks (PowerSGD, your own) run on "
            "CPU replicas across processes"
        )
    return wire


def check_gpu_state(state: Any, group: Optional[Any]) -> None:
    """torch's hooks take the process group as their state; on GPUs pyddp's
    NCCL communicator spans the wrapped group, so that is the only one."""
    if state is not None and state is not group:
        raise ValueError(
            "register_comm_hook: on GPUs the hook's state must be None or the process group "
            f"the model was wrapped with (pyddp's NCCL communicator spans it), got {state!r}"
        )
