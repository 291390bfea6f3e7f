"""pyddp in the Hugging Face transformers Trainer: `PyddpTrainer` is
`transformers.Trainer` with pyddp wrapping the model where the Trainer
would use torch DDP.

    from pyddp.hf import PyddpTrainer

    trainer = PyddpTrainer(model=model, args=args, train_dataset=ds)   # was Trainer(...)
    trainer.train()                       # torchrun --nproc-per-node=N train.py

The Trainer's extension point for this is `_wrap_model` (the method its
own subclasses for SageMaker and XLA override): here it returns the model
prepared by `pyddp.accelerate.prepare_model`, so the Trainer hands Accelerate
only the optimizer, and everything else (gradient accumulation through
`accelerator.no_sync`, `max_grad_norm` clipping, mixed precision,
checkpoints with the model's own keys, evaluation on the unwrapped model)
stays the Trainer's. Keyword `pyddp_options`: pyddp.wrap's options.

Not replaced: one process driving several GPUs (the Trainer's
DataParallel), FSDP, DeepSpeed and XLA: the Trainer keeps its own there, or
pyddp refuses by name where the Trainer would use DDP with them."""

from __future__ import annotations

from typing import Any, Dict, Optional

try:
    import transformers
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "pyddp.hf needs transformers: pip install 'pyddp-engine[accelerate]' "
        "(from a clone: '.[accelerate]')"
    ) from e

from torch import nn

from ..replicas.ddp_args import wrap_options
from ..replicas.model import DistributedModel
from .accelerate import prepare_model, refuse_lone_processes


class PyddpTrainer(transformers.Trainer):
    """`transformers.Trainer` reducing gradients with pyddp instead of torch DDP."""

    def __init__(self, *args: Any, pyddp_options: Optional[Dict[str, Any]] = None, **kwargs: Any):
        self.pyddp_options = wrap_options(pyddp_options or {}, "PyddpTrainer(pyddp_options=...)")
        super().__init__(*args, **kwargs)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None):
        if isinstance(model, DistributedModel):
            return model  # a second train() call
        if training:  # (the stock Trainer trains each process alone there, silently)
            remedy = "On CPUs the Trainer needs TrainingArguments(use_cpu=True) for its gloo group"
            refuse_lone_processes(self.accelerator, remedy)
        if not training or not self.accelerator.use_distributed:
            # Evaluation runs the model itself, as under DDP; one process has
            # nothing to reduce (and several GPUs in one process keep the
            # Trainer's DataParallel).
            return super()._wrap_model(model, training, dataloader)
        return prepare_model(self.accelerator, model, **self.pyddp_options)
