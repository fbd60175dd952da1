"""The training loop: starting model, optimiser and schedule, steps, saves for resuming, the final checkpoint.
Every random choice derives from (seed, epoch, step or index), so a resumed run replays the uninterrupted one."""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tools import distributed
from tools.data.hashing import read_and_fingerprint
from tools.data.pixels import unit_floats
from tools.errors import UserError, key_list
from tools.in9 import NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization, statistics_for
from tools.models.architectures import DEFAULT_ARCH, build_architecture, classifier_keys
from tools.models.boundary import LoadedModel, network_input
from tools.models.sources import fit_named_input, load_model
from tools.progress import ProgressBar, progress_bar
from tools.provenance import TRAINING_LOG, open_own, write_text_atomic
from tools.runtime import Precision, Runtime, check_antialias, resolve_device
from tools.training import adapters
from tools.training.checkpoint import (
    CHECKPOINT_NAME,
    STATE_NAME,
    BackgroundSaver,
    NetworkInput,
    load_resume_state,
    restore_resume_state,
    save_atomic,
    trained_checkpoint,
)
from tools.training.config import RANDOM_INIT, Optimizer, TrainConfig
from tools.training.data import StepSampler, decoded_store, derived_seed, device_batch, list_training_data, make_loader
from tools.training.draws import DRAWS_VERSION
from tools.training.methods import WeightAveraging, batch_mixer

log = logging.getLogger(__name__)

LOG_EVERY = 50  # steps between reads of the logged numbers from the device (each read waits for the device)
# Settings that do not change the weights a run produces, so a resumed run may differ in them.
NOT_IN_RUN_KEY = ("output_dir", "resume", "progress", "workers", "save_every", "eval_data", "eval_challenge",
                  "eval_batch_size", "allow_inexact_device", "device", "dist_timeout")


@dataclass
class StartingPoint:
    """The 9-class network training starts from, how it is built and fed, and the model it came from."""

    classifier: nn.Module  # the network training changes and saves (never a resize in front of it)
    arch: str
    mean: tuple
    std: tuple
    source: LoadedModel | None  # untouched by training (the report's starting point); None for a random initialisation
    fed: NetworkInput = field(default_factory=NetworkInput)  # how the network is built and fed besides its name


@dataclass
class TrainResult:
    checkpoint: Path
    steps: int
    images_per_s: float
    last_loss: float
    start: StartingPoint
    data: dict


def starting_point(config: TrainConfig) -> StartingPoint:
    """The network to fine-tune, without the source's resize in front; a 1000-class one gets a new 9-class head."""
    if config.weights is not None and config.weights.lower() == RANDOM_INIT:
        if config.checkpoint is not None:
            raise UserError("--weights none (random initialisation) and --checkpoint contradict; pass one of them")
        arch = config.arch or DEFAULT_ARCH
        mean, std = statistics_for(Normalization.IN9, NUM_IN9_CLASSES)
        network, size, mode = network_input(fit_named_input(build_architecture(arch, NUM_IN9_CLASSES), arch)[0])
        return StartingPoint(network, arch, mean, std, None, NetworkInput({}, size, mode))
    loaded = load_model(config.arch, config.weights, config.checkpoint, None, Normalization.AUTO,
                        config.trust_checkpoint, config.checkpoint_key, lora_options=None)
    if loaded.arch is None:
        raise UserError(f"{loaded.source} is a {loaded.checkpoint_format} program, which cannot be rebuilt for "
                        f"training; start from its state dict with --arch")
    wrapper = loaded.model
    mean, std = ((wrapper.mean.flatten().tolist(), wrapper.std.flatten().tolist()) if wrapper.normalize
                 else ([0.0] * 3, [1.0] * 3))
    network, size, mode = network_input(wrapper.classifier)
    arch_args = dict(loaded.details.get("arch_args") or {})
    if loaded.num_classes == NUM_IMAGENET_CLASSES:
        head = set(classifier_keys(loaded.arch, arch_args))
        fresh = build_architecture(loaded.arch, NUM_IN9_CLASSES, arch_args)
        body = {k: v for k, v in network.state_dict().items() if k not in head}
        missing, unexpected = fresh.load_state_dict(body, strict=False)
        if set(missing) != head or unexpected:
            raise UserError(f"cannot give {loaded.arch} a new 9-class head: missing {key_list(missing)}; "
                            f"unexpected {key_list(unexpected)}")
        log.info("new 9-class head (%s) on the 1000-class %s", ", ".join(sorted(head)), loaded.arch)
        network = fresh
    else:
        network = copy.deepcopy(network)  # trained in place, so the source stays the starting point
    return StartingPoint(network, loaded.arch, tuple(mean), tuple(std), loaded, NetworkInput(arch_args, size, mode))


