"""What a finished run writes and prints, composed for the commands (both scripts and `tools.merge`); the
evaluation returns its results and knows nothing of this package."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tools.provenance import OutputFiles, resume_hint, write_json_atomic
from tools.results.analysis import DEFAULT_TOP_K, summary_lines, write_analysis
from tools.results.categories import CATEGORY_VARIATIONS, format_categories, prediction_categories
from tools.results.html import write_html
from tools.results.matrix import write_matrix
from tools.results.report import write_report

if TYPE_CHECKING:
    from tools.challenge import ChallengeResult
    from tools.in9.evaluate import In9Run


def publish_in9(run: In9Run, categories: bool = False, results_file: Path | None = None, report: Path | None = None,
                rerun_hint: str | None = None, html: Path | None = None) -> list[str]:
    """Write what in9_eval.py writes; returns the lines to print. A failed file does not stop the other (one user
    error ending in `rerun_hint`)."""
    lines = run.lines()
    payload = run.to_json()
    if categories:
        counts = prediction_categories(*(run.results[v] for v in CATEGORY_VARIATIONS.values()))
        lines.append(format_categories(counts))
        payload["categories"] = counts
    with OutputFiles(rerun_hint or resume_hint(), lines) as outputs:
        if results_file is not None:
            outputs.write(write_json_atomic, results_file, payload)
        if report is not None:
            outputs.write(write_report, report, in9=payload, categories=payload.get("categories"))
        if html is not None:
            outputs.write(write_html, html, in9=payload, categories=payload.get("categories"))
    return lines


def publish_challenge(result: ChallengeResult, output_dir: Path, data_path: Path, num_classes: int,
                      analysis: bool = False, top_k: int = DEFAULT_TOP_K, per_foreground_csv: Path | None = None,
                      results_file: Path | None = None, report: Path | None = None,
                      rerun_hint: str | None = None, html: Path | None = None) -> list[str]:
    """Write what challenge_eval.py writes, the results file first; returns the lines to print. A failed file does
    not stop the others (one user error ending in `rerun_hint`)."""
    lines = result.lines()
    summary = None
    with OutputFiles(rerun_hint or resume_hint(), lines) as outputs:
        if results_file is not None:
            outputs.write(write_json_atomic, results_file, result.to_json())
        if per_foreground_csv is not None:
            outputs.write(result.write_per_foreground_csv, per_foreground_csv)
        if result.state.matrix is not None:
            matrix = outputs.write(write_matrix, output_dir, result, data_path, num_classes)
            if analysis and matrix is not None:
                summary = outputs.write(write_analysis, output_dir, data_path, top_k, matrix)
                if summary is not None:
                    lines += summary_lines(summary)
        if report is not None:
            outputs.write(write_report, report, challenge=result.to_json(), analysis=summary)
        if html is not None:
            outputs.write(write_html, html, challenge=result.to_json(), analysis=summary, data_path=data_path)
    return lines
