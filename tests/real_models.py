"""The models users bring, small and random-init (no downloads): transformers
families with their default configs but for size (caches, attention
implementation and output classes as the library sets them) and dropout 0,
so runs can be compared exactly. Shared by tests/test_real_models.py and the
multi-process scenarios."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Family(NamedTuple):
    build: Callable[[], nn.Module]
    # batch(rows, seed): the model's keyword arguments, labels included
    batch: Callable[[int, int], Dict[str, torch.Tensor]]
    # loss(outputs, labels): the mean over the rows given, for dmodel.loss
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    batch_norm: bool = False  # statistics per shard: not one device's full batch


VOCAB, SEQ = 96, 12


def _build(model: str, config: str, **settings: Any) -> nn.Module:
    """transformers' `model` class on its `config` class with `settings`
    (the rest left at the library's defaults), seeded."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**settings))


def _tokens(rows: int, seed: int, pad: bool = False) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    if pad:  # every other row padded on the right (not all: some shards keep full rows)
        lengths = torch.randint(SEQ // 2, SEQ, (rows,), generator=g)
        for i in range(0, rows, 2):
            mask[i, lengths[i] :] = 0
            ids[i, lengths[i] :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def gpt2() -> nn.Module:
    return _build(
        "GPT2LMHeadModel", "GPT2Config",
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def llama() -> nn.Module:
    return _build(
        "LlamaForCausalLM", "LlamaConfig",
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def mixtral() -> nn.Module:
    """A sparse mixture of experts: each token takes 2 of 4 experts, so what
    a replica computes depends on its shard (the experts' weights are one
    3-D parameter each, as transformers stores them)."""
    return _build(
        "MixtralForCausalLM", "MixtralConfig",
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip


def llama_lora() -> nn.Module:
    """Llama under a peft LoRA adapter, as fine-tuning runs it: the base
    frozen (requires_grad False before wrap), rank-4 adapters on the
    attention's q and v projections trainable. peft starts B at zero, so the
    first step moves B alone; B is set to small random values here so that
    both factors move from the first step."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(llama(), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def _causal_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    batch = _tokens(rows, seed)
    batch["labels"] = batch["input_ids"].clone()
    return batch


def causal_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the rows' tokens (every row has
    as many: a per-row mean that the shard weighting makes exact)."""
    logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
    return F.cross_entropy(logits, labels[:, 1:].reshape(-1))


def bert() -> nn.Module:
    return _build(
        "BertForSequenceClassification", "BertConfig",
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _classifier_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    batch = _tokens(rows, seed, pad=True)
    g = torch.Generator().manual_seed(seed + 1)
    batch["token_type_ids"] = (torch.rand(rows, SEQ, generator=g) > 0.5).long()
    batch["labels"] = torch.randint(0, 3, (rows,), generator=g)
    return batch


def classifier_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)


def t5() -> nn.Module:
    return _build(
        "T5ForConditionalGeneration", "T5Config",
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


def _seq2seq_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    batch = _tokens(rows, seed, pad=True)
    g = torch.Generator().manual_seed(seed + 2)
    labels = torch.randint(2, VOCAB, (rows, SEQ // 2), generator=g)
    batch["labels"] = labels
    # What T5 makes from labels itself (decoder_start_token_id 0, shifted
    # right), given so that dmodel.loss can call the model without labels.
    batch["decoder_input_ids"] = torch.cat(
        [torch.zeros(rows, 1, dtype=torch.long), labels[:, :-1]], 1
    )
    return batch


def seq2seq_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def resnet() -> nn.Module:
    return _build(
        "ResNetForImageClassification", "ResNetConfig",
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=3,
    )  # fmt: skip


def _image_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(rows, 3, 32, 32, generator=g),
        "labels": torch.randint(0, 3, (rows,), generator=g),
    }


def vit() -> nn.Module:
    return _build(
        "ViTForImageClassification", "ViTConfig",
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def _small_image_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 3, (rows,), generator=g),
    }


FAMILIES: Dict[str, Family] = {
    "gpt2": Family(gpt2, _causal_batch, causal_loss),
    "llama": Family(llama, _causal_batch, causal_loss),
    "mixtral-moe": Family(mixtral, _causal_batch, causal_loss),
    "llama-lora": Family(llama_lora, _causal_batch, causal_loss),
    "bert-classifier": Family(bert, _classifier_batch, classifier_loss),
    "t5": Family(t5, _seq2seq_batch, seq2seq_loss),
    "vit": Family(vit, _small_image_batch, classifier_loss),
    "resnet-batchnorm": Family(resnet, _image_batch, classifier_loss, batch_norm=True),
}


def split_inputs(batch: Dict[str, torch.Tensor]) -> tuple:
    """(model inputs without labels, labels): what dmodel.loss and the Trainer take."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return inputs, batch["labels"]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