def _optimizer(params, config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def warmup_cosine(total_steps: int, warmup_steps: int):
    """The learning-rate factor at a step: linear warm-up to 1, then cosine decay to 0 at the last step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def seed_generators(device: torch.device, seed: int) -> None:
    """Seed the generators a step's draws come from: on the CPU its generator alone (torch.manual_seed also queues
    a seed for each accelerator runtime, about 1 ms a call)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def training_step(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, loss_fn: nn.Module,
                  optimizer: torch.optim.Optimizer, runtime: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward (autocast as the runtime says), loss in fp32, backward, optimiser step; (logits, loss)."""
    with runtime.autocast():
        logits = model(images)
    loss = loss_fn(logits.float(), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return logits, loss


@dataclass
class StepRunner:
    """One training step from a loader batch. It reads nothing back from the device, so the host gathers the next
    batch meanwhile (tests/test_training_loop.py runs it on the meta device, where any such read fails)."""

    model: nn.Module  # what runs the forward: the DDP or compiled wrapper where there is one
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    swa: WeightAveraging | None
    mixer: Callable | None
    loss_fn: nn.Module
    runtime: Runtime
    sampler: StepSampler
    augment: bool

    def __call__(self, batch: dict, step: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step `step` (counted from 0 over the run) of `epoch`; (logits, loss, labels) on the device."""
        device = self.runtime.device
        images, labels = device_batch(batch, device, self.augment)
        images = self.runtime.to_device(images)
        targets = labels
        if self.mixer is not None:
            seed_generators(device, self.sampler.batch_seed(step))  # the batch's draws, as one process makes them
            images, targets = self.mixer(unit_floats(images), labels)
        seed_generators(device, self.sampler.share_seed(step))  # dropout: this process's share's own draws
        logits, loss = training_step(self.model, images, targets, self.loss_fn, self.optimizer, self.runtime)
        if self.swa is not None and self.swa.active(epoch):
            self.swa.step(self.optimizer)
        else:
            self.schedule.step()
        return logits, loss, labels


def _record_step(line: str, unreadable: int) -> int:
    """The step a train_log.jsonl line belongs to; `unreadable` for a blank line or one cut short by a kill."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return unreadable
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if type(step) is int else unreadable


class JsonLog:
    """train_log.jsonl: one JSON object per step or event; on resume, lines past the resumed step are dropped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        kept = []
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if _record_step(line, resume_step + 1) <= resume_step]
        write_text_atomic(path, "".join(line + "\n" for line in kept))

    def write(self, **record) -> None:
        if self.enabled:
            with open_own(self.path, append=True) as fh:  # never through a link placed there
                fh.write((json.dumps(record) + "\n").encode())


