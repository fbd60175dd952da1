"""peft adapters as people save them, merged into plain weights on load: an adapter folder (`save_pretrained`) on a base
model, and a peft-wrapped model's state dict, whose adapters are rebuilt from the tensors' shapes (LoRA's scaling is not
in such a file: `LoraScaling`; OFT takes the installed peft's defaults, with a warning). Merging is checked on a probe
batch. Needs peft. See docs/how-it-works.md, "Models and checkpoints".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, first_line, option, optional_module
from tools.in9 import IMAGE_SIZE
from tools.models import hub
from tools.models.loading import check_fits, torch_load
from tools.models.record import ModelRecord
from tools.provenance import read_json

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # save_pretrained's names, in peft's priority
# The adapter types an adapter folder may hold (peft's names): those train.py trains and a peft state dict is rebuilt
# as, which change weights and merge into them. The others are refused before peft builds anything: prompt-learning
# adapters add inputs (nothing to merge) and load a tokenizer or a file their config names (with the tokenizer's code
# trusted as the config asks, peft 0.14 to 0.17), and XLoRA, Shadow and their like load the adapters or models their
# config names, from any folder or the Hub.
ADAPTER_TYPES = ("LORA", "OFT")
# Settings of those types that name something for peft to load: LoRA's Megatron layers, for which peft imports the
# module `megatron_core` names (any module, peft 0.14 to 0.19); the toolkit's models have no Megatron layers.
LOADING_SETTINGS = ("megatron_config",)
PEFT_READS_DEPRECATED = "`is_gradient_checkpointing` is deprecated"  # peft <= 0.21 on transformers 5.x
PEFT_PREFIX = "base_model.model."  # what a PeftModel's state dict puts before the wrapped model's keys
MERGE_TOLERANCE = 1e-3  # largest |merged - adapted| logit difference, relative to the logits' scale
# <module>.<adapter parameter>.<adapter name>[.weight]: LoRA's and OFT's (oft_r/oft_s before peft 0.16, oft_R since)
ADAPTER_KEY = re.compile(r"^(?P<module>.+)\.(?P<param>lora_A|lora_B|lora_magnitude_vector|oft_r|oft_s|oft_R)"
                         r"\.(?P<name>[^.]+)(?:\.\w+)?$")
SAVED_MODULE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<name>[^.]+)\.(?P<param>[^.]+)$")
# OFTConfig's settings that change what the adapters compute and that a state dict's tensors do not show
OFT_UNRECORDED_SETTINGS = ("use_cayley_neumann", "num_cayley_neumann_terms", "coft", "eps")


def peft_module(what: str):
    """The peft package, or one error line naming the install command."""
    return optional_module("peft", what, "peft", "peft", called="the peft package")


def is_adapter_folder(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def is_peft_state(state: dict) -> bool:
    """Whether a state dict is a peft-wrapped model's (every key under `base_model.model.`)."""
    return bool(state) and all(k.startswith(PEFT_PREFIX) for k in state)


# ----------------------------------------------------------------------------------------------------------
# Checked merging

