"""A small random-init GPT-2 (transformers' default config but for size; no
download) trained by the transformers Trainer with pyddp reducing the
gradients: `PyddpTrainer` in place of `Trainer` is the only change
(`--engine ddp` runs the Trainer's own DDP, for comparison).

    torchrun --nproc-per-node=2 -m pyddp.examples.hf_trainer

Uses gradient accumulation, max_grad_norm clipping, a linear learning-rate
schedule, label smoothing, evaluation and checkpoints (`--resume` goes on
from the last).
`--lora` fine-tunes through a peft LoRA adapter (the base frozen; the
Trainer then checkpoints the adapter alone), `--gradient-checkpointing`
turns on the Trainer's own activation checkpointing (with `--lora`, the
usual memory-saving pair).
Rank 0 writes the final parameters (params.pt) and the median and mean time per step
(summary.json) to --output."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from pyddp.examples import count
from pyddp.examples._trainers import report, step_times
from pyddp.train.files import output_root


class Tokens(torch.utils.data.Dataset):
    """Random token rows (labels = inputs: causal language modelling)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="pyddp", help="pyddp (default) or ddp")
    parser.add_argument("--steps", type=count, default=12, help="optimizer steps")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    parser.add_argument("--lora", action="store_true", help="a peft LoRA adapter (needs peft)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--output", default=output_root("hf_trainer"))
    args = parser.parse_args(argv)

    import transformers

    from pyddp.hf import PyddpTrainer

    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    if args.lora:
        import peft

        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                               fan_in_fan_out=True)  # fmt: skip  # GPT-2's Conv1D layers
        model = peft.get_peft_model(model, lora)
    out = Path(args.output)
    targs = transformers.TrainingArguments(
        output_dir=str(out),
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=args.steps // 2,
        save_strategy="steps",
        save_steps=args.steps // 2,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=args.gradient_checkpointing,
        # The Trainer's label smoother shifts a causal LM's labels only when
        # it sees the model's class through accelerator.unwrap_model.
        label_smoothing_factor=0.1,
    )
    times = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.start)

    cls = PyddpTrainer if args.engine == "pyddp" else transformers.Trainer
    trainer = cls(
        model=model,
        args=targs,
        train_dataset=Tokens(256, 16, 96, seed=1),
        eval_dataset=Tokens(32, 16, 96, seed=2),
        callbacks=[StepTimes()],
    )
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    summary = {
        "engine": args.engine,
        "world": trainer.args.world_size,
        "steps": trainer.state.global_step,
        **step_times(times),
        "train_loss": result.training_loss,
        "eval_loss": metrics["eval_loss"],
    }
    if trainer.is_world_process_zero():
        report(out, model.state_dict(), summary)
    return summary


if __name__ == "__main__":
    main()
