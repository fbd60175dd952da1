"""Batch-level methods from torchvision and torch: MixUp/CutMix (transforms.v2) and weight averaging (swa_utils)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.optim import swa_utils

from tools import distributed
from tools.errors import import_torchvision
from tools.in9 import NUM_IN9_CLASSES
from tools.training.adapters import frozen_modules
from tools.training.config import Method, TrainConfig

log = logging.getLogger(__name__)


def batch_mixer(config: TrainConfig):
    """MixUp, CutMix, or one of the two per batch; None when neither is asked for. Takes float images."""
    v2 = import_torchvision("torchvision.transforms.v2")
    mixers = []
    if Method.MIXUP in config.methods:
        mixers.append(v2.MixUp(alpha=config.mixup_alpha, num_classes=NUM_IN9_CLASSES))
    if Method.CUTMIX in config.methods:
        mixers.append(v2.CutMix(alpha=config.cutmix_alpha, num_classes=NUM_IN9_CLASSES))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def running_statistics(model: nn.Module) -> list[torch.Tensor]:
    return [statistic for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats for statistic in (m.running_mean, m.running_var)]


class WeightAveraging:
    """SWA: an AveragedModel updated at each averaged epoch's end; SWALR made at the first averaged step (a
    scheduler sets the learning rate as soon as it exists)."""

    def __init__(self, model: nn.Module, config: TrainConfig, steps_per_epoch: int):
        self.start_epoch = config.swa_start()
        self.averaged = swa_utils.AveragedModel(model)
        self.swa_lr = config.swa_lr if config.swa_lr is not None else config.lr / 2
        self.anneal_steps = max(1, steps_per_epoch // 4)
        self.scheduler: swa_utils.SWALR | None = None

    def active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The learning-rate step of an averaged epoch."""
        if self.scheduler is None:
            self.scheduler = self._new_scheduler(optimizer)
        self.scheduler.step()

    def _new_scheduler(self, optimizer: torch.optim.Optimizer) -> swa_utils.SWALR:
        return swa_utils.SWALR(optimizer, swa_lr=self.swa_lr, anneal_epochs=self.anneal_steps, anneal_strategy="cos")

    def scheduler_made(self, optimizer: torch.optim.Optimizer) -> dict:
        """SWALR's `state_dict` when made on `optimizer`, made on a stand-in so the run's rates stay as they are."""
        stand_in = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": group["lr"],
                                     "initial_lr": group.get("initial_lr", group["lr"])}
                                    for group in optimizer.param_groups])
        return {key: value for key, value in self._new_scheduler(stand_in).state_dict().items() if not callable(value)}

    def state_dict(self) -> dict:
        """Data only, for `torch.load(weights_only=True)` (SWALR in torch releases before September 2025 keeps its
        annealing function in its state)."""
        scheduler = None if self.scheduler is None else {
            key: value for key, value in self.scheduler.state_dict().items() if not callable(value)}
        return {"averaged": self.averaged.state_dict(), "scheduler": scheduler}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        self.averaged.load_state_dict(state["averaged"])
        if state["scheduler"] is not None:
            lrs = [group["lr"] for group in optimizer.param_groups]
            self.scheduler = self._new_scheduler(optimizer)
            self.scheduler.load_state_dict(state["scheduler"])
            for group, lr in zip(optimizer.param_groups, lrs):  # creating it stepped the rate: put it back
                group["lr"] = lr

    def finish(self, loader_batches, device: torch.device) -> nn.Module:
        """The averaged model, its trained BatchNorm statistics recomputed over the training batches (frozen ones
        keep the starting point's); under torchrun averaged over the processes (docs/training.md, `--swa`)."""
        model = self.averaged.module
        frozen = {module for part in frozen_modules(model) for module in part.modules()}
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        kept = [norm for norm in norms if norm in frozen]
        if len(kept) < len(norms):
            log.info("recomputing BatchNorm statistics of the averaged model over the training data")
            for norm in kept:  # update_bn resets the statistics of every BatchNorm that tracks them
                norm.track_running_stats = False
            try:
                swa_utils.update_bn(loader_batches, self.averaged, device=device)
                for statistic in running_statistics(model):  # the recomputed ones: frozen layers track none now
                    statistic.copy_(torch.from_numpy(distributed.all_reduce(statistic.cpu().numpy(), "mean", device)))
            finally:
                for norm in kept:
                    norm.track_running_stats = True
        return model