@contextlib.contextmanager
def evaluation_mode(model: nn.Module):
    """Every module in evaluation mode inside the block, then each one's own mode back (frozen ones too)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def logits(model: nn.Module, probe: torch.Tensor) -> torch.Tensor:
    with evaluation_mode(model), torch.no_grad():
        return model(probe)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))


def merge_checked(wrapped: nn.Module, probe: torch.Tensor, what: str,
                  place: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """The plain module of a peft model, adapters merged, checked on `probe`; place: puts a module where the adapted one
    sits and returns the model the check runs (default: the module alone)."""
    place = place or (lambda module: module)
    adapted = logits(place(wrapped), probe)
    plain = wrapped.merge_and_unload()
    error = relative_difference(logits(place(plain), probe), adapted)
    if error > MERGE_TOLERANCE:
        raise UserError(f"the merged weights of {what} compute other logits than its adapters ({error:.2g} relative): "
                        f"the installed peft merges these adapters inconsistently (OFT on convolutions larger than "
                        f"1x1 in some versions)")
    return plain


def _probe() -> torch.Tensor:
    return torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------------------------------------
# Adapter folders

@dataclass
class MergedAdapter:
    classifier: nn.Module
    kind: str  # "lora", "oft", ...: peft's type, lower case


def _read_adapter_weights(folder: Path, trust: bool) -> tuple[dict, Path]:
    for name in ADAPTER_WEIGHTS:
        path = folder / name
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file  # noqa: PLC0415 (peft's own dependency)
            try:
                return load_file(str(path), device="cpu"), path
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for a damaged file)
                raise UserError(f"cannot read adapter weights {path}: {first_line(exc)}") from None
        weights = torch_load(path, trust)
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise UserError(f"adapter weights {path} are not a dict of tensors; save the adapter with save_pretrained")
        return weights, path
    raise UserError(f"adapter folder {folder} has {ADAPTER_CONFIG} but no {' or '.join(ADAPTER_WEIGHTS)}; is the "
                    f"folder complete?")


def check_adapter_files(folder: Path) -> None:
    """One line refusing an adapter with files outside its folder (or hub repository) or a config `check_adapter_config`
    refuses, before peft or transformers reads them."""
    for name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS):
        if (folder / name).exists() and not (folder / name).resolve().is_relative_to(hub.files_root(folder)):
            raise UserError(f"{folder / name} links to {(folder / name).resolve()}, a file outside the adapter's "
                            f"folder; the files of an adapter are files of its folder: copy it there")
    check_adapter_config(folder)


def check_adapter_config(folder: Path) -> None:
    """One line refusing an adapter config the toolkit does not merge or that makes peft load what it names; read as
    JSON, before peft reads it."""
    path = folder / ADAPTER_CONFIG
    try:
        config = read_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {first_line(exc)}") from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind not in ADAPTER_TYPES:
        raise UserError(f"{path} describes a {kind!r} adapter; the toolkit merges LoRA and OFT adapters "
                        f"({', '.join(ADAPTER_TYPES)}) into the weights: other types add inputs instead, or have peft "
                        f"load the tokenizers, adapters or models their config names")
    named = [name for name in LOADING_SETTINGS if config.get(name)]
    if named:
        raise UserError(f"{path} sets {', '.join(named)}, for which peft imports the module its megatron_core names "
                        f"({config.get('megatron_core')!r}); the toolkit's models have no Megatron layers: remove it")


def merge_adapter_folder(classifier: nn.Module, folder: Path, trust: bool, record: ModelRecord,
                         place: Callable[[nn.Module], nn.Module] | None = None) -> MergedAdapter:
    """The base classifier with the folder's adapter merged (place: as `merge_checked`'s), recorded in `record`."""
    peft = peft_module(f"the adapter folder {folder}")
    record.library(peft)
    check_adapter_files(folder)
    record.read_file(folder / ADAPTER_CONFIG, "adapter config")
    try:
        config = peft.PeftConfig.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 (a config another peft wrote, or a damaged file)
        raise UserError(f"cannot read {folder / ADAPTER_CONFIG} with the installed peft {peft.__version__}: "
                        f"{first_line(exc)}") from None
    weights, weights_file = _read_adapter_weights(folder, trust)
    record.read_file(weights_file, "adapter weights")
    kind = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    what = f"the {kind} adapter in {folder}"
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated alias of a property: theirs to change
            warnings.filterwarnings("ignore", PEFT_READS_DEPRECATED, FutureWarning)
            wrapped = peft.PeftModel(classifier.eval(), config)
    except Exception as exc:  # noqa: BLE001 (peft's errors for modules it cannot adapt)
        raise UserError(f"{what} does not fit its base model: {first_line(exc)}") from None
    try:
        result = peft.set_peft_model_state_dict(wrapped, weights)
    except RuntimeError as exc:  # shapes that differ
        raise UserError(f"{what} does not fit its base model: {_shape_problem(exc)}") from None
    if result.unexpected_keys:
        raise UserError(f"{what} does not fit its base model: unexpected keys: {_key_list(result.unexpected_keys)}")
    # the adapter's own tensors: with save_embedding_layers' default ("auto") peft would look the recorded base
    # up, on the Hub unless it is a local folder, to see if the vocabulary grew (and warn where it cannot)
    expected = set(peft.get_peft_model_state_dict(wrapped, save_embedding_layers=False))
    missing = sorted(expected - set(weights))
    if missing:
        raise UserError(f"{what} does not fit its base model: missing keys: {_key_list(missing)}")
    merged = merge_checked(wrapped, _probe(), what, place)
    log.info("merged %s (%d tensors from %s)", what, len(weights), weights_file.name)
    return MergedAdapter(merged, kind)


def _shape_problem(exc: Exception) -> str:
    """The first size mismatch torch's load_state_dict names (its message is a paragraph)."""
    found = re.search(r"size mismatch for [^\n]*", str(exc))
    return found.group(0).strip() if found else first_line(exc)


