"""The real-model matrix: transformers families users train most (decoder LMs,
an encoder classifier, an encoder-decoder, a vision model with BatchNorm),
small and random-init with their default configs (tests/real_models.py),
through `dmodel(**batch)`, `dmodel.loss` and the Trainer on 2 CPU replicas,
each equal to single-device training; plus gradient checkpointing and
torch.compile. Across processes: tests/test_real_models_processes.py (the
multiprocess tier).

Tolerance: float32 with reassociation (per-shard means weighted and summed
instead of one mean, replicas' gradients summed), accumulated over two SGD
steps through 2-layer models: the differences measured here are at most
6e-8 on parameters of size ~0.1, so 1e-5 absolute leaves room while a wrong
weighting (a factor 2 in a gradient moves parameters by ~1e-2) still fails."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from real_models import FAMILIES, Family, causal_loss, max_param_diff, split_inputs
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import pyddp

pytestmark = pytest.mark.models

ATOL = 1e-5
ROWS, STEPS = 7, 2  # 7 rows: uneven shards (4 + 3) on two replicas
SGD = dict(lr=0.1, momentum=0.9)


def batches(family: Family) -> List[Dict[str, torch.Tensor]]:
    return [family.batch(ROWS, seed) for seed in range(STEPS)]


def per_shard_batch_norm_loss(model: nn.Module, batch: Dict[str, torch.Tensor], n: int):
    """One device doing what data parallelism without SyncBatchNorm does:
    BatchNorm statistics from each shard, the shard-size-weighted mean loss,
    and replica 0's running statistics kept (torch DDP's broadcast_buffers)."""
    sizes = pyddp.replicas.tree.shard_sizes(ROWS, n)
    params = dict(model.named_parameters())
    start = {k: v.clone() for k, v in model.named_buffers()}
    total, kept = 0.0, None
    offset = 0
    for size in sizes:
        shard = {k: v[offset : offset + size] for k, v in batch.items()}
        offset += size
        buffers = {k: v.clone() for k, v in start.items()}
        out = functional_call(model, {**params, **buffers}, (), shard)
        total = total + out.loss * (size / ROWS)
        kept = kept if kept is not None else buffers
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(kept[k])
    return total


def reference(family: Family, path: str, n: int = 2) -> nn.Module:
    model = family.build()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    for batch in batches(family):
        if family.batch_norm:
            loss = per_shard_batch_norm_loss(model, batch, n)
        elif path == "loss":
            inputs, labels = split_inputs(batch)
            loss = family.loss(model(**inputs), labels)
        else:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def wrapped_run(family: Family, path: str, build: Callable[[], nn.Module], **wrap: Any):
    with pyddp.wrap(build(), ["cpu", "cpu"], **wrap) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        for batch in batches(family):
            if path == "loss":
                inputs, labels = split_inputs(batch)
                loss = dm.loss(family.loss, inputs, labels)
            else:
                loss = dm(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        for replica in dm.replicas[1:]:
            assert max_param_diff(replica, dm.module) == 0.0  # bitwise identical
        return dm.module


@pytest.mark.parametrize("path", ["call", "loss"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_replicas_equal_one_device(name, path):
    family = FAMILIES[name]
    got = wrapped_run(family, path, family.build)
    want = reference(family, path)
    assert max_param_diff(got, want) < ATOL
    for (key, a), b in zip(got.named_buffers(), want.buffers()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=key)


def test_a_stock_causal_lm_returns_its_cache_joined():
    # The README's idiom on GPT-2's default output: loss, logits and a
    # DynamicCache of the whole batch.
    family = FAMILIES["gpt2"]
    batch = family.batch(ROWS, 0)
    model = family.build()
    want = copy.deepcopy(model)(**batch)
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        out = dm(**batch)
        assert type(out) is type(want) and type(out.past_key_values) is type(want.past_key_values)
        torch.testing.assert_close(out.logits, want.logits, atol=ATOL, rtol=0)
        for got, ref in zip(out.past_key_values.layers, want.past_key_values.layers):
            torch.testing.assert_close(got.keys, ref.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(got.values, ref.values, atol=ATOL, rtol=0)
        assert out.past_key_values.get_seq_length() == want.past_key_values.get_seq_length()
        out.loss.backward()


def test_a_cache_passed_in_is_filled_as_on_one_device():
    # transformers' decoding idiom: the caller's DynamicCache, filled in place
    # by each call. It stayed empty under pyddp (each replica filled its own
    # shard's copy): the next token ran without the prefix, 0.25 off one device.
    transformers = pytest.importorskip("transformers")
    family = FAMILIES["llama"]
    model = family.build()
    ref = copy.deepcopy(model)
    ids = family.batch(ROWS, 0)["input_ids"]
    steps = [ids, ids[:, -1:], ids[:, -2:-1]]
    mine = transformers.DynamicCache(config=model.config)
    want = transformers.DynamicCache(config=model.config)
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm, torch.no_grad():
        for step in steps:
            got, expected = (
                dm(input_ids=step, past_key_values=mine),
                ref(input_ids=step, past_key_values=want),
            )
            torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)
            assert mine.get_seq_length() == want.get_seq_length()
            assert got.past_key_values is mine  # (as on one device: a review)
    assert want.get_seq_length() == ids.shape[1] + 2


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("name", ["llama", "mixtral-moe", "bert-classifier", "t5"])
def test_a_loss_over_num_items_in_batch_equals_one_device(name, replicas):
    # transformers' fix for masked labels: a causal LM sums its loss and
    # divides by num_items_in_batch, the whole batch's count; the weighted
    # mean of the shards' losses was 1/n of one device's (a probe: 2.386
    # against 4.622 on 2 replicas, gradients alike), silently. Each replica
    # is given the count times its share of the rows. Models that take the
    # keyword and ignore it (BERT, T5: **kwargs) return their mean: a review
    # of a first version, which summed the shards' losses, found those and a
    # mixture of experts' auxiliary loss doubled.
    family = FAMILIES[name]
    model = family.build()
    if name == "mixtral-moe":
        model.config.output_router_logits = True  # its auxiliary loss, in the loss too
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    with pyddp.wrap(model, ["cpu"] * replicas) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        for seed in range(STEPS):
            batch = family.batch(ROWS, seed)
            if family.loss is causal_loss:
                batch["labels"][0, 2:] = batch["labels"][3, 5:] = -100  # rows of other lengths
            count = (batch["labels"] != -100).sum()
            for count_as in (count, int(count)):
                got = dm(**batch, num_items_in_batch=count_as)
                want = ref(**batch, num_items_in_batch=count_as)
                if name == "mixtral-moe":  # (per shard: as close as one device, not equal)
                    assert abs(got.aux_loss - want.aux_loss) < 0.01 * want.aux_loss
                    apart = (got.aux_loss - want.aux_loss).detach()
                    got.loss = got.loss - model.config.router_aux_loss_coef * apart
                assert abs(got.loss.item() - want.loss.item()) < ATOL * want.loss.item()
                if name == "mixtral-moe":
                    return  # (a step on per-shard auxiliary losses moves the routers apart)
                for loss, o in ((got.loss, opt), (want.loss, ref_opt)):
                    loss.backward()
                    o.step()
                    o.zero_grad()
    assert max_param_diff(model, ref) < ATOL


def test_a_loss_over_num_items_in_batch_through_dmodel_loss_is_summed():
    # dmodel.loss gives each replica the count whole: the model's loss, summed.
    family = FAMILIES["llama"]
    model = family.build()
    batch = family.batch(ROWS, 0)
    batch["labels"][0, 2:] = -100
    inputs = {**batch, "num_items_in_batch": (batch["labels"] != -100).sum()}
    want = copy.deepcopy(model)(**inputs).loss
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        got = dm.loss(lambda out, labels: out.loss, inputs, batch["labels"], reduction="sum")
    assert abs(got.item() - want.item()) < ATOL * want.item()


def test_hidden_states_and_attentions_in_training():
    # transformers registers its output-capture hooks on the first call
    # asking for them, on each replica (its own forward): pyddp refused every
    # call after the first ("hooks ... changed after wrap"). A loss on the
    # last hidden state and the attentions (eager attention returns them),
    # against one device.
    family = FAMILIES["gpt2"]
    model = family.build()
    model.config._attn_implementation = "eager"
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)

    def loss_of(out):
        return out.loss + out.hidden_states[-1].square().mean() + out.attentions[0].mean()

    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        for step in range(3):
            batch = family.batch(ROWS, step)
            for m, o in ((dm, opt), (ref, ref_opt)):
                loss_of(m(**batch, output_hidden_states=True, output_attentions=True)).backward()
                o.step()
                o.zero_grad()
        assert max_param_diff(model, ref) < ATOL


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if not f.batch_norm])
def test_trainer_on_two_replicas_equals_one(name):
    # The Trainer on one replica is single-device training on the same
    # batches in the same order (BatchNorm per shard is covered above).
    family = FAMILIES[name]
    data = split_inputs({k: torch.cat([b[k] for b in batches(family)]) for k in batches(family)[0]})
    results = []
    for devices in (["cpu"], ["cpu", "cpu"]):
        config = pyddp.TrainConfig(batch_size=ROWS, max_epochs=1, progress=False)
        trainer = pyddp.Trainer(
            family.build(),
            devices,
            optimizer=functools.partial(torch.optim.SGD, **SGD),
            loss_fn=family.loss,
            config=config,
        )
        with trainer:
            trainer.fit(data)
            results.append(trainer.model.module)
    assert max_param_diff(results[0], results[1]) < ATOL


def test_transformers_gradient_checkpointing_with_its_defaults():
    family = FAMILIES["gpt2"]

    def build() -> nn.Module:
        model = family.build()
        model.gradient_checkpointing_enable()  # transformers' own switch, default settings
        return model

    got = wrapped_run(family, "call", build)
    assert max_param_diff(got, reference(family, "call")) < ATOL


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        # An input layer first: reentrant checkpointing gives parameters
        # gradients only through inputs that require one.
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor, checkpointed: bool = True) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant) if checkpointed else block(x)
        return self.head(x)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_checkpoint_in_a_plain_model(use_reentrant):
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(ROWS, 16, generator=g), torch.randint(0, 4, (ROWS,), generator=g))]
    data *= STEPS
    ref = Checkpointed(use_reentrant)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    with pyddp.wrap(Checkpointed(use_reentrant), ["cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        for x, y in data:
            F.cross_entropy(dm(x), y).backward()
            F.cross_entropy(ref(x, checkpointed=False), y).backward()
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        assert max_param_diff(dm.module, ref) < ATOL


@pytest.mark.parametrize("how", ["compile then wrap", "dmodel.compile()"])
def test_torch_compile(how):
    # aot_eager: dynamo and AOTAutograd (the compiled backward that pyddp's
    # hooks must see), without inductor's C++ code generation (minutes here).
    family = FAMILIES["bert-classifier"]

    def build() -> nn.Module:
        model = family.build()
        return torch.compile(model, backend="aot_eager") if how == "compile then wrap" else model

    if how == "compile then wrap":
        got = wrapped_run(family, "call", build)
    else:
        with pyddp.wrap(build(), ["cpu", "cpu"]) as dm:
            dm.compile(backend="aot_eager")
            opt = dm.optimizer(torch.optim.SGD, **SGD)
            for batch in batches(family):
                dm(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
            got = dm.module
    assert max_param_diff(got, reference(family, "call")) < ATOL


def test_lora_reduces_the_adapters_alone_and_leaves_the_base_untouched():
    # peft's LoRA: the base frozen before wrap is no gradient to reduce. The
    # bytes reduced per step are the adapters' (896 of the model's 25,632 values here),
    # the base stays bitwise what it was on every replica, and the result is
    # one device's (test_two_replicas_equal_one_device, "llama-lora").
    family = FAMILIES["llama-lora"]
    model = family.build()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [p for p in model.parameters() if p.requires_grad]
    started = [p.detach().clone() for p in adapters]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert base and adapters and all("lora_" in n for n in trained)
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.AdamW, lr=1e-2)
        for batch in batches(family):
            dm(**batch).loss.backward()
            assert dm.stats()["bytes"] == sum(p.numel() * p.element_size() for p in adapters)
            opt.step()
            opt.zero_grad()
        for replica in dm.replicas:
            named = dict(replica.named_parameters())
            for n, want in base.items():
                assert named[n].grad is None and torch.equal(named[n], want), n
        assert all(not torch.equal(p, q) for p, q in zip(adapters, started))  # they trained


def test_lora_changes_peft_makes_while_wrapped_are_refused_by_name():
    # What peft users do to a model mid-run that replicas cannot follow:
    # merging the adapters into the base (modules replaced), switching to an
    # adapter that was frozen at wrap. Each raises at the next forward naming
    # the change; after close() the merge works on the user's model.
    family = FAMILIES["llama-lora"]
    batch = family.batch(ROWS, 0)
    model = family.build()
    model.add_adapter("second", model.peft_config["default"])  # added frozen
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        dm(**batch).loss.backward()
        model.set_adapter("second")  # "second" trainable now, "default" frozen
        with pytest.raises(RuntimeError, match="was frozen when the model was wrapped"):
            dm(**batch)
    model.set_adapter("default")
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        dm(**batch).loss.backward()
        merged = model.merge_and_unload()
        with pytest.raises(RuntimeError, match="submodule .* of the wrapped model was replaced"):
            dm(**batch)
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def _clip() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return transformers.CLIPModel(
        transformers.CLIPConfig(
            text_config=dict(vocab_size=96, max_position_embeddings=16, **small),
            vision_config=dict(image_size=16, patch_size=4, **small),
            projection_dim=16,
        )
    )


def _clip_batch(rows: int, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, 96, (rows, 10), generator=g),
        "pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
    }


class _Embeddings(nn.Module):
    """CLIP's two towers, each row's normalised embeddings: outputs one row per example."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> tuple:
        text = self.clip.get_text_features(input_ids=input_ids)
        image = self.clip.get_image_features(pixel_values=pixel_values)
        text, image = (getattr(t, "pooler_output", t) for t in (text, image))
        return F.normalize(text, dim=-1), F.normalize(image, dim=-1)


