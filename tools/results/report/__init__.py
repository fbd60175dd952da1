"""A Markdown report of the results files (its command, `python -m tools.results.report`, adds the HTML page). Any
subset of the inputs works (a section whose results are absent says "Not run.")."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from tools import __version__
from tools.in9 import VARIATIONS, class_names
from tools.provenance import write_text_atomic
from tools.results.analysis import FIGURE_FILE
from tools.results.categories import CATEGORY_TITLES, Category
from tools.results.leaderboard import Row, published_rows, used_release
from tools.results.markdown import code, destination, escape, markdown_table

NOT_RUN = "Not run."
DEFAULT_OUTPUT = Path("report.md")
CRITERIA = {
    "any": "a foreground is vulnerable when some background makes the prediction wrong",
    "bg-class": "a foreground is vulnerable when some background of another class makes the model predict "
                "that background's class",
}
BARS = "▁▂▃▄▅▆▇█"

# Provenance rows: (label, key); keys not listed here follow under their own names.
PROVENANCE_ROWS = [
    ("Toolkit version", "toolkit_version"), ("torch", "torch"), ("torchvision", "torchvision"), ("Python", "python"),
    ("Device", "device"), ("Precision", "precision"), ("Channels last", "channels_last"), ("Compiled", "compile"),
    ("Architecture", "arch"), ("Weights", "weights"), ("Checkpoint", "checkpoint"),
    ("Checkpoint format", "checkpoint_format"), ("Model identity", "identity"), ("Classes", "num_classes"),
    ("Normalisation", "normalization"), ("Model record", "model_record"), ("Data fingerprint", "data"),
]


# ----------------------------------------------------------------------------------------------------------
# Formatting helpers

def percent(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}%"


def fraction_percent(value, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}%"


def sparkline(counts: list[int]) -> str:
    """One character per bin, its height scaled to the largest count; empty bins are dots."""
    top = max(counts, default=0)
    if top == 0:
        return "·" * len(counts)
    return "".join("·" if n == 0 else BARS[math.ceil(n / top * len(BARS)) - 1] for n in counts)


# ----------------------------------------------------------------------------------------------------------
# Sections

def in9_section(in9: dict | None) -> list[str]:
    out = ["## IN-9 accuracy", ""]
    if not in9:
        return out + [NOT_RUN, ""]
    rows = []
    for name in VARIATIONS:
        result = in9.get(name)
        if result is None:
            rows.append([f"`{name}`", "not run", ""])
        else:
            rows.append([f"`{name}`", percent(result["accuracy"]), escape(f"{result['correct']} / {result['total']}")])
    out += markdown_table(["Variation", "Accuracy", "Correct / total"], rows, "lrr") + [""]
    gap = in9.get("bg_gap")
    if gap is None:
        out.append("**BG-gap** (accuracy on `mixed_same` − `mixed_rand`): not run (needs both variations).")
    else:
        out.append(f"**BG-gap** (accuracy on `mixed_same` − `mixed_rand`): **{gap:.2f} points**.")
    out.append("")
    published = published_beside(in9)
    if published:
        out += [PUBLISHED_INTRO, ""]
        out += markdown_table(PUBLISHED_HEADER, [published_cells(row) for row in published], "lrrrrrl") + [""]
    return out


PUBLISHED_INTRO = "The run used the release's test set (450 images per class), so the published results compare:"
PUBLISHED_HEADER = ["Model (published)", "original", "mixed_same", "mixed_rand", "BG-gap", "Challenge", "Source"]


def published_beside(in9: dict) -> list[Row]:
    """The published rows to show beside an IN-9 run's numbers: all of them where it used the release, else none."""
    return published_rows() if used_release(in9) else []


def published_cells(row: Row) -> list[str]:
    numbers = [row.original, row.mixed_same, row.mixed_rand, row.bg_gap, row.challenge_accuracy]
    return [row.model, *("–" if v is None else f"{v:.2f}" for v in numbers), row.reference or "–"]


def challenge_section(challenge: dict | None) -> list[str]:
    out = ["## Backgrounds Challenge", ""]
    if not challenge:
        return out + [NOT_RUN, ""]
    out.append(f"**Challenge accuracy: {challenge['challenge_accuracy']:.2f}%.** {vulnerable_sentence(challenge)}")
    out.append("")
    rows = [[escape(name), escape(entry["vulnerable"]), escape(entry["total"]),
             percent(class_challenge_accuracy(entry))] for name, entry in challenge.get("per_class", {}).items()]
    if rows:
        out += markdown_table(CHALLENGE_HEADER, rows, "lrrr") + [""]
    cost = cost_sentence(challenge)
    return out + (["Cost: " + cost, ""] if cost else [])


