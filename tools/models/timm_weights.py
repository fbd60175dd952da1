"""timm models with their pretrained weights (the `timm:NAME[.TAG]` and `timm:hf-hub:ORG/NAME` source).

Weights come through timm's own loading (the Hugging Face cache, or torch's hub cache for a URL; safetensors or
`weights_only`, which timm does from `SAFE_TIMM` on: older timm is refused), data settings from the pretrained config;
other input sizes are resized inside the model. A registered name's config comes from timm's registry (a config.json
beside its weights is not read, nor recorded); a hub name's from the hub's config.json. `--weights none`: seeded random
weights.
"""

from __future__ import annotations

import http.client
import logging
import os
import pickle
import re
import urllib.error
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, error_summary, first_line, option
from tools.in9 import NUM_IMAGENET_CLASSES, Normalization
from tools.models import hub
from tools.models.architectures import check_timm_name, timm_module
from tools.models.boundary import LoadedModel, ModelOrigin, fit_input_size, state_sha256, wrap
from tools.models.record import ModelRecord
from tools.models.spec import TIMM_HUB, TIMM_PREFIX, ModelSpec

log = logging.getLogger(__name__)

RANDOM_WEIGHTS = "none"  # --weights none: random initialisation
RANDOM_SEED = 0
HUB_WEIGHTS_FILES = ["model.safetensors", "pytorch_model.bin"]  # what timm looks for in a hub repository, in order
# The first timm whose every pretrained-weights path (URL, hub file, local file) unpickles with weights_only, given
# torch>=2.6's weights_only default; before it, a URL tag's file went through torch.hub without weights_only.
SAFE_TIMM = (1, 0, 26)


def check_safe_timm(timm, spec: ModelSpec) -> None:
    """One line refusing timm's pretrained weights where that timm may unpickle them unsafely."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", timm.__version__)
    if match is None or tuple(int(part) for part in match.groups()) < SAFE_TIMM:
        floor = ".".join(map(str, SAFE_TIMM))
        raise UserError(f"timm {timm.__version__} may unpickle the pretrained weights of {spec} without "
                        f"weights_only (code in the file would run); pretrained timm weights need timm>={floor}: "
                        f"run `pip install 'timm>={floor}'` ({option('--weights', RANDOM_WEIGHTS)} works with this "
                        f"timm)")


def _random_model(timm, name: str) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_SEED)
        return timm.create_model(name, pretrained=False)


def weights_file(pretrained_cfg: dict) -> Path | None:
    """The file timm read a model's pretrained weights from, in timm's order (`_resolve_pretrained_source`): a hub
    model's cached weights, else a local `file`, else the hub's, else the URL's file in torch's hub cache."""
    if pretrained_cfg.get("file") and pretrained_cfg.get("source") != "hf-hub":
        return Path(pretrained_cfg["file"])
    if pretrained_cfg.get("hf_hub_id"):
        named = pretrained_cfg.get("hf_hub_filename")
        if named and not hub.inside_folder(str(named)):
            raise UserError(f"the config of {pretrained_cfg['hf_hub_id']} names weights {named!r} outside its "
                            f"repository; fix its config.json")
        names = [named.replace(".bin", ".safetensors"), named] if named else []
        found = hub.cached_file(pretrained_cfg["hf_hub_id"], names + HUB_WEIGHTS_FILES)
        if found is not None:
            return found
    if pretrained_cfg.get("url"):
        path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(pretrained_cfg["url"])
        return path if path.is_file() else None
    return None


def _fetch_command(name: str) -> str:
    return f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\""


def _registered_cfg(timm, spec: ModelSpec) -> dict | None:
    """timm's registered pretrained config for the name (its default tag without one); None for a hub name."""
    if spec.name.startswith(TIMM_HUB):
        return None
    cfg = timm.models.get_pretrained_cfg(spec.body)
    return cfg.to_dict() if cfg is not None else {}


# What timm raises when a file is neither cached nor downloadable now (huggingface_hub's LocalEntryNotFoundError is a
# FileNotFoundError, its OfflineModeIsEnabled a ConnectionError; urllib's errors for weights at a URL)
NOT_FETCHED = (FileNotFoundError, ConnectionError, TimeoutError, urllib.error.URLError, http.client.HTTPException)


