"""The one grammar of model names, `ModelSpec`: what `--arch`, train.py's `--arch` and the zoo's `--models` take.

    [PREFIX]NAME[SEP TAG]      resnet50, timm:convnext_tiny, timm:vit_base_patch16_224.augreg_in21k_ft_in1k,
                               timm:hf-hub:ORG/NAME, toolkit:small_cnn, clip:ViT-B-32/openai, hf:ORG/NAME, hf:PATH
    file:PATH                  a checkpoint file that carries or records its architecture
    ARCH@file:PATH             a checkpoint file of the architecture ARCH (a name of the first form), or a peft
                               adapter folder on ARCH's pretrained weights
    ARCH@file:BASE@file:DIR    the peft adapter folder DIR on ARCH with the weights of the checkpoint BASE

PREFIX picks a source and family (none: torchvision); what it means is the registries' business, so parsing needs
neither. A tag follows its family's separator (timm `.`, open_clip `/`; `hf-hub:` names, which may hold dots, have
none). Only `@file:` separates a checkpoint: an `@` elsewhere belongs to the name (`hf:ORG/NAME@REVISION`), except in
a torchvision name, where it is refused. A name round-trips: `str(ModelSpec.parse(text)) == text`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from tools.errors import UserError

FILE_PREFIX = "file:"
ARCH_SEPARATOR = "@"
TIMM_PREFIX = "timm:"
CLIP_PREFIX = "clip:"
TOOLKIT_PREFIX = "toolkit:"
HF_PREFIX = "hf:"
TIMM_HUB = "hf-hub:"  # after timm:, a Hugging Face Hub repository timm loads, config and weights
TAG_SEPARATORS = {TIMM_PREFIX: ".", CLIP_PREFIX: "/"}  # where a family's tag starts; the others have none
PREFIX = re.compile(r"[A-Za-z][\w-]*:")
ARCH_AT_FILE_HINT = ("ARCH@ must be followed by file:PATH (and may end in @file:ADAPTER_DIR), e.g. "
                     "resnet18@file:model.pt")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model name: the model (prefix, name, tag) and/or the checkpoint file its weights come from."""

    prefix: str = ""  # "" for torchvision
    name: str = ""  # "" for `file:PATH`, whose file carries its architecture
    tag: str | None = None  # after the family's separator ("" when the separator ends the name)
    file: str | None = None  # the checkpoint file (or adapter folder), as written
    adapter: str | None = None  # a peft adapter folder on the checkpoint's weights, as written

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        if not text:
            raise UserError("an empty model name; use e.g. resnet50, timm:NAME, clip:ARCH/PRETRAINED or file:PATH")
        if text.startswith(FILE_PREFIX):
            return cls(file=_file(text, text))
        at_file = ARCH_SEPARATOR + FILE_PREFIX  # only `@file:` ends the model: a hub revision or a path keeps its `@`
        model, separator, rest = text.partition(at_file)
        if separator:
            if not model:
                raise UserError(f"model spec {text!r}: {ARCH_AT_FILE_HINT}")
            base, adapter_separator, adapter = rest.partition(at_file)
            return cls(*_model(model, text), file=_file(FILE_PREFIX + base, text),
                       adapter=_file(FILE_PREFIX + adapter, text) if adapter_separator else None)
        if ARCH_SEPARATOR in text and not PREFIX.match(text):  # torchvision names hold no `@`: a file meant
            raise UserError(f"model spec {text!r}: {ARCH_AT_FILE_HINT}")
        return cls(*_model(text, text))

    @property
    def model(self) -> str | None:
        """The model part, PREFIX NAME [SEP TAG]; None for `file:PATH`."""
        if not self.prefix and not self.name:
            return None
        tag = "" if self.tag is None else f"{TAG_SEPARATORS.get(self.prefix, '')}{self.tag}"
        return f"{self.prefix}{self.name}{tag}"

    @property
    def body(self) -> str:
        """What follows the prefix: what a source is given."""
        return (self.model or "")[len(self.prefix):]

    def __str__(self) -> str:
        if self.file is None:
            return self.model or ""
        at = f"{self.model}{ARCH_SEPARATOR}" if self.model is not None else ""
        adapter = f"{ARCH_SEPARATOR}{FILE_PREFIX}{self.adapter}" if self.adapter is not None else ""
        return f"{at}{FILE_PREFIX}{self.file}{adapter}"

    # The zoo's names for a spec

    @property
    def text(self) -> str:
        return str(self)

    @property
    def source(self) -> str:
        """file, torchvision, or the prefix's word (timm, clip, toolkit, ...)."""
        return "file" if self.file is not None else self.prefix[:-1] or "torchvision"

    @property
    def arch(self) -> str | None:
        return self.model

    @property
    def path(self) -> Path | None:
        return Path(self.file).expanduser() if self.file is not None else None

    @property
    def adapter_path(self) -> Path | None:
        return Path(self.adapter).expanduser() if self.adapter is not None else None

    @property
    def slug(self) -> str:
        """A file name for this model: the spec made safe, and a short hash so that no two specs share one."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.text).strip("_.")[:80]
        return f"{safe}-{hashlib.sha256(self.text.encode()).hexdigest()[:8]}"


def _file(text: str, whole: str) -> str:
    path = text[len(FILE_PREFIX):]
    if not path:
        raise UserError(f"model spec {whole!r} names no file after {FILE_PREFIX}")
    return path


def _model(text: str, whole: str) -> tuple[str, str, str | None]:
    """(prefix, name, tag) of PREFIX NAME [SEP TAG]."""
    match = PREFIX.match(text)
    prefix = match.group() if match else ""
    rest = text[len(prefix):]
    separator = None if prefix == TIMM_PREFIX and rest.startswith(TIMM_HUB) else TAG_SEPARATORS.get(prefix)
    name, found, tag = rest.partition(separator) if separator else (rest, "", "")
    if not name:
        raise UserError(f"model spec {whole!r} names no architecture after {prefix!r}")
    return prefix, name, tag if found else None
