"""After training: in9's `all` run (and optionally the challenge) for the trained model and its starting point,
through the evaluation scripts' own functions, and a report comparing the two."""

from __future__ import annotations

import logging
from pathlib import Path

from tools.challenge import ChallengeConfig
from tools.data.layout import check_data_root
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config
from tools.models.boundary import LoadedModel
from tools.models.sources import load_model
from tools.prepared_run import EvaluationData, Request, check_folders, list_data, prepare
from tools.provenance import START_EVAL_DIR, TRAINED_EVAL_DIR, write_json_atomic, write_text_atomic
from tools.results.html import write_html
from tools.results.markdown import code, escape, markdown_table
from tools.results.report import BG_GAP, before_after, change, percent, points
from tools.runtime import Runtime, resolve_device
from tools.training.config import TrainConfig
from tools.training.loop import TrainResult

log = logging.getLogger(__name__)

REPORT_NAME, HTML_REPORT_NAME = "report.md", "report.html"


def eval_request(config: TrainConfig) -> Request:
    """The evaluation scripts' runs on the test data (--eval-data): in9's `all`, and the challenge if asked."""
    batch, workers = config.eval_batch_size, max(1, config.workers)
    return Request(config.eval_data, In9Config(VARIATIONS, batch, workers, config.progress),
                   ChallengeConfig(batch_size=batch, progress=config.progress) if config.eval_challenge else None,
                   workers, progress=config.progress, allow_inexact_device=config.allow_inexact_device)


def check_eval_data(config: TrainConfig) -> None:
    """Check --eval-data's folders before training, so a run does not end, after hours, on a missing folder."""
    if config.eval_data is not None:
        check_data_root(config.eval_data, "--eval-data")
        check_folders(eval_request(config))


def evaluate(loaded: LoadedModel, config: TrainConfig, runtime: Runtime, out_dir: Path,
             data: EvaluationData | None = None) -> dict:
    """{'in9': payload, 'challenge': payload or None}, also written under out_dir, through the scripts' prepared
    run (so with their start-up device check); `data`: listed already (`list_data(eval_request(config))`)."""
    prepared = prepare(data.request if data is not None else eval_request(config), runtime, lambda: loaded, data)
    in9 = prepared.in9(out_dir).to_json()
    write_json_atomic(out_dir / "in9.json", in9)
    challenge = None
    if config.eval_challenge:
        challenge = prepared.challenge(out_dir).to_json()
        write_json_atomic(out_dir / "challenge.json", challenge)
    else:
        forget_results(out_dir, ("challenge.json",))
    return {"in9": in9, "challenge": challenge}


def forget_results(out_dir: Path, names: tuple[str, ...] = ("in9.json", "challenge.json")) -> None:
    """Remove results an earlier run left under `out_dir` that this run did not make (the report reads it all)."""
    for name in names:
        if (out_dir / name).is_file():
            log.info("removing %s: an earlier run's result that this run did not make", out_dir / name)
            (out_dir / name).unlink()


def render_training_report(config: TrainConfig, result: TrainResult, trained: dict, start: dict | None) -> str:
    rows = []
    for label, before, after in before_after(trained, start):
        if label == BG_GAP:
            rows.append([f"**{label}** (points)", points(before), points(after), change(before, after)])
        else:
            name = f"`{label}`" if label in VARIATIONS else f"**{label}**"
            rows.append([name, percent(before), percent(after), change(before, after)])
    origin = "random initialisation" if result.start.source is None else (
        result.start.source.source or result.start.source.weights or result.start.arch)
    out = ["# Training report", "",
           f"Method {code(config.method_name)} on {code(config.train_variation)} of {escape(config.data_path)} "
           f"({result.data['files']} files, sha256 {result.data['sha256'][:12]}), architecture "
           f"{code(result.start.arch)} from {escape(origin)}; {config.epochs} epoch(s), {result.steps} steps of "
           f"{config.batch_size} images, last loss {result.last_loss:.4f}, {result.images_per_s:.1f} images/s.", "",
           f"Checkpoint: {code(result.checkpoint)}. Test data: {escape(config.eval_data)}.", "",
           "## IN-9 accuracy, starting point against trained model", ""]
    out += markdown_table(["", "Starting point", "Trained", "Change"], rows, "lrrr")
    if start is None:
        out += ["", "The starting point (random weights) was not evaluated."]
    return "\n".join(out) + "\n"


def evaluate_and_report(config: TrainConfig, result: TrainResult) -> Path:
    """Evaluate the saved checkpoint as in9_eval.py loads it, and the starting point; write the reports."""
    runtime = Runtime(resolve_device(config.device))
    out = Path(config.output_dir)
    data = list_data(eval_request(config))  # listed once for both models; the challenge decoded once
    # a UserError (a refused device check, an unreadable image) keeps the checkpoint: the command says so
    trained = evaluate(load_model(checkpoint=result.checkpoint, runtime=runtime), config, runtime,
                       out / TRAINED_EVAL_DIR, data)
    start = None
    if result.start.source is not None:
        try:
            start = evaluate(result.start.source, config, runtime, out / START_EVAL_DIR, data)
        except UserError as exc:
            log.warning("the starting point could not be evaluated: %s", exc)
    if start is None:
        forget_results(out / START_EVAL_DIR)
    path = out / REPORT_NAME
    write_text_atomic(path, render_training_report(config, result, trained, start))
    write_html(out / HTML_REPORT_NAME, training=out, training_results=(trained, start))
    return path