def _key_list(keys, limit: int = 6) -> str:
    keys = list(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


# ----------------------------------------------------------------------------------------------------------
# State dicts of peft-wrapped models

@dataclass
class PeftState:
    """What a peft-wrapped model's state dict shows of its adapters."""

    kind: str  # "lora" or "oft"
    adapter_name: str
    ranks: dict[str, int]  # adapted module -> LoRA rank or OFT block count (the tensors' first dimension)
    saved_modules: list[str]  # modules_to_save (a head trained in full beside the adapters)
    dora: bool
    base: dict  # the state dict of the model before wrapping

    def describe(self) -> str:
        ranks = sorted(set(self.ranks.values()))
        what = "rank" if self.kind == "lora" else "blocks"
        return (f"{'LoRA' if self.kind == 'lora' else 'OFT'} adapters ({what} {'/'.join(map(str, ranks))}) on "
                f"{len(self.ranks)} module(s) ({_key_list(self.ranks, 3)})")


def read_peft_state(state: dict, path: Path) -> PeftState:
    """The adapters of a peft-wrapped model's state dict, and the wrapped model's own state dict."""
    inner = {k[len(PEFT_PREFIX):]: v for k, v in state.items()}
    ranks: dict[str, int] = {}
    kinds, names, saved, base = set(), set(), [], {}
    dora = False
    for key, value in inner.items():
        adapter = ADAPTER_KEY.match(key)
        saved_module = SAVED_MODULE.match(key)
        if adapter:
            param = adapter["param"]
            kinds.add(param.split("_")[0])
            names.add(adapter["name"])
            dora |= param == "lora_magnitude_vector"
            if param in ("lora_A", "oft_r", "oft_R"):
                ranks[adapter["module"]] = int(value.shape[0])
        elif saved_module:
            names.add(saved_module["name"])
            if saved_module["module"] not in saved:
                saved.append(saved_module["module"])
        else:
            base[key.replace(".base_layer.", ".").replace(".original_module.", ".")] = value
    if len(kinds) != 1 or len(names) != 1 or not ranks:
        found = ", ".join(sorted(kinds)) or "none"
        raise UserError(f"checkpoint {path} is the state dict of a peft-wrapped model, with adapters this toolkit "
                        f"cannot rebuild from it (adapter types: {found}; adapter names: "
                        f"{', '.join(sorted(names)) or 'none'}); save the adapter with save_pretrained and pass its "
                        f"folder as {option('--checkpoint')}")
    return PeftState(kinds.pop(), names.pop(), ranks, saved, dora, base)


@dataclass(frozen=True)
class LoraScaling:
    """The LoRA scaling a peft-wrapped state dict lacks: lora_alpha / r, or / sqrt(r) with use_rslora. options: how the
    caller's messages name the two (None where it takes neither)."""

    alpha: float | None = None
    rslora: bool = False
    options: tuple[str, str] | None = ("--lora-alpha ALPHA", "--lora-rslora")

    def given(self) -> list[str]:
        """The options given, by name (for a refusal that says to drop them)."""
        names = [re.split(r"[ =]", option)[0] for option in self.options or ("lora_alpha", "lora_rslora")]
        return [name for name, value in zip(names, (self.alpha is not None, self.rslora)) if value]

    def misplaced(self, where: str) -> UserError:
        """The refusal of options given where no LoRA state dict is (`where` says what there is)."""
        given = self.given()
        return UserError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for the state dict of a "
                         f"peft-wrapped model with LoRA adapters, {where}; drop {' and '.join(given)}")

    def how_to_give(self) -> str:
        """What to pass for a LoRA state dict, or to save instead."""
        saved = ("save the adapter with save_pretrained and pass its folder (adapters trained with an alpha_pattern "
                 "or per-module alphas need that)")
        if self.options is None:
            return f"this command takes neither: {saved}"
        alpha, rslora = self.options
        return f"pass {alpha} as trained (peft's default is 8), and {rslora} if it was trained with rsLoRA " \
               f"(use_rslora=True), or {saved}"


