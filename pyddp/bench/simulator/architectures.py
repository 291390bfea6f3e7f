"""Model presets for `pyddp-bench simulate`, built on the meta device (no
memory, no downloads): what a training step of the real architecture runs.

- CNNs, written here with torchvision's module structure, parameter names and
  registration order (torchvision itself does not install beside the CPU torch
  wheel): resnet50/101/152, vgg16, inception_v3 (with its auxiliary head, as
  torchvision trains it). tests/test_simulate.py checks their parameter counts
  against torchvision's published ones.
- Transformers from `transformers` configs (no weights): bert-base, bert-large
  (BertForPreTraining: masked LM + next sentence), gpt2, gpt2-medium,
  gpt2-large, gpt2-xl (GPT2LMHeadModel). Eager attention, so each op is seen.

Each preset gives the model, an example batch and the loss a training step
takes its gradient of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Preset:
    build: Callable[[], nn.Module]
    # per-device batch -> (forward args, loss of the output)
    example: Callable[[int], Tuple[Tuple[Any, ...], Callable[[Any], torch.Tensor]]]
    batch: int  # default per-device batch
    optimizer: str  # what a step of this model usually runs: "sgd" or "adamw"
    about: str


# -- torchvision-style CNNs ------------------------------------------------


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4)
            )
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet with Bottleneck blocks (v1.5: the
    stride on the 3x3 convolution)."""

    def __init__(self, layers: List[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(64, layers[0], 1)
        self.layer2 = self._layer(128, layers[1], 2)
        self.layer3 = self._layer(256, layers[2], 2)
        self.layer4 = self._layer(512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        down = stride != 1 or self.inplanes != planes * 4
        mods = [_Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        mods += [_Bottleneck(self.inplanes, planes, 1, False) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG(nn.Module):
    """torchvision.models.vgg16 (configuration D, no batch norm)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        cfg = [64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0]
        layers: List[nn.Module] = []
        cin = 3
        for c in cfg:
            if c == 0:
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(inplace=True)]
                cin = c
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class _Conv(nn.Module):  # torchvision's BasicConv2d
    def __init__(self, cin: int, cout: int, kernel: Any, stride: int = 1, padding: Any = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class _Branches(nn.Module):
    """An Inception block: named branches (each a chain of convolutions, after
    an optional pool) whose outputs are concatenated."""

    def __init__(self, branches: Dict[str, List[Tuple[int, int, Any, int, Any]]], pools: Dict):
        super().__init__()
        self.chains = {
            k: [f"{k}_{i + 1}" if len(v) > 1 else k for i in range(len(v))]
            for k, v in branches.items()
        }
        self.pools = pools
        for key, convs in branches.items():
            for name, spec in zip(self.chains[key], convs):
                self.add_module(name, _Conv(*spec))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for key, names in self.chains.items():
            y = self.pools[key](x) if key in self.pools else x
            for name in names:
                y = getattr(self, name)(y)
            outs.append(y)
        return torch.cat(outs, 1)


def _avg3(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, 1, 1)


def _max3(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(x, 3, 2)


def _inception_a(cin: int, pool: int) -> nn.Module:
    return _Branches(
        {
            "branch1x1": [(cin, 64, 1, 1, 0)],
            "branch5x5": [(cin, 48, 1, 1, 0), (48, 64, 5, 1, 2)],
            "branch3x3dbl": [(cin, 64, 1, 1, 0), (64, 96, 3, 1, 1), (96, 96, 3, 1, 1)],
            "branch_pool": [(cin, pool, 1, 1, 0)],
        },
        {"branch_pool": _avg3},
    )


def _inception_c(c7: int) -> nn.Module:
    a, b = (1, 7), (7, 1)
    pa, pb = (0, 3), (3, 0)
    return _Branches(
        {
            "branch1x1": [(768, 192, 1, 1, 0)],
            "branch7x7": [(768, c7, 1, 1, 0), (c7, c7, a, 1, pa), (c7, 192, b, 1, pb)],
            "branch7x7dbl": [
                (768, c7, 1, 1, 0),
                (c7, c7, b, 1, pb),
                (c7, c7, a, 1, pa),
                (c7, c7, b, 1, pb),
                (c7, 192, a, 1, pa),
            ],
            "branch_pool": [(768, 192, 1, 1, 0)],
        },
        {"branch_pool": _avg3},
    )


class _InceptionE(nn.Module):
    """Mixed_7b/7c: two branches split in two after their stem."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch1x1 = _Conv(cin, 320, 1)
        self.branch3x3_1 = _Conv(cin, 384, 1)
        self.branch3x3_2a = _Conv(384, 384, (1, 3), 1, (0, 1))
        self.branch3x3_2b = _Conv(384, 384, (3, 1), 1, (1, 0))
        self.branch3x3dbl_1 = _Conv(cin, 448, 1)
        self.branch3x3dbl_2 = _Conv(448, 384, 3, 1, 1)
        self.branch3x3dbl_3a = _Conv(384, 384, (1, 3), 1, (0, 1))
        self.branch3x3dbl_3b = _Conv(384, 384, (3, 1), 1, (1, 0))
        self.branch_pool = _Conv(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        return torch.cat(
            [
                self.branch1x1(x),
                self.branch3x3_2a(s),
                self.branch3x3_2b(s),
                self.branch3x3dbl_3a(d),
                self.branch3x3dbl_3b(d),
                self.branch_pool(_avg3(x)),
            ],
            1,
        )


class InceptionV3(nn.Module):
    """torchvision.models.inception_v3 (aux_logits=True, 299x299 input): the
    same convolutions and heads, so the same 27.2M parameters."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.Conv2d_1a_3x3 = _Conv(3, 32, 3, 2)
        self.Conv2d_2a_3x3 = _Conv(32, 32, 3)
        self.Conv2d_2b_3x3 = _Conv(32, 64, 3, 1, 1)
        self.Conv2d_3b_1x1 = _Conv(64, 80, 1)
        self.Conv2d_4a_3x3 = _Conv(80, 192, 3)
        self.Mixed_5b = _inception_a(192, 32)
        self.Mixed_5c = _inception_a(256, 64)
        self.Mixed_5d = _inception_a(288, 64)
        self.Mixed_6a = _Branches(
            {
                "branch3x3": [(288, 384, 3, 2, 0)],
                "branch3x3dbl": [(288, 64, 1, 1, 0), (64, 96, 3, 1, 1), (96, 96, 3, 2, 0)],
                "branch_pool": [],
            },
            {"branch_pool": _max3},
        )
        self.Mixed_6b = _inception_c(128)
        self.Mixed_6c = _inception_c(160)
        self.Mixed_6d = _inception_c(160)
        self.Mixed_6e = _inception_c(192)
        self.AuxLogits = nn.ModuleDict(
            {
                "conv0": _Conv(768, 128, 1),
                "conv1": _Conv(128, 768, 5),
                "fc": nn.Linear(768, num_classes),
            }
        )
        self.Mixed_7a = _Branches(
            {
                "branch3x3": [(768, 192, 1, 1, 0), (192, 320, 3, 2, 0)],
                "branch7x7x3": [
                    (768, 192, 1, 1, 0),
                    (192, 192, (1, 7), 1, (0, 3)),
                    (192, 192, (7, 1), 1, (3, 0)),
                    (192, 192, 3, 2, 0),
                ],
                "branch_pool": [],
            },
            {"branch_pool": _max3},
        )
        self.Mixed_7b = _InceptionE(1280)
        self.Mixed_7c = _InceptionE(2048)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(F.max_pool2d(x, 3, 2)))
        x = F.max_pool2d(x, 3, 2)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e"):
            x = getattr(self, f"Mixed_{name}")(x)
        aux = F.adaptive_avg_pool2d(
            self.AuxLogits["conv1"](self.AuxLogits["conv0"](F.avg_pool2d(x, 5, 3))), 1
        )
        aux = self.AuxLogits["fc"](torch.flatten(aux, 1))
        x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
        x = self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))
        return x, aux


Example = Tuple[Tuple[Any, ...], Callable[[Any], torch.Tensor]]


def _images(size: int) -> Callable[[int], Example]:
    def make(batch: int) -> Example:
        labels = torch.zeros(batch, dtype=torch.long, device="meta")

        def loss(out: Any) -> torch.Tensor:
            if isinstance(out, tuple):  # inception: main + 0.4 x auxiliary, its training recipe
                return F.cross_entropy(out[0], labels) + 0.4 * F.cross_entropy(out[1], labels)
            return F.cross_entropy(out, labels)

        return (torch.empty(batch, 3, size, size, device="meta"),), loss

    return make


# -- transformers ----------------------------------------------------------


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "the bert-* and gpt2* presets build their models from transformers configs: "
            "pip install 'pyddp-engine[bench]' (from a clone: '.[bench]'), or transformers"
        ) from None
    return transformers


def _bert(hidden: int, layers: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _transformers()
        config = tf.BertConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            attn_implementation="eager",
        )
        return tf.BertForPreTraining(config)

    return build


def _gpt2(width: int, layers: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf = _transformers()
        config = tf.GPT2Config(
            n_embd=width, n_layer=layers, n_head=heads, attn_implementation="eager"
        )
        model = tf.GPT2LMHeadModel(config)
        model.loss_type = (
            "ForCausalLM"  # what transformers falls back to, said up front: no warning
        )
        return model

    return build


def _tokens(seq: int) -> Callable[[int], Example]:
    return lambda batch: (
        (torch.zeros(batch, seq, dtype=torch.long, device="meta"),),
        lambda out: out.loss,
    )


class _WithLabels(nn.Module):
    """Calls a transformers model with labels (the tokens themselves), so its
    output carries the training loss; parameters keep their names under
    `model.`."""

    def __init__(self, model: nn.Module, bert: bool):
        super().__init__()
        self.model = model
        self.bert = bert

    def forward(self, ids: torch.Tensor) -> Any:
        if self.bert:
            return self.model(input_ids=ids, labels=ids, next_sentence_label=ids[:, 0])
        return self.model(input_ids=ids, labels=ids)


def _labelled(build: Callable[[], nn.Module], bert: bool) -> Callable[[], nn.Module]:
    return lambda: _WithLabels(build(), bert)


def _bert_preset(hidden: int, layers: int, heads: int, name: str) -> Preset:
    return Preset(
        _labelled(_bert(hidden, layers, heads), True),
        _tokens(128),
        32,
        "adamw",
        f"{name} pre-training (MLM + NSP), sequence 128",
    )


def _gpt2_preset(width: int, layers: int, heads: int, batch: int, name: str) -> Preset:
    return Preset(
        _labelled(_gpt2(width, layers, heads), False),
        _tokens(1024),
        batch,
        "adamw",
        f"{name}, sequence 1024",
    )


PRESETS: Dict[str, Preset] = {
    "resnet50": Preset(
        lambda: ResNet([3, 4, 6, 3]), _images(224), 32, "sgd", "ResNet-50 v1.5, 224x224"
    ),
    "resnet101": Preset(
        lambda: ResNet([3, 4, 23, 3]), _images(224), 32, "sgd", "ResNet-101, 224x224"
    ),
    "resnet152": Preset(
        lambda: ResNet([3, 8, 36, 3]), _images(224), 32, "sgd", "ResNet-152, 224x224"
    ),
    "vgg16": Preset(VGG, _images(224), 32, "sgd", "VGG-16, 224x224"),
    "inception_v3": Preset(
        InceptionV3, _images(299), 32, "sgd", "Inception V3 with aux head, 299x299"
    ),
    "bert-base": _bert_preset(768, 12, 12, "BERT-base"),
    "bert-large": _bert_preset(1024, 24, 16, "BERT-large"),
    "gpt2": _gpt2_preset(768, 12, 12, 8, "GPT-2 124M language modelling"),
    "gpt2-medium": _gpt2_preset(1024, 24, 16, 8, "GPT-2 355M"),
    "gpt2-large": _gpt2_preset(1280, 36, 20, 4, "GPT-2 774M"),
    "gpt2-xl": _gpt2_preset(1600, 48, 25, 2, "GPT-2 1.5B"),
}