class StepLog:
    """The logged numbers of each step, kept on the device (a read waits for it) and read, summed over the
    processes and written every LOG_EVERY steps, before each save and at each epoch's end."""

    def __init__(self, journal: JsonLog, bar: ProgressBar, device: torch.device, started: float):
        self.journal, self.bar, self.device, self.started = journal, bar, device, started
        self.pending: list[tuple[dict, torch.Tensor, int]] = []
        self.images_seen, self.last_loss = 0, float("nan")

    def add(self, logits: torch.Tensor, loss: torch.Tensor, labels: torch.Tensor, **record) -> None:
        """One step's numbers, unread: the share's mean loss and right answers (float32: MPS has no float64; exact
        for a count below 2**24)."""
        numbers = torch.stack([loss.detach().float(), (logits.argmax(1) == labels).sum().float()])
        self.pending.append(({**record, "time_s": time.perf_counter() - self.started}, numbers, labels.shape[0]))

    def flush(self) -> None:
        """Read the pending steps' numbers (one wait for the device, one collective) and write their lines."""
        if not self.pending:
            return
        records, numbers, counts = zip(*self.pending)
        self.pending = []
        counts = np.array(counts, np.float64)
        losses, correct = torch.stack(numbers).cpu().numpy().astype(np.float64).T
        local = np.column_stack([losses * counts, correct, counts])  # the share's loss sum, in float64 as before
        for record, (loss_sum, correct, images) in zip(records, distributed.all_reduce(local, "sum", self.device)):
            self.last_loss, accuracy = loss_sum / images, correct / images
            self.images_seen += int(images)
            rate = self.images_seen / record["time_s"]
            self.journal.write(step=record["step"], epoch=record["epoch"], loss=round(self.last_loss, 6),
                               accuracy=round(accuracy, 6), lr=record["lr"], images=int(images),
                               images_per_s=round(rate, 2), time_s=round(record["time_s"], 4))
        self.bar.set_postfix(loss=f"{self.last_loss:.3f}", acc=f"{100 * accuracy:.1f}%", img_s=f"{rate:.1f}")


