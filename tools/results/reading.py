"""Reading results files back for the report: their kind, checked complete, and whether they belong together."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.provenance import read_json
from tools.results.analysis import SUMMARY_FILE
from tools.results.categories import Category

log = logging.getLogger(__name__)

# What each kind of results file must hold for its section: nested keys, EACH for every entry of a dict or list.
EACH = "*"
_COUNTS = {cat.value: None for cat in Category}
_CATEGORY_ENTRY = {"images": None, "counts": _COUNTS, "percent": _COUNTS}
VARIATION_ENTRY = {"accuracy": None, "correct": None, "total": None}


@dataclass(frozen=True)
class Kind:
    """A kind of results file: what it is called, what writes it, how to pass it, and what it must hold."""

    name: str  # as in "IN-9 file X does not exist"
    title: str  # as in "X holds IN-9 results"
    writer: str  # what writes it
    flag: str | None  # the report's flag for it
    advice: str  # what to pass instead
    required: dict


KINDS = {
    "in9": Kind("IN-9", "IN-9 results", "in9_eval.py --results-file", "--in9",
                "pass the --results-file of in9_eval.py", {"bg_gap": None, "provenance": None}),
    "challenge": Kind("challenge", "challenge results", "challenge_eval.py --results-file", "--challenge",
                      "pass the --results-file of challenge_eval.py",
                      {"challenge_accuracy": None, "vulnerable": None, "total": None, "vulnerable_percent": None,
                       "provenance": None, "per_class": {EACH: {"vulnerable": None, "total": None}}}),
    "analysis": Kind("analysis", "an analysis", "python -m tools.results.analysis", "--analysis-dir",
                     "pass the folder tools.results.analysis wrote to",
                     {"foregrounds": None, "backgrounds": None, "top_k": None,
                      "per_class": {EACH: {"fool_rate": None, "backgrounds": None, "mean_asr": None,
                                           "max_asr": None, "asr_histogram": None,
                                           "top_backgrounds": {EACH: {"stem": None, "asr": None, "index": None,
                                                                       "image": None}}}}}),
    "categories": Kind("prediction categories", "prediction categories", "in9_eval.py --categories",
                       "--categories", "pass the categories of in9_eval.py --categories",
                       {"variations": {"full": None, "foreground": None, "background": None},
                        "overall": _CATEGORY_ENTRY, "per_class": {EACH: _CATEGORY_ENTRY}}),
    "zoo": Kind("zoo", "a zoo model's results", "python -m tools.zoo", None,
                "pass its in9 and challenge entries as separate files", {}),
    "shard": Kind("shard", "one shard's results", "--shard I/N", None,
                  "merge the shards first (python -m tools.merge)", {}),
}


def results_kind(payload) -> str | None:
    """Which kind of results file a JSON payload is (a key of KINDS), None if none."""
    if not isinstance(payload, dict):
        return None
    if "shard" in payload and "key" in payload:
        return "shard"
    if {"model", "in9", "challenge"} <= payload.keys():
        return "zoo"
    if "challenge_accuracy" in payload:
        return "challenge"
    if {"top_k", "per_class"} <= payload.keys():
        return "analysis"
    if {"variations", "overall"} <= payload.keys():
        return "categories"
    if "bg_gap" in payload or any(isinstance(payload.get(name), dict) for name in VARIATIONS):
        return "in9"
    return None


def first_missing(value, required: dict, where: tuple[str, ...] = ()) -> str | None:
    """The dotted path of the first key `required` names that `value` lacks, None when it has them all."""
    for key, inner in required.items():
        if key == EACH:
            entries = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            found = [first_missing(v, inner, (*where, str(k))) for k, v in entries]
        elif not isinstance(value, dict) or key not in value:
            return ".".join((*where, key))
        else:
            found = [first_missing(value[key], inner or {}, (*where, key))]
        missing = next((m for m in found if m is not None), None)
        if missing is not None:
            return missing
    return None


def read_results(path: Path, kind: str, advice: str | None = None) -> dict:
    """A results file of `kind`, checked to be of that kind and to hold what its section needs."""
    expected = KINDS[kind]
    advice = advice or expected.advice
    try:
        payload = read_json(path)
    except FileNotFoundError:
        raise UserError(f"{expected.name} file {path} does not exist; {advice}") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {expected.name} file {path}: {exc}") from None
    found = results_kind(payload)
    if found is None:
        raise UserError(f"{path} is not {expected.title} (nor any results file of the toolkit); {advice}")
    if found != kind:
        other = KINDS[found]
        redirect = f"pass it as {other.flag}" if other.flag else other.advice
        raise UserError(f"{path} holds {other.title} ({other.writer}), not {expected.title}; {redirect}")
    missing = first_missing(payload, expected.required)
    if missing is None and kind == "in9":
        missing = next((m for name in VARIATIONS if name in payload
                        for m in [first_missing(payload[name], VARIATION_ENTRY, (name,))] if m), None)
    if missing is not None:
        raise UserError(f"{path} is incomplete: it has no {missing}; {advice}")
    return payload


def read_results_payload(payload: dict, path: Path, kind: str) -> dict:
    """An entry of a results file (the categories inside in9_eval's), checked as `read_results` checks a file."""
    missing = first_missing(payload, KINDS[kind].required)
    if missing is not None:
        raise UserError(f"{path} is incomplete: its {kind} have no {missing}; {KINDS[kind].advice}")
    return payload


def load_inputs(in9: Path | None = None, challenge: Path | None = None, analysis_dir: Path | None = None,
                categories: Path | None = None, allow_none: bool = False) -> dict:
    """The results files named on the command line as write_report's keyword arguments."""
    if not any((in9, challenge, analysis_dir, categories)) and not allow_none:
        raise UserError("nothing to report: pass at least one of --in9, --challenge, --analysis-dir, --categories")
    inputs: dict = {"in9": None, "challenge": None, "analysis": None, "categories": None}
    if in9 is not None:
        inputs["in9"] = read_results(in9, "in9")
        if inputs["in9"].get("categories") is not None:
            inputs["categories"] = read_results_payload(inputs["in9"]["categories"], in9, "categories")
    if challenge is not None:
        inputs["challenge"] = read_results(challenge, "challenge")
    if analysis_dir is not None:
        inputs["analysis"] = read_results(Path(analysis_dir) / SUMMARY_FILE, "analysis",
                                          f"run `python -m tools.results.analysis {analysis_dir}` first")
        inputs["analysis"]["output_dir"] = str(Path(analysis_dir).resolve())  # where the figure is now
    if categories is not None:
        inputs["categories"] = read_results(categories, "categories")
    return inputs


# ----------------------------------------------------------------------------------------------------------
# Do the inputs belong together?

LABELS = {"in9": "the IN-9 results", "challenge": "the challenge results", "analysis": "the analysis",
          "categories": "the prediction categories"}
# what identifies the model evaluated: its identity (the digest of its record, `tools.models.record`), and the
# checkpoint hash results files written before it hold
MODEL_KEYS = ("arch", "weights", "identity", "sha256", "num_classes", "normalization")


def _data_difference(a: dict, b: dict) -> list[str] | None:
    """The folders whose content differs between two data fingerprints; None when they cannot be compared."""
    if a.get("sha256") is not None and a.get("sha256") == b.get("sha256"):
        return []
    folders_a, folders_b = a.get("folders") or {}, b.get("folders") or {}
    shared = sorted(folders_a.keys() & folders_b.keys())
    if not shared:
        return None
    return [f"{name}/" for name in shared if folders_a[name] != folders_b[name]]


def mixing_problems(inputs: dict) -> list[str]:
    """Why the inputs do not belong together (other models, other data); pairs that cannot be compared are logged."""
    provenances = [(name, (inputs.get(name) or {}).get("provenance")) for name in LABELS]
    provenances = [(name, prov) for name, prov in provenances if prov]
    problems = []
    for (name_a, a), (name_b, b) in itertools.combinations(provenances, 2):
        pair = f"{LABELS[name_a]} and {LABELS[name_b]}"
        model = [f"{key} {a[key]} and {b[key]}" for key in MODEL_KEYS if key in a and key in b and a[key] != b[key]]
        if model:
            problems.append(f"{pair} come from different models ({'; '.join(model)})")
        data = _data_difference(a.get("data") or {}, b.get("data") or {})
        if data is None:
            log.warning("cannot check that %s come from the same data: they share no folder fingerprint", pair)
        elif data:
            problems.append(f"{pair} come from different data ({', '.join(data)} differ)")
    return problems


def check_inputs_belong_together(inputs: dict, allow_mixed: bool) -> list[str]:
    """Why the inputs do not belong together, as warnings for the report's top (without `allow_mixed`: an error)."""
    problems = mixing_problems(inputs)
    if problems and not allow_mixed:
        raise UserError(f"{'; '.join(problems)}; pass the results of one model on one data set, or add "
                        f"--allow-mixed to report them together under a warning")
    return problems
