"""pyddp inside PyTorch Lightning and Lightning Fabric: a strategy for each,
on their public extension point (a Strategy subclass), registered as
"pyddp" in both registries when this module is imported.

    import lightning as L
    import pyddp.lightning

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="pyddp")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="pyddp")
    # or strategy=pyddp.lightning.PyddpStrategy(bucket_cap_mb=25)

Everything else is Lightning's DDP strategy: its launchers (its own
subprocess launcher, torchrun, SLURM), its process group, samplers,
checkpoints, precision plugins and logging. Only the module wrapper changes:
pyddp.wrap over the device Lightning chose for this process, so gradients
are reduced by pyddp's engine during backward, averaged over processes as
DDP does. Lightning drives one device per process (its DataParallel
strategy is gone since 2.0), so there is one replica per process here.

Accepted torch-DDP arguments, with pyddp's reading: bucket_cap_mb and
broadcast_buffers (the same options), find_unused_parameters,
gradient_as_bucket_view (what pyddp always does), static_graph (its first
backward counts each gradient's arrivals, as DDP's),
ddp_comm_hook/ddp_comm_state/ddp_comm_wrapper (registered on the wrapped
model, on CPUs too, where Lightning's own DDP registers none), and
model_averaging_period (post-local SGD, run by Lightning's DDP strategy as
for its own DDP)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Dict, Generator

try:
    import lightning.fabric.strategies as fabric_strategies
    import lightning.pytorch.strategies as pl_strategies
    from lightning.fabric.strategies.strategy import _BackwardSyncControl
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "pyddp.lightning needs Lightning: pip install 'pyddp-engine[lightning]' "
        "(from a clone: '.[lightning]')"
    ) from e

from torch import nn

from ..replicas.ddp_args import wrap_options
from ..replicas.model import DistributedModel, wrap

NAME = "pyddp"

_HOOKS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


class PyddpStrategy(pl_strategies.DDPStrategy):
    """`lightning.Trainer(strategy=PyddpStrategy(...))`: Lightning's DDP
    strategy with pyddp reducing the gradients. Keywords: Lightning's
    (accelerator, parallel_devices, cluster_environment, checkpoint_io,
    precision_plugin, process_group_backend, timeout, start_method) and
    pyddp.wrap's options (bucket_cap_mb, first_bucket_cap_mb, timeout_s, ...)."""

    strategy_name = NAME

    def __init__(self, **kwargs: Any) -> None:
        lightning_own = _take(kwargs, "precision_plugin")
        # DDP's communication hook arguments, registered on the wrapped model
        # as Lightning's DDP strategy does (the wrapper applied to the hook).
        self._hook = {k: kwargs.pop(k, None) for k in _HOOKS}
        if self._hook["ddp_comm_hook"] is None and self._hook["ddp_comm_wrapper"] is not None:
            raise TypeError("PyddpStrategy: ddp_comm_wrapper= needs ddp_comm_hook=")
        # Post-local SGD as Lightning's DDP strategy runs it: given a
        # PostLocalSGDState, its setup makes a PeriodicModelAverager of this
        # period and its optimizer_step averages the parameters after each step.
        if "model_averaging_period" in kwargs:
            lightning_own["model_averaging_period"] = kwargs.pop("model_averaging_period")
        self._pyddp_options: Dict[str, Any] = wrap_options(kwargs, "PyddpStrategy")
        super().__init__(ddp_comm_state=self._hook["ddp_comm_state"], **lightning_own)

    def _setup_model(self, model: nn.Module) -> DistributedModel:  # type: ignore[override]
        options = dict(self._pyddp_options)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            # Lightning's DDP under manual optimization syncs buffers at its
            # first forward only (its forward redirection leaves DDP's
            # require_forward_param_sync off): each rank then keeps its own,
            # which its validation and sync_dist metrics read.
            options.setdefault("broadcast_buffers", False)
        return wrap(model, [self.root_device], **options)

    def _register_ddp_hooks(self) -> None:
        hook = self._hook["ddp_comm_hook"]
        if hook is None or not isinstance(self.model, DistributedModel):
            return
        if self._hook["ddp_comm_wrapper"] is not None:
            hook = self._hook["ddp_comm_wrapper"](hook)
        self.model.register_comm_hook(self._hook["ddp_comm_state"], hook)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulate_grad_batches: the micro-batches before the
        last accumulate without reducing (pyddp's no_sync)."""
        if isinstance(self.model, DistributedModel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        if isinstance(self.model, DistributedModel):
            self.model.close()  # its gradient hooks leave the user's module
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            NAME, cls, description="pyddp's engine in Lightning's DDP strategy", override=True
        )


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedModel):
            raise TypeError(
                "pyddp: fabric.no_backward_sync needs the module returned by fabric.setup() "
                f"(a pyddp DistributedModel), got {type(module).__name__}"
            )
        return module.no_sync()


class PyddpFabricStrategy(fabric_strategies.DDPStrategy):
    """`lightning.Fabric(strategy=PyddpFabricStrategy(...))`: Fabric's DDP
    strategy with pyddp reducing the gradients; keywords as PyddpStrategy."""

    def __init__(self, **kwargs: Any) -> None:
        lightning_own = _take(kwargs, "precision")
        self._pyddp_options: Dict[str, Any] = wrap_options(kwargs, "PyddpFabricStrategy")
        super().__init__(**lightning_own)
        self._backward_sync_control = _NoSync()

    def setup_module(self, module: nn.Module) -> DistributedModel:  # type: ignore[override]
        return wrap(module, [self.root_device], **self._pyddp_options)

    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        return super().get_module_state_dict(_unwrapped(module))

    def load_module_state_dict(
        self, module: nn.Module, state_dict: Dict[str, Any], strict: bool = True
    ) -> None:
        super().load_module_state_dict(_unwrapped(module), state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            NAME, cls, description="pyddp's engine in Fabric's DDP strategy", override=True
        )


def _take(kwargs: Dict[str, Any], precision: str) -> Dict[str, Any]:
    """Removes Lightning's own keywords from `kwargs` (the rest are pyddp's,
    or DDP's); `precision`: the Trainer's "precision_plugin" or Fabric's
    "precision"."""
    names = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
             precision, "process_group_backend", "timeout", "start_method")  # fmt: skip
    return {k: kwargs.pop(k) for k in names if k in kwargs}


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedModel) else module


def register() -> None:
    """Registers "pyddp" with Lightning's and Fabric's strategy registries
    (done on import; again is harmless)."""
    PyddpStrategy.register_strategies(pl_strategies.StrategyRegistry)
    PyddpFabricStrategy.register_strategies(fabric_strategies.STRATEGY_REGISTRY)


register()
