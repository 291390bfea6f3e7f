"""pyddp under Hugging Face Accelerate: `pyddp.accelerate.prepare` is
`accelerator.prepare` with the model wrapped by pyddp instead of torch DDP.

    from accelerate import Accelerator
    import pyddp.accelerate

    accelerator = Accelerator()
    model, optimizer, loader = pyddp.accelerate.prepare(accelerator, model, optimizer, loader)
    # the rest is Accelerate as usual: accelerator.accumulate(model),
    # accelerator.backward(loss), accelerator.clip_grad_norm_(...),
    # accelerator.save_state()/load_state(), accelerate launch or torchrun

How: Accelerate's public `prepare_model(model, evaluation_mode=True)` does
everything but the DDP wrap (device placement, its mixed precision around
forward, torch.compile if configured, registration for save_state); pyddp
then wraps the model over `accelerator.device`, on the process group
Accelerate initialised. Everything that is not a module goes to
`accelerator.prepare` unchanged. `accelerator.accumulate(model)` and
`accelerator.no_sync(model)` call the wrapped model's `no_sync()`.

The returned model is a `pyddp.DistributedModel`; `accelerator.unwrap_model`
sees through it as through DDP (Accelerate knows torch's wrappers only:
`prepare_model` teaches this accelerator pyddp's), so code ported from DDP
and the transformers Trainer, which reads the model's class through it (its
label smoother shifts a causal LM's labels only when it sees one), get the
user's model. `pyddp.accelerate.unwrap(model)` (or `model.module`) does the
same. `DistributedDataParallelKwargs(comm_hook=...,
comm_wrapper=..., comm_state_option=...)` is registered on the wrapped model
by Accelerate itself (FP16, BF16, PowerSGD and batched PowerSGD, with their
wrappers; CPU processes: hooks on GPUs are refused). Refused by name: FSDP,
DeepSpeed, Megatron, tensor parallelism and XLA (Accelerate's other
engines)."""

from __future__ import annotations

import functools
import os
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "pyddp.accelerate needs Accelerate: pip install 'pyddp-engine[accelerate]' "
        "(from a clone: '.[accelerate]')"
    ) from e

from torch import nn

from ..replicas.ddp_args import wrap_options
from ..replicas.model import DistributedModel, wrap

# Accelerate's modes where its model wrapper is torch DDP (or none).
_DDP_LIKE = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def prepare(accelerator: Accelerator, *objects: Any, **options: Any) -> Any:
    """`accelerator.prepare(*objects)`, with every torch module prepared by
    `prepare_model` below. Returns one object or a tuple, as Accelerate."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"pyddp.accelerate.prepare(accelerator, ...): the first argument must be an "
            f"accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    out = [
        prepare_model(accelerator, o, **options) if isinstance(o, nn.Module) else o for o in objects
    ]
    rest = [i for i, o in enumerate(out) if not isinstance(o, DistributedModel)]
    if rest:
        prepared = accelerator.prepare(*[out[i] for i in rest])
        prepared = prepared if len(rest) > 1 else (prepared,)
        for i, p in zip(rest, prepared):
            out[i] = p
    return out[0] if len(out) == 1 else tuple(out)


def refuse_lone_processes(accelerator: Accelerator, remedy: str) -> None:
    """Launched as several processes (WORLD_SIZE) where Accelerate set up
    none: each would train alone, silently; refused, with `remedy`."""
    world = os.environ.get("WORLD_SIZE", "1")
    if accelerator.distributed_type == DistributedType.NO and world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"pyddp: launched as {world} processes (WORLD_SIZE), but Accelerate set up none: "
            f"each process would train alone. {remedy}"
        )


def prepare_model(accelerator: Accelerator, model: nn.Module, **options: Any) -> DistributedModel:
    """`model` prepared by Accelerate without its DDP wrap, then wrapped by
    pyddp over `accelerator.device`; `options` are pyddp.wrap's (or the
    DDP keywords of the accelerator's DistributedDataParallelKwargs, read
    the same way as in the Lightning strategy)."""
    if isinstance(model, DistributedModel):
        raise TypeError("pyddp.accelerate.prepare_model: the model is already wrapped by pyddp")
    kind = accelerator.distributed_type
    if kind not in _DDP_LIKE:
        raise NotImplementedError(
            f"pyddp.accelerate: Accelerate is set up for {kind.value}, which does not use torch "
            "DDP; pyddp replaces DDP only (one process per device, or several CPU processes). "
            "Use accelerator.prepare(model) for that mode"
        )
    refuse_lone_processes(accelerator, "On CPUs, Accelerate needs Accelerator(cpu=True) (or "
                          "`accelerate launch --cpu`) to start its gloo group")  # fmt: skip
    handler = accelerator.ddp_handler
    ddp_kwargs = handler.to_kwargs() if handler is not None else {}
    hook = getattr(getattr(handler, "comm_hook", None), "value", None) or "no"
    wrapper = getattr(getattr(handler, "comm_wrapper", None), "value", None) or "no"
    if hook == "no" and wrapper != "no":
        raise ValueError(
            f"pyddp.accelerate: DistributedDataParallelKwargs(comm_wrapper={wrapper!r}) without "
            "a comm_hook: a wrapper wraps a hook (Accelerate would ignore it)"
        )
    options = {**wrap_options(ddp_kwargs, "DistributedDataParallelKwargs"),
               **wrap_options(options, "pyddp.accelerate.prepare_model")}  # fmt: skip
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    dm = wrap(prepared, [accelerator.device], **options)
    if hook != "no":
        # Accelerate's own registration (its hook, wrapper and PowerSGD state
        # from comm_state_option), called on the pyddp model as on DDP: the
        # signature is the same, and the buckets have GradBucket's methods.
        handler.register_comm_hook(dm)
    # Accelerate's mark for a prepared model: passing `dm` to
    # accelerator.prepare again returns it as it is instead of wrapping it
    # in DDP (which would reduce every gradient twice).
    dm._is_accelerate_prepared = True
    _see_through(accelerator)
    return dm


def _see_through(accelerator: Accelerator) -> None:
    """This accelerator's unwrap_model takes a pyddp model's own module first."""
    original = accelerator.unwrap_model
    if getattr(original, "_pyddp", False):
        return

    @functools.wraps(original)
    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return original(unwrap(model), *args, **kwargs)

    unwrap_model._pyddp = True  # type: ignore[attr-defined]
    accelerator.unwrap_model = unwrap_model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a model from `prepare` (what
    `accelerator.unwrap_model` gives for a DDP-wrapped one)."""
    return model.module if isinstance(model, DistributedModel) else model