def train(config: TrainConfig) -> TrainResult:
    """Train as configured and write checkpoint.pt (rank 0); returns where it is and how the run went."""
    launched = time.perf_counter()
    requested = resolve_device(config.device)
    group = distributed.setup(requested, config.dist_timeout)
    device = group.device(requested)
    if config.augment:
        check_antialias(device, "bilinear", "train.py's random resized crops (--augment)")
    log.info("%s", config.settle(device))  # the batch size and learning rate for this device, before any use
    precision = config.precision_on(device)
    if config.precision is None:
        log.info("precision: %s, the default on %s", precision.value, device)
    runtime = Runtime(device, precision, config.channels_last, config.compile)  # runtime.precision: the one that runs
    data = list_training_data(config)  # the data and what it allows checked before any model is built or downloaded
    if config.batch_size % group.world_size:
        raise UserError(f"--batch-size {config.batch_size} does not split evenly over {group.world_size} processes; "
                        f"pick a multiple of {group.world_size}")
    steps_per_epoch = StepSampler.steps_per_epoch(len(data), config.batch_size)
    if steps_per_epoch == 0:
        raise UserError(f"the training set has {len(data)} images, fewer than --batch-size {config.batch_size}; "
                        f"lower the batch size")
    total_steps = steps_per_epoch * config.epochs
    torch.manual_seed(derived_seed(config.seed, "init"))
    start = starting_point(config)
    fingerprint, _, hashes = read_and_fingerprint(data.root, data.relpaths(), config.workers or 1)
    store = decoded_store(data, fingerprint, config.workers, config.progress and group.is_main, hashes)

    head_keys = classifier_keys(start.arch, start.fed.arch_args)
    if start.fed.interpolation is not None:
        check_antialias(device, start.fed.interpolation, f"{start.arch}, whose {start.fed.input_size[0]}x"
                                                         f"{start.fed.input_size[1]} inputs are resized from 224x224")
    network = adapters.attach(start.classifier, config, head_keys, start.fed.input_size)
    net = adapters.TrainingModel(start.fed.in_front(network), start.mean, start.std)
    net = runtime.prepare(net).train()  # the module saved, averaged and evaluated: never the compiled wrapper
    optimizer = _optimizer([p for p in net.parameters() if p.requires_grad], config)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, round(config.warmup_epochs * steps_per_epoch)))
    swa = WeightAveraging(net, config, steps_per_epoch) if config.swa else None
    model = (nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
             if group.distributed else net)
    model = runtime.compiled(model)  # --compile: the forward (and its backward) only, the loss and step eager

    record = config.to_record()
    # compile off is left out of the key, as states saved before the flag existed have no such key
    run_key = {"config": {k: v for k, v in record.items() if k not in NOT_IN_RUN_KEY and (k != "compile" or v)},
               "data": fingerprint,
               "precision": runtime.precision.value, "draws": DRAWS_VERSION,
               "start": start.source.identity if start.source is not None else None}  # the model's identity
    step = 0
    # the keys of states saved by earlier versions, accepted too: before the key held the starting model's identity,
    # and before it named the precision that ran (one of that version's default precision). Those versions fed every
    # network 224x224 images and built it without its weights' arguments: a network fed otherwise now (a torchvision
    # EfficientNet-B3 at 300, GoogLeNet with its input transform) is not the one their states trained
    earlier_keys = []
    if start.fed == NetworkInput():
        earlier_keys.append({k: v for k, v in run_key.items() if k != "start"})
        earlier_default = config.precision or (Precision.BF16 if device.type == "cuda" else Precision.FP32)
        if earlier_default is runtime.precision:
            earlier_keys.append({k: v for k, v in run_key.items() if k not in ("start", "precision")})
    saved = load_resume_state(config.output_dir, run_key, earlier_keys) if config.resume else None
    if saved is not None:
        step = restore_resume_state(saved, config.output_dir, net, optimizer, schedule, swa, total_steps)
        log.info("resuming at step %d of %d", step, total_steps)
    journal = JsonLog(config.output_dir / TRAINING_LOG, group.is_main, step if saved is not None else None)

    saver = BackgroundSaver()  # the resume state: copied to the CPU at the save, written and synced by a thread

    def save_state() -> None:
        steps_log.flush()  # the log reaches the saved step, so a resumed run's log has no gap
        if group.is_main:
            saver.save({"run_key": run_key, "step": step, "model": net.state_dict(),
                         "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                         "swa": swa.state_dict() if swa is not None else None}, config.output_dir / STATE_NAME)

    bar = progress_bar(total=total_steps, initial=step, unit="step", desc="training", dynamic_ncols=True,
                       disable=not (config.progress and group.is_main))
    started = time.perf_counter()
    log.info("start-up: %.1f s (model, content hashes, decoded store); rates below are from here on",
             started - launched)
    steps_log = StepLog(journal, bar, device, started)
    # one loader for the run (and SWA's pass over one more epoch): its workers start once and prefetch across epochs
    first_epoch = step // steps_per_epoch
    sampler = StepSampler(len(data), config.batch_size, config.seed, first_epoch, step - first_epoch * steps_per_epoch,
                          group.rank, group.world_size, config.epochs + (swa is not None))
    batches = iter(make_loader(data, config, sampler, runtime.pin(), store))
    run_step = StepRunner(model, optimizer, schedule, swa, batch_mixer(config),
                          nn.CrossEntropyLoss(label_smoothing=config.label_smoothing), runtime, sampler, config.augment)
    with bar, saver:  # leaving it waits for the last write (and raises its error)
        for epoch in range(first_epoch, config.epochs):
            for batch in islice(batches, steps_per_epoch - (step - epoch * steps_per_epoch)):
                lr = optimizer.param_groups[0]["lr"]  # the rate this step uses: the schedule steps after it
                logits, loss, labels = run_step(batch, step, epoch)
                step += 1
                steps_log.add(logits, loss, labels, step=step, epoch=epoch, lr=lr)
                bar.update(1)
                if step % config.save_every == 0 and step % steps_per_epoch:
                    save_state()
                elif step % LOG_EVERY == 0:
                    steps_log.flush()
            if swa is not None and swa.active(epoch):
                swa.averaged.update_parameters(net)
            save_state()
            # save_state read the epoch's logged numbers, so its steps are done on the device by now
            journal.write(step=step, event="epoch_end", epoch=epoch, time_s=round(time.perf_counter() - started, 4))

    final = net
    if swa is not None:
        final = swa.finish((runtime.to_device(device_batch(b, device, config.augment)[0]) for b in batches), device)
    classifier = adapters.merged(network_input(final.classifier)[0], config, start.fed.input_size)
    path = config.output_dir / CHECKPOINT_NAME
    if group.is_main:
        save_atomic(trained_checkpoint(classifier, start.arch, start.mean, start.std, config.method_name,
                                       {"path": str(data.root), "train_variation": config.train_variation,
                                        **fingerprint}, record, runtime.precision, start.fed), path)
        log.info("wrote %s (%s, %d steps)", path, config.method_name, step)
    group.barrier()
    rate = steps_log.images_seen / max(1e-9, time.perf_counter() - started)
    return TrainResult(path, step, rate, steps_log.last_loss, start, fingerprint)
