"""How a run was made: the settings of a zoo results file's runs that can change a number (`run_settings`), by which
the leaderboard groups and captions its rows, and their one-line text (`settings_text`, `parse_settings`)."""

from __future__ import annotations

import re


def _device(text: str | None) -> str | None:
    """A device as the provenance names it, less its index: `cuda:1 (NVIDIA H200)` is `cuda (NVIDIA H200)`."""
    return None if text is None else re.sub(r"^(\w+):\d+", r"\1", str(text))


def _batch_size(provenance: dict) -> str | None:
    size, lowered = provenance.get("batch_size"), provenance.get("batch_size_lowered_from")
    return None if size is None else f"{size}" + (f" (lowered from {lowered})" if lowered is not None else "")


def _jpeg_decoder(decoder) -> str | None:
    """The libjpeg that decoded the JPEGs (Pillow's, which torchvision's decoder is used only where it equals): another
    gives other pixels for the same file."""
    if not isinstance(decoder, dict) or decoder.get("libjpeg") is None:
        return None
    turbo = decoder.get("libjpeg_turbo")
    return f"libjpeg {decoder['libjpeg']}" + (f" (libjpeg-turbo {turbo})" if turbo else "")


def _text(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# A run's settings that can change a number, by the label a leaderboard shows them under: how to read each from a
# run's provenance (the IN-9 run's and the challenge's alike)
PROVENANCE_SETTINGS = {
    "toolkit": lambda p: p.get("toolkit_version"),  # another version may compute otherwise
    "torch": lambda p: p.get("torch"),  # its build names CUDA's version: other kernels
    # the device model (the CPU's instruction set, the GPU's compute capability: `Runtime.arithmetic`), else as named
    "device": lambda p: (p.get("arithmetic") or {}).get("device") or _device(p.get("device")),
    "CPU threads": lambda p: (p.get("arithmetic") or {}).get("cpu_threads"),  # they split the CPU's sums
    "precision": lambda p: p.get("precision"),
    "compiled": lambda p: p.get("compile"),
    "channels last": lambda p: p.get("channels_last"),
    "batch size": _batch_size,
    "JPEG decoder": lambda p: _jpeg_decoder(p.get("decoder")),
    "inexact device allowed": lambda p: (p.get("device_check") or {}).get("allowed_inexact"),
}


def run_settings(payload: dict) -> dict[str, str]:
    """How a zoo results file's runs were made: each setting that can change a number (`PROVENANCE_SETTINGS` from
    both runs, and the challenge's criterion, mask arithmetic and re-check margin), as text by label; a setting
    the runs differ in names both."""
    in9, challenge = payload.get("in9") or {}, payload.get("challenge") or {}
    runs = {"IN-9": in9.get("provenance") or {}, "challenge": challenge.get("provenance") or {}}
    settings = {}
    for label, read in PROVENANCE_SETTINGS.items():
        values = {run: _text(read(provenance)) for run, provenance in runs.items() if read(provenance) is not None}
        if len(set(values.values())) == 1:
            settings[label] = next(iter(values.values()))
        elif values:
            settings[label] = ", ".join(f"{value} ({run})" for run, value in values.items())
    margin = ((payload.get("identity") or {}).get("settings") or {}).get("recheck_margin")
    for label, value in (("criterion", challenge.get("criterion")), ("mask arithmetic",
                         runs["challenge"].get("mask_arithmetic")), ("re-check margin", margin)):
        if value is not None:
            settings[label] = str(value)
    return settings


def settings_text(settings: dict[str, str]) -> str:
    """`run_settings` as one line, `label: value; ...` ("" when none are recorded)."""
    return "; ".join(f"{label}: {value}" for label, value in settings.items())


def parse_settings(text: str | None) -> dict[str, str]:
    """`settings_text` read back: value by label."""
    return dict(part.split(": ", 1) for part in (text or "").split("; ") if ": " in part)


def differing_settings(all_settings: list[str | None]) -> list[str]:
    """The labels of the settings whose values differ between the groups."""
    parsed = [parse_settings(text) for text in all_settings]
    labels = list(dict.fromkeys(label for settings in parsed for label in settings))
    return [label for label in labels if len({settings.get(label) for settings in parsed}) > 1]