CHALLENGE_HEADER = ["Class", "Vulnerable", "Foregrounds", "Challenge accuracy"]


def vulnerable_sentence(challenge: dict, markdown: bool = True) -> str:
    """How many foregrounds are vulnerable and what that means, as Markdown or plain text."""
    criterion = challenge.get("criterion", "any")
    text, name = (escape, code) if markdown else (str, str)
    return (f"{text(challenge['vulnerable'])} of {text(challenge['total'])} foregrounds "
            f"({challenge['vulnerable_percent']:.2f}%) are vulnerable under the {name(criterion)} criterion: "
            f"{CRITERIA.get(criterion, 'as the challenge run defined it')}.")


def class_challenge_accuracy(entry: dict) -> float | None:
    """A class's challenge accuracy in percent: its foregrounds that no background fools; None without any."""
    total = entry["total"]
    return 100.0 * (total - entry["vulnerable"]) / total if total else None


def cost_sentence(challenge: dict) -> str | None:
    facts = []
    if challenge.get("composites_evaluated") is not None:
        facts.append(f"{challenge['composites_evaluated']:,} composites evaluated")
    if challenge.get("wall_time_s") is not None:
        facts.append(f"in {challenge['wall_time_s']:.1f} s")
    if challenge.get("composites_per_s") is not None:
        facts.append(f"({challenge['composites_per_s']:,.0f} composites/s)")
    return " ".join(facts) + "." if facts else None


def analysis_section(analysis: dict | None, report_dir: Path) -> list[str]:
    out = ["## Adversarial backgrounds", ""]
    if not analysis:
        return out + [NOT_RUN, ""]
    out.append(ASR_DEFINITION_MARKDOWN + f" Over {escape(analysis['foregrounds'])} foregrounds × "
               f"{escape(analysis['backgrounds'])} backgrounds.")
    out.append("")
    rows = []
    for name, info in analysis["per_class"].items():
        tops = ", ".join(f"{code(e['stem'])} {fraction_percent(e['asr'])}" for e in info["top_backgrounds"])
        rows.append([escape(name), fraction_percent(info["fool_rate"]), escape(info["backgrounds"]),
                     fraction_percent(info["mean_asr"]),
                     fraction_percent(info["max_asr"]), f"`{sparkline(info['asr_histogram'])}`", tops or "–"])
    out += markdown_table(["Class", "Fool rate", "Backgrounds", "Mean ASR", "Max ASR", "ASR histogram (0 → 100%)",
                   f"Top-{escape(analysis['top_k'])} backgrounds (ASR)"], rows, "lrrrrll") + [""]
    rate = analysis.get("fooled_into_bg_class_rate")
    if rate is not None:
        out += [f"{escape(analysis['fooled_into_bg_class'])} of {escape(analysis['foregrounds'])} foregrounds "
                f"({fraction_percent(rate, 2)}) are turned into another class by some background of that class.", ""]
    figure = FIGURE_FILE  # the analysis's own file name, whatever its summary says
    if analysis.get("output_dir"):
        figure = Path(os.path.relpath(Path(analysis["output_dir"]) / figure, report_dir)).as_posix()
    out += [f"![Top-{escape(analysis['top_k'])} backgrounds per class]({destination(figure)})", ""]
    return out


ASR_DEFINITION_MARKDOWN = ("The **ASR** (attack success rate) of a background of class *c* is the share of the "
                           "other classes' foregrounds that the model predicts as *c* when pasted on it. The **fool "
                           "rate** of *c* is the share of the other classes' foregrounds that at least one background "
                           "of *c* turns into *c*.")
ASR_DEFINITION = ASR_DEFINITION_MARKDOWN.replace("*", "")  # as plain text, for the HTML report


def before_after(trained: dict, start: dict | None) -> list[tuple[str, float | None, float | None]]:
    """A training run's comparison rows (label, starting point, trained); `start` None: not evaluated."""
    def in9_value(results: dict | None, key: str):
        entry = (results or {}).get("in9", {}).get(key)
        return entry["accuracy"] if isinstance(entry, dict) else entry

    rows = [(name, in9_value(start, name), in9_value(trained, name)) for name in VARIATIONS]
    rows.append((BG_GAP, in9_value(start, "bg_gap"), in9_value(trained, "bg_gap")))
    if trained.get("challenge") is not None:
        rows.append((CHALLENGE_ACCURACY, ((start or {}).get("challenge") or {}).get("challenge_accuracy"),
                     trained["challenge"]["challenge_accuracy"]))
    return rows


BG_GAP, CHALLENGE_ACCURACY = "BG-gap", "Challenge accuracy"  # before_after's rows after the variations