CLI_LORA_OPTIONS = LoraScaling.options  # the evaluation scripts' flags, the default


def anchored(names) -> str:
    """A regex matching exactly these module names (peft matches a list's entries as suffixes)."""
    return "^(?:" + "|".join(map(re.escape, names)) + ")$"


def merge_peft_state(classifier: nn.Module, state: dict, peft_state: PeftState, lora: LoraScaling | None,
                     path: Path, record: ModelRecord) -> nn.Module:
    """The untrained architecture with the state dict's adapters rebuilt, loaded strictly, merged and recorded."""
    peft = peft_module(f"checkpoint {path} (the state dict of a peft-wrapped model)")
    record.library(peft)
    targets = anchored(peft_state.ranks)
    counts = collections.Counter(peft_state.ranks.values())
    rank = counts.most_common(1)[0][0]
    if peft_state.kind == "lora":
        lora = lora or LoraScaling()
        if lora.alpha is None:
            raise UserError(f"checkpoint {path} is the state dict of a peft-wrapped model with "
                            f"{peft_state.describe()}; their scaling (lora_alpha, and whether it is rsLoRA's) is not "
                            f"in the file: {lora.how_to_give()}")
        config = peft.LoraConfig(r=rank, lora_alpha=lora.alpha, use_rslora=lora.rslora, target_modules=targets,
                                 use_dora=peft_state.dora, modules_to_save=peft_state.saved_modules or None,
                                 rank_pattern={anchored([m]): r for m, r in peft_state.ranks.items() if r != rank})
    else:
        if len(counts) > 1:
            raise UserError(f"checkpoint {path} is the state dict of a peft-wrapped model with "
                            f"{peft_state.describe()}, of differing block counts; save the adapter with "
                            f"save_pretrained and pass its folder")
        config = peft.OFTConfig(r=rank, oft_block_size=0, target_modules=targets,
                                modules_to_save=peft_state.saved_modules or None)
        assumed = ", ".join(f"{name}={getattr(config, name)!r}" for name in OFT_UNRECORDED_SETTINGS
                            if hasattr(config, name))
        record.setting("OFT settings assumed", {name: getattr(config, name) for name in OFT_UNRECORDED_SETTINGS
                                                if hasattr(config, name)})
        log.warning("%s: OFT adapters rebuilt with the installed peft %s's settings (%s), which a state dict does not "
                    "record; adapters trained with other settings would compute another model: save them with "
                    "save_pretrained to be sure", path, peft.__version__, assumed)
    what = f"the {peft_state.kind} adapters in {path}"
    try:
        wrapped = peft.get_peft_model(classifier.eval(), config, adapter_name=peft_state.adapter_name)
    except Exception as exc:  # noqa: BLE001 (peft's errors for modules it cannot adapt)
        raise UserError(f"cannot rebuild {what}: {first_line(exc)}") from None
    check_fits(state, wrapped.state_dict(), f"checkpoint {path} does not fit the rebuilt {peft_state.kind} model "
                                            f"(the installed peft is {peft.__version__})")
    wrapped.load_state_dict(state, strict=True)
    log.info("rebuilt and merged %s from %s", peft_state.describe(), path)
    return merge_checked(wrapped, _probe(), what)
