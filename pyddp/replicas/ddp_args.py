"""torch DDP's keyword arguments, as the trainers pass them, read as pyddp's
wrap options: one place for the Lightning strategy, the Fabric strategy and
the Hugging Face adapter. What maps is mapped, what pyddp does anyway is
accepted, and what pyddp does not do is refused by name."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Mapping

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ..engine.options import WRAP_OPTIONS, Options

# DDP's flags that ask for what pyddp always does: accepted, no effect.
# (find_unused_parameters and static_graph are wrap options: pyddp finds
# unused parameters on every step whatever they say; static_graph counts
# each gradient's arrivals in the first backward; both shape the buckets a
# communication hook sees, as DDP's.)
ALWAYS = {
    # pyddp's gradients are always views into its buckets.
    "gradient_as_bucket_view": "pyddp's gradients are always views into its buckets",
    # Deprecated in DDP, where it does nothing.
    "check_reduction": "no effect in torch DDP either",
}

# Communication hooks: registered on the wrapped model by the integration
# that takes them (pyddp.lightning), as DDP's register_comm_hook.
HOOKS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")

# DDP's arguments that only place the module: pyddp takes the device the
# trainer chose; given to pyddp.wrap directly, what to write instead.
PLACEMENT = {
    "device_ids": "pass the devices as pyddp.wrap(model, devices=[...]); under torchrun, "
    "pyddp.init() then wrap(model) takes this rank's device",
    "output_device": "outputs are gathered on devices[0]; move them with .to(device)",
    "dim": "pyddp splits inputs along dim 0 (dim=0 is accepted)",
}

NOT_YET = {
    "bucket_cap_mb_list": "pass bucket_cap_mb (and first_bucket_cap_mb)",
    "model_averaging_period": "a Lightning strategy argument (pyddp.lightning.PyddpStrategy "
    "takes it); elsewhere register torch's post_localSGD_hook on the wrapped model and run "
    "a PeriodicModelAverager after each optimizer step",
    "mixed_precision": "DDP's mixed_precision (parameters in low precision) is not "
    "supported; use the trainer's mixed precision (autocast)",
    "init_sync": "pyddp always broadcasts rank 0's parameters (and buffers, unless "
    "broadcast_buffers=False) at wrap (init_sync=True is accepted)",
    "delay_all_reduce_named_params": "not supported",
    "param_to_hook_all_reduce": "not supported",
    "device_mesh": "not supported",
    "skip_all_reduce_unused_params": "not supported",
}


def wrap_options(kwargs: Mapping[str, Any], where: str, placed: bool = True) -> Dict[str, Any]:
    """pyddp.wrap's options from `kwargs`, which may mix DDP's keywords with
    pyddp's own; checked now (a TypeError or ValueError names the argument),
    so a wrong strategy fails where it is built, not at fit time. `placed`:
    a trainer chose the device (DDP's placement arguments are ignored);
    False for pyddp.wrap itself, which refuses them naming `devices`."""
    options: Dict[str, Any] = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{where}: takes a dict of options, not {type(kwargs).__name__}")
    if "process_group" in kwargs and "group" in kwargs:
        raise TypeError(f"{where}: pass group= or torch DDP's process_group=, not both")
    for name, value in kwargs.items():
        if name in WRAP_OPTIONS:
            options[name] = value
        elif name == "process_group":
            options["group"] = value  # DDP's name for it
        elif name == "forward_sync_buffers":  # torch 2.13's name for broadcast_buffers
            if value is not None:  # (None: DDP's default, broadcast_buffers decides)
                if kwargs.get("broadcast_buffers", value) != value:
                    raise TypeError(f"{where}: forward_sync_buffers= and broadcast_buffers= differ")
                options["broadcast_buffers"] = value
        elif name == "init_sync" and value is True:
            continue  # pyddp always broadcasts rank 0's parameters at wrap
        elif name in ALWAYS or (placed and name in PLACEMENT) or (name == "dim" and value == 0):
            continue
        elif name in PLACEMENT:
            raise TypeError(f"{where}: {name}= is a torch DDP argument: {PLACEMENT[name]}")
        elif name in HOOKS:
            raise TypeError(f"{where}: {name}= is not taken here; register the hook on the "
                            "wrapped model: model.register_comm_hook(state, hook)")  # fmt: skip
        elif name in NOT_YET:
            raise TypeError(f"{where}: {name}= is a torch DDP argument pyddp does not take: "
                            f"{NOT_YET[name]}")  # fmt: skip
        else:
            raise TypeError(
                f"{where}: unknown argument {name}=; pyddp's options are "
                f"{', '.join(WRAP_OPTIONS)}, and it accepts DDP's "
                f"{', '.join(sorted(ALWAYS))} (what pyddp always does)"
            )
    Options.for_wrap(options)  # values checked here
    return options


class StateDictKeys:
    """The wrapper's state dict holds the model's own keys (torch DDP's adds
    `module.`). Also where a module holding the wrapper loads its own state
    dict (torch recurses into the wrapper's `module` child under that
    prefix) and where torch.distributed.checkpoint walks those keys back to
    the module (its _fqn_modifiers hook: DCP skips DDP's prefix alike)."""

    module: nn.Module

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The wrapped model's state dict (replica 0; keys without a prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def _own_keys(self, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
        """`state_dict` for load_state_dict: a torch DDP checkpoint's (every
        key `module.`-prefixed, not all of them the model's own) with the
        prefix taken off a copy, as torch's consume_prefix_in_state_dict_if_present."""
        keys = list(state_dict)
        if not keys or not all(k.startswith("module.") for k in keys):
            return state_dict
        if set(keys) <= set(self.module.state_dict(keep_vars=True)):
            return state_dict  # (a model with a `module` child: its own checkpoint)
        own = OrderedDict(state_dict)  # (the caller's stays as it was, _metadata too)
        if getattr(state_dict, "_metadata", None) is not None:
            own._metadata = OrderedDict(state_dict._metadata)  # type: ignore[attr-defined]
        consume_prefix_in_state_dict_if_present(own, "module.")
        return own

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        inner = prefix + "module."  # keys a parent saved through state_dict() above
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]

    def _fqn_modifiers(self) -> Dict[str, str]:
        return {name: "module" for name in self.module._modules}