def points(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def change(before: float | None, after: float | None) -> str:
    return "–" if before is None or after is None else f"{after - before:+.2f}"


def categories_section(categories: dict | None) -> list[str]:
    out = ["## Prediction categories", ""]
    if not categories:
        return out + [NOT_RUN, ""]
    v = categories["variations"]
    out.append(f"Each image by how its prediction depends on the background (the paper's Table 3): full image "
               f"{code(v['full'])}, foreground on a random background {code(v['foreground'])}, background alone "
               f"{code(v['background'])}. Percent of the class's images (count).")
    out.append("")
    rows = []
    named = [("**all**", categories["overall"]), *((escape(n), e) for n, e in categories["per_class"].items())]
    for name, entry in named:
        cells = [f"{percent(entry['percent'][cat.value], 1)} ({escape(entry['counts'][cat.value])})"
                 for cat in Category]
        rows.append([name, escape(entry["images"]), *cells])
    out += markdown_table(["Class", "Images", *(CATEGORY_TITLES[cat] for cat in Category)], rows, "lrrrrrr") + [""]
    return out


def _provenance_value(key: str, value, markdown: bool = True) -> str:
    """A provenance value as Markdown (hashes and structures as code), or as plain text (`markdown` False)."""
    text, literal = (escape, code) if markdown else (str, str)
    if value is None:
        return "–"
    if key == "data" and isinstance(value, dict):
        return f"{text(value.get('files', '?'))} files, SHA-256 {literal(value.get('sha256', '?'))}"
    if key in ("identity", "sha256"):
        return literal(value)
    if isinstance(value, (dict, list)):
        return literal(json.dumps(value, sort_keys=True))
    return text(value)


def provenance_table(sources: list[tuple[str, dict]],
                     markdown: bool = True) -> tuple[list[str], list[list[str]]] | None:
    """The provenance table's header and rows (a column per distinct provenance); None when none is recorded."""
    groups: list[tuple[list[str], dict]] = []  # identical provenance from several results shares a column
    for label, prov in sources:
        if not prov:
            continue
        for labels, seen in groups:
            if seen == prov:
                labels.append(label)
                break
        else:
            groups.append(([label], prov))
    if not groups:
        return None
    keys = [(label, key) for label, key in PROVENANCE_ROWS if any(key in prov for _, prov in groups)]
    known = {key for _, key in PROVENANCE_ROWS}
    extra = sorted({key for _, prov in groups for key in prov} - known)
    label_text = escape if markdown else str
    rows = [[label_text(label), *(_provenance_value(key, prov.get(key), markdown) for _, prov in groups)]
            for label, key in keys + [(key, key) for key in extra]]
    return ["", *(", ".join(labels) for labels, _ in groups)], rows


def provenance_section(sources: list[tuple[str, dict]]) -> list[str]:
    out = ["## Provenance", ""]
    found = provenance_table(sources)
    if found is None:
        return out + ["No provenance recorded.", ""]
    header, rows = found
    return out + markdown_table(header, rows, "l" * len(header)) + [""]


def provenance_sources(in9: dict | None, challenge: dict | None, analysis: dict | None,
                       categories: dict | None) -> list[tuple[str, dict]]:
    return [("IN-9 evaluation", (in9 or {}).get("provenance")), ("challenge", (challenge or {}).get("provenance")),
            ("analysis", (analysis or {}).get("provenance")), ("categories", (categories or {}).get("provenance"))]


def render_report(in9: dict | None = None, challenge: dict | None = None, analysis: dict | None = None,
                  categories: dict | None = None, report_dir: Path | str = ".", warnings: Sequence[str] = ()) -> str:
    """The report as Markdown text; `report_dir`: where it will live (for the figure's relative link)."""
    names = ", ".join(class_names())
    out = ["# Backgrounds Challenge report", "",
           f"Written by bg-challenge-toolkit {__version__} from its results files. IN-9 classes: {names}.", ""]
    out += [line for warning in warnings for line in (f"**Warning: {escape(warning)}.**", "")]
    out += in9_section(in9)
    out += challenge_section(challenge)
    out += analysis_section(analysis, Path(report_dir))
    out += categories_section(categories)
    out += provenance_section(provenance_sources(in9, challenge, analysis, categories))
    return "\n".join(out).rstrip() + "\n"


def write_report(path: Path | str, in9: dict | None = None, challenge: dict | None = None,
                 analysis: dict | None = None, categories: dict | None = None, warnings: Sequence[str] = ()) -> str:
    path = Path(path)
    text = render_report(in9, challenge, analysis, categories, report_dir=path.parent, warnings=warnings)
    write_text_atomic(path, text)
    return text