def _cached_files(spec: ModelSpec, cfg: dict | None) -> Path | None:
    """The cached file timm was reading when it failed; None when nothing is cached."""
    if cfg is not None:
        return weights_file(cfg)
    repo = spec.name[len(TIMM_HUB):]
    return hub.cached_file(repo, HUB_WEIGHTS_FILES) or hub.cached_file(repo, ["config.json"])


def _not_loaded_line(spec: ModelSpec, cfg: dict | None, exc: Exception) -> str:
    """Why timm did not load the weights: an unsafe pickle, a cached file it failed on, or how to fetch them."""
    what, fetch = f"the pretrained weights of {spec}", _fetch_command(spec.body)
    if isinstance(exc, pickle.UnpicklingError):
        return f"cannot load {what} safely: weights_only unpickling refused the file ({first_line(exc)})"
    cached = None if isinstance(exc, NOT_FETCHED) else _cached_files(spec, cfg)
    if cached is not None:
        snapshot = hub.snapshot_revision(cached) is not None
        where, download = (cached.parent, cached.parents[2]) if snapshot else (cached, cached)
        return (f"cannot load {what}: timm failed on the cached files in {where} ({error_summary(exc)}); if they "
                f"are damaged, delete {download} and fetch them again with `{fetch}`")
    if cfg is not None and not cfg.get("hf_hub_id") and cfg.get("url"):
        folder = Path(torch.hub.get_dir()) / "checkpoints"
        return (f"cannot load {what}: not in torch's hub cache {folder} and not downloadable from {cfg['url']} "
                f"({first_line(exc)}); fetch them with the network on (same TORCH_HOME) with `{fetch}`")
    return hub.not_cached_line(what, fetch, first_line(exc))


def hub_config_file(spec: ModelSpec) -> Path:
    """The cached config.json timm builds `timm:hf-hub:ORG/NAME` from (present once the model is built)."""
    path = hub.cached_file(spec.name[len(TIMM_HUB):], ["config.json"])
    if path is None:
        raise RuntimeError(f"timm built {spec}, but its config.json is not in the hub cache {hub.cache_folder()}")
    return path


def tag_data_config(arch: str, record: ModelRecord | None = None, args: dict | None = None,
                    what: str = "") -> dict | None:
    """timm's data config for `timm:NAME[.TAG]` (registry) or `timm:hf-hub:ORG/NAME` (cached config.json), without
    building; None otherwise. args: overrides as timm's train.py resolves them. Recorded in `record`."""
    spec = ModelSpec.parse(arch)
    if spec.prefix != TIMM_PREFIX:
        return None
    timm = timm_module(spec)
    from timm.data import resolve_data_config  # noqa: PLC0415 (an optional extra)
    if spec.name.startswith(TIMM_HUB):  # the hub's config.json, parsed by timm as timm.create_model does
        cfg = _hub_pretrained_cfg(timm, spec)
        if record is not None:
            record.read_file(hub_config_file(spec), "timm hub config.json")
    else:
        registered = timm.models.get_pretrained_cfg(spec.body)
        cfg = None if registered is None else registered.to_dict()
    if cfg is None and not args:
        return None
    try:
        data_cfg = resolve_data_config(dict(args or {}), pretrained_cfg=cfg or {})
    except (AssertionError, TypeError, ValueError) as exc:  # timm asserts the settings' shapes
        raise UserError(f"{what or arch} records data settings timm cannot use ({args}: {first_line(exc) or 'rejected'}"
                        f"); a timm input_size is [channels, height, width]") from None
    return data_cfg if record is None else _record_data_config(data_cfg, timm, record)


def _hub_pretrained_cfg(timm, spec: ModelSpec) -> dict:
    """The pretrained config in a timm hub repository's config.json (from the cache when offline)."""
    try:
        cfg = timm.models.load_model_config_from_hf(spec.name[len(TIMM_HUB):])[0]
    except Exception as exc:  # noqa: BLE001 (huggingface_hub's and timm's errors all mean: no config to read)
        raise UserError(hub.not_cached_line(f"the config of {spec}", _fetch_command(spec.body),
                                            first_line(exc))) from None
    return dict(cfg)


