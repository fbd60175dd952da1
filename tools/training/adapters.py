"""Which weights train (all, the head alone, or peft LoRA/OFT adapters plus the head) and the model being trained,
whose frozen modules run as at evaluation. Adapters are merged before saving, checked to compute the same."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn

from tools.errors import UserError
from tools.in9 import IMAGE_SIZE
from tools.models.adapters import MERGE_TOLERANCE, logits, peft_module, relative_difference
from tools.models.boundary import PixelModel
from tools.training.config import Adapter, Freeze, TrainConfig

log = logging.getLogger(__name__)

ADAPTABLE = (nn.Conv2d, nn.Linear)


def frozen_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that hold parameters, none of which trains (parameterless ones belong to their parent)."""
    return [module for module in model.modules()
            if (params := list(module.parameters())) and not any(p.requires_grad for p in params)]


class TrainingModel(PixelModel):
    """The PixelModel being trained; its frozen modules stay in eval mode whatever `train()` is called on (DDP,
    AveragedModel), so a frozen part computes exactly what it did before."""

    def train(self, mode: bool = True):
        super().train(mode)
        for module in frozen_modules(self.classifier):
            module.eval()
        return self


def match_modules(model: nn.Module, patterns: list[str], head: list[str]) -> list[str]:
    """Names of the Conv2d/Linear modules matching the glob patterns; an unmatched pattern is an error."""
    names = {name: module for name, module in model.named_modules() if name}
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            adaptable = [n for n, m in names.items() if isinstance(m, ADAPTABLE)]
            raise UserError(f"--peft-modules {pattern!r} matches no module of the model; its convolution and linear "
                            f"modules are named like {', '.join(adaptable[:6])}")
        wrong = [n for n in hits if not isinstance(names[n], ADAPTABLE)]
        if wrong:
            raise UserError(f"--peft-modules {pattern!r} matches {wrong[0]}, a {type(names[wrong[0]]).__name__}; "
                            f"adapters go on Conv2d and Linear modules (e.g. {pattern}.conv2 or a narrower pattern)")
        chosen += [n for n in hits if n not in chosen]
    clash = [n for n in chosen if n in head]
    if clash:
        raise UserError(f"--peft-modules matches the classification head {clash[0]}, which trains fully anyway; "
                        f"narrow the pattern")
    return chosen


def attach(model: nn.Module, config: TrainConfig, head_keys: list[str],
           input_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)) -> nn.Module:
    """The model to train: with a frozen backbone, wrapped with adapters, or as it is."""
    head = sorted({key.rsplit(".", 1)[0] for key in head_keys})  # the modules that own the head's parameters
    if config.freeze is Freeze.BACKBONE:
        for name, param in model.named_parameters():
            param.requires_grad_(name in head_keys)
        log.info("linear probe: training %s alone", ", ".join(head))
        return model
    if config.peft is None:
        return model
    peft = peft_module("--peft")
    targets = match_modules(model, config.peft_modules, head)
    if config.peft is Adapter.LORA:
        adapter_config = peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_rank, target_modules=targets)
    else:
        for name in targets:
            module = model.get_submodule(name)
            if isinstance(module, nn.Conv2d) and module.kernel_size[0] != module.kernel_size[1]:
                # peft (0.14 to 0.21) sizes the rotation as in_channels x k0 x k0 and fails in the forward pass
                raise UserError(f"--peft oft cannot adapt {name}, a {module.kernel_size[0]}x{module.kernel_size[1]} "
                                f"convolution (peft's OFT takes square kernels); leave it out of --peft-modules")
            width = module.in_features if isinstance(module, nn.Linear) else (
                module.in_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups)
            if width % config.oft_block_size:
                raise UserError(f"--oft-block-size {config.oft_block_size} does not divide the input size {width} of "
                                f"{name}; pick a divisor of it")
        # r=0 said explicitly: peft takes either a block count r or a block size, and before 0.16 it defaults r to 8
        adapter_config = peft.OFTConfig(r=0, oft_block_size=config.oft_block_size, target_modules=targets)
    probe = _probe(config.seed, next(model.parameters()).device, input_size)
    before = logits(model, probe)
    wrapped = peft.get_peft_model(model, adapter_config)
    _check_close(logits(wrapped, probe), before, f"at initialisation the {config.peft.value} adapters change the "
                                                  f"model's logits, though they start as the identity")
    for name, param in model.named_parameters():
        if name in head_keys:
            param.requires_grad_(True)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    log.info("%s adapters on %d module(s) (%s); %d trainable parameters with the head", config.peft.value,
             len(targets), ", ".join(targets[:4]) + (" ..." if len(targets) > 4 else ""), trainable)
    return wrapped


def _probe(seed: int, device: torch.device, input_size: tuple[int, int]) -> torch.Tensor:
    """Two images of the network's input size (a ViT takes no other)."""
    return torch.randn(2, 3, *input_size, generator=torch.Generator().manual_seed(seed)).to(device)


def _check_close(got: torch.Tensor, expected: torch.Tensor, problem: str) -> None:
    error = relative_difference(got, expected)
    if error > MERGE_TOLERANCE:
        raise UserError(f"{problem} ({error:.2g} relative): the installed peft computes OFT on convolutions larger "
                        f"than 1x1 inconsistently with its merged weights; adapt 1x1 convolutions or linear modules, "
                        f"or use --peft lora")


def merged(model: nn.Module, config: TrainConfig, input_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)) -> nn.Module:
    """The plain classifier to save: adapters merged into their modules (checked on a probe batch)."""
    if config.peft is None:
        return model
    probe = _probe(config.seed, next(model.parameters()).device, input_size)
    adapted = logits(model, probe)
    plain = model.merge_and_unload()
    _check_close(logits(plain, probe), adapted, f"the merged {config.peft.value} weights compute other logits than "
                                                 f"the adapted model")
    return plain
