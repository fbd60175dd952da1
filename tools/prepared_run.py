"""One prepared run: the order every way into an evaluation follows, decided once. Folders checked before any
model is built; the data listed, hashed and decoded beside the model being built; the start-up device check
before any image is evaluated; then the runs (docs/how-it-works.md, "Follow one run")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.challenge.config import ChallengeConfig
from tools.challenge.data import ChallengeData, ChallengeFiles, list_challenge_files, load_challenge_data
from tools.challenge.result import ChallengeResult
from tools.challenge.run import run_challenge
from tools.data import decoders
from tools.data.check import quick_check
from tools.data.image_sets import ImageSet
from tools.data.store import DecodedCache
from tools.in9 import Variation
from tools.in9.evaluate import In9Config, In9Files, In9Run, list_in9_files, run_in9
from tools.models.boundary import LoadedModel
from tools.models.device_check import CHECK_IMAGES, check_run, first_images
from tools.provenance import decoder as decoder_build
from tools.runtime import Runtime
from tools.shards import Shard
from tools.threads import alongside, default_workers


@dataclass(frozen=True)
class Request:
    """What to evaluate and how: the data folder, the in9 run's and the challenge's settings (None: not run), how
    the data is read."""

    data_path: Path
    in9: In9Config | None = None
    challenge: ChallengeConfig | None = None
    workers: int = field(default_factory=default_workers)
    cache: DecodedCache | None = None
    progress: bool = True
    allow_inexact_device: bool = False

    @property
    def batch_size(self) -> int | None:
        return (self.in9 or self.challenge).batch_size


def check_folders(request: Request) -> None:
    """The fast check of every folder the runs read (`quick_check`), once, before any model is built."""
    variations = list(request.in9.variations) if request.in9 is not None else []
    if request.challenge is not None and Variation.ONLY_BG_T.value not in variations:
        variations.append(Variation.ONLY_BG_T.value)
    quick_check(request.data_path, variations, need_masks=request.challenge is not None)


class EvaluationData:
    """What the runs read, listed and hashed once, decoded when first needed (held for every model with `hold`)."""

    def __init__(self, request: Request, hold: bool = False):
        self.request = request
        self.in9: In9Files | None = None
        if request.in9 is not None:
            self.in9 = list_in9_files(request.data_path, request.in9.variations, request.workers, request.cache, hold)
        self._challenge: ChallengeFiles | ChallengeData | None = None
        if request.challenge is not None:
            self._challenge = list_challenge_files(request.data_path, request.workers, request.cache, hold)
        self._check_images: torch.Tensor | None = None

    def challenge(self) -> ChallengeData:
        """Decoded once: kept here for this run's models, or, listed with `hold`, by the image set itself."""
        if isinstance(self._challenge, ChallengeData):
            return self._challenge
        data = load_challenge_data(self._challenge, self.request.workers, self.request.progress,
                                   self.request.challenge.mask_arithmetic)
        if self._challenge.image_set.held is None:
            self._challenge = data
        return data

    def check_images(self) -> torch.Tensor:
        """The start-up device check's images: the in9 run's first, else the challenge's first backgrounds."""
        if self._check_images is None:
            if self.in9 is not None:
                first = self.in9.listings[self.request.in9.variations[0]]
                self._check_images = first_images(self.in9.image_set.root, [r.relpath for r in first],
                                                  self.request.workers)
            else:
                self._check_images = self.challenge().bg_images[:CHECK_IMAGES]
        return self._check_images

    @property
    def sha256(self) -> dict:
        """The content digest of each run's data."""
        return {name: images.fingerprint["sha256"] for name, images in self._image_sets().items()}

    @property
    def decoders(self) -> dict:
        """Who decodes each run's JPEGs, with which libjpeg."""
        return {name: decoder_build(images.decoder.value) for name, images in self._image_sets().items()}

    def _image_sets(self) -> dict[str, ImageSet]:
        return {name: files.image_set for name, files in (("in9", self.in9), ("challenge", self._challenge))
                if files is not None}

    def decoded(self) -> EvaluationData:
        """Everything decoded now (the runs then start at once)."""
        if self._challenge is not None:
            self.challenge()
        self.check_images()
        return self


def list_data(request: Request, hold: bool = False) -> EvaluationData:
    """The folders checked, then the data listed and hashed (not decoded); `hold`: as `EvaluationData`."""
    check_folders(request)
    return EvaluationData(request, hold)


@dataclass
class PreparedRun:
    """A model ready to run on its data: built, on its device, past its start-up device check."""

    request: Request
    runtime: Runtime
    model: LoadedModel
    data: EvaluationData
    device_check: dict

    def in9(self, output_dir: Path | None = None, resume: bool = False, shard: Shard | None = None) -> In9Run:
        return run_in9(self.model, self.runtime, self.data.in9, self.request.in9, output_dir=output_dir,
                       resume=resume, shard=shard, device_check=self.device_check)

    def challenge(self, output_dir: Path | None = None, resume: bool = False,
                  shard: Shard | None = None) -> ChallengeResult:
        return run_challenge(self.model, self.runtime, self.data.challenge(), self.request.challenge, output_dir,
                             resume, self.request.workers, shard=shard, device_check=self.device_check)


def prepare(request: Request, runtime: Runtime, load_model: Callable[[], LoadedModel],
            data: EvaluationData | None = None) -> PreparedRun:
    """The model built and checked on its device, with its data: `data` as given (the zoo's), else listed and
    decoded in a background thread while the model is built. `data` listed for another request is
    refused: it would run on that one's settings."""
    if data is not None and data.request != request:
        raise ValueError("prepare: the data was listed for another request (list_data(request) with this request)")
    if data is None:
        check_folders(request)
        data, model = alongside(lambda: EvaluationData(request).decoded(), load_model, imports=decoders.LAZY_IMPORTS)
    else:
        model = load_model()
    check = check_run(model, runtime, data.check_images(), request.allow_inexact_device, request.batch_size)
    return PreparedRun(request, runtime, model, data, check)