def _record_data_config(data_cfg: dict, timm, record: ModelRecord) -> dict:
    """The data config, recorded with timm's version (which decides it for a registered name)."""
    record.library(timm)
    record.setting("timm data config", {key: list(value) if isinstance(value, tuple) else value
                                        for key, value in sorted(data_cfg.items())})
    return data_cfg


def fit_data_config(model: nn.Module, data_cfg: dict, used_by: str, runtime=None) -> nn.Module:
    """The model behind a resize to the data config's input size, with its interpolation (bilinear, else bicubic)."""
    mode = data_cfg.get("interpolation", "bicubic")
    return fit_input_size(model, data_cfg["input_size"][1:], used_by,
                          mode if mode in ("bilinear", "bicubic") else "bicubic", runtime)


def load_timm(body: str, weights: str | None, in9: bool | None, normalize: Normalization, record: ModelRecord,
              runtime=None) -> LoadedModel:
    """`timm:` + `body` with timm's pretrained weights (`weights` none: seeded random ones), recorded in `record`."""
    spec = ModelSpec.parse(TIMM_PREFIX + body)
    timm = timm_module(spec)
    check_timm_name(timm, spec)
    if in9:
        raise UserError(f"{option('--in9')} needs {option('--checkpoint', 'PATH')}: timm's pretrained weights of "
                        f"{spec} are ImageNet's")
    random_init = weights is not None and weights.lower() == RANDOM_WEIGHTS
    if weights is not None and not random_init:
        raise UserError(f"{option('--weights')} takes only {RANDOM_WEIGHTS} for {spec}: the tag after the name "
                        f"picks timm's pretrained weights ({TIMM_PREFIX}NAME.TAG)")
    cfg = None
    if not random_init:
        check_safe_timm(timm, spec)
        cfg = _registered_cfg(timm, spec)
        if cfg is not None and not any(cfg.get(key) for key in ("hf_hub_id", "url", "file")):
            raise UserError(f"timm has no pretrained weights for {spec}: pick a name or tag with weights "
                            f"(timm.list_pretrained('{spec.name}*')) or pass {option('--weights', RANDOM_WEIGHTS)}")
    try:
        model = _random_model(timm, body) if random_init else timm.create_model(body, pretrained=True)
    except Exception as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(_not_loaded_line(spec, cfg, exc)) from None
    model.eval()
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    if model.num_classes != NUM_IMAGENET_CLASSES:
        raise UserError(f"{spec} has {model.num_classes} classes; the toolkit evaluates 1000-class (ImageNet) timm "
                        f"models: pick an ImageNet-1k tag (timm.list_pretrained('{spec.name}.*'))")
    if spec.name.startswith(TIMM_HUB):  # timm built it from the hub's config.json
        record.read_file(hub_config_file(spec), "timm hub config.json")
    if random_init:
        record.setting("timm random weights seed", RANDOM_SEED)
        record.compute("timm random weights sha256", state_sha256(model))  # drawn by the installed torch
        origin = ModelOrigin(spec.model, RANDOM_WEIGHTS, None, f"timm random init (seed {RANDOM_SEED})")
    else:
        path = weights_file(cfg)
        if path is None:
            raise RuntimeError(f"timm loaded {spec}'s pretrained weights, but from no file this toolkit can find")
        record.setting("timm tag", cfg.get("tag"))  # a hub repository's weights have none: their content says it
        tag = cfg.get("tag") or hub.snapshot_revision(path)
        record.read_file(path, "weights")
        origin = ModelOrigin(spec.model, tag, str(path),
                             f"timm pretrained ({cfg.get('hf_hub_id') or cfg.get('url') or 'file'})")
        log.info("timm %s: pretrained weights %s from %s", spec, tag, path)
    from timm.data import resolve_data_config  # noqa: PLC0415 (an optional extra)
    data_cfg = _record_data_config(resolve_data_config({}, model=model), timm, record)
    classifier = fit_data_config(model, data_cfg, str(spec), runtime)
    return wrap(classifier, num_classes=NUM_IMAGENET_CLASSES, normalize=normalize, origin=origin, record=record,
                stats=(data_cfg["mean"], data_cfg["std"]), stats_origin="timm pretrained config")