def _contrastive(model: _Embeddings, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    logits = model.clip.logit_scale.exp() * text @ image.t()
    y = torch.arange(len(text))
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


def test_a_contrastive_loss_on_the_gathered_embeddings_equals_one_device():
    # A loss over the whole batch computed inside the model (CLIP's
    # return_loss) is each replica's over its own shard, as under torch DDP:
    # 1.65 against one device's 2.55 here. Returned per row and
    # gathered, the embeddings give the loss over the whole batch (its
    # logit_scale used outside the forward): one device's training.
    model = _clip()
    even = _clip_batch(6, 0)
    with pyddp.wrap(copy.deepcopy(model), ["cpu", "cpu"]) as dm:
        per_shard = dm(**even, return_loss=True).loss.item()
    whole = copy.deepcopy(model)(**even, return_loss=True).loss.item()
    assert abs(per_shard - whole) > 0.1 * whole  # (what the docs say: not one device's)

    model, ref = _Embeddings(model), _Embeddings(copy.deepcopy(model))
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        for seed in range(STEPS):
            batch = _clip_batch(ROWS, seed)  # uneven shards
            for m, o in ((dm, opt), (ref, ref_opt)):
                loss = _contrastive(model if m is dm else ref, *m(**batch))
                loss.backward()
                o.step()
                o.zero_grad()
    assert max_param_diff(model, ref) < ATOL
    assert model.clip.logit_scale.item() != _clip().logit_scale.item()  # (it trained)


def test_generate_on_the_wrapped_model_between_steps():
    # transformers' generate is a method of the model, not of the wrapper
    # (as under torch DDP): dmodel.module.generate between training steps
    # gives one device's tokens, and training goes on as one device's.
    family = FAMILIES["llama"]
    model = family.build()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    prompt = family.batch(2, 9)["input_ids"][:, :4]
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.SGD, **SGD)
        with pytest.raises(AttributeError):
            dm.generate  # noqa: B018 - the wrapper has no generate, as DDP's
        for batch in batches(family):
            for m, o in ((dm, opt), (ref, ref_opt)):
                m(**batch).loss.backward()
                o.step()
                o.zero_grad()
            kept = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
            got = dm.module.generate(prompt, **kept)
            assert torch.equal(got, ref.generate(prompt, **kept))
    assert max_param_diff(model, ref) < ATOL
