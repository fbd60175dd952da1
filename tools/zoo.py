"""Many models, one command: the IN-9 `all` run and the challenge for each, one results file each, a leaderboard.

    python -m tools.zoo --data-path bg_challenge --output-dir zoo \\
        --models resnet50,vit_b_16,timm:convnext_tiny,clip:ViT-B-32/openai,file:my.pt,resnet18@file:sd.pt
    python -m tools.zoo --leaderboard-only zoo

Model specs:
- NAME: a torchvision architecture with its pretrained weights (IMAGENET1K_V1 where it has them);
- timm:NAME: a timm architecture (timm installed); clip:ARCH/PRETRAINED: CLIP zero-shot (open_clip_torch);
- file:PATH: a TorchScript or torch.export file, or a checkpoint that records its architecture ("arch");
- ARCH@file:PATH: a checkpoint of architecture ARCH (a torchvision name or timm:NAME), e.g. a plain state dict.

Each model writes OUTPUT/models/<name>.json when both of its runs are done; a model whose file exists
is skipped. Its runs keep their resumable state in OUTPUT/runs/<name>/. A model that fails is reported
in one line and the others go on; the exit code is 0 when all succeeded, 1 when some failed, 2 for bad
input to the command itself.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools import cli, options
from tools.challenge import STATE_NAME, ChallengeConfig, run_challenge
from tools.errors import UserError
from tools.evaluate import run_in9
from tools.in9 import VARIATIONS
from tools.leaderboard import MARKDOWN_FILE, MODELS_FOLDER, build_leaderboard
from tools.models import TIMM_PREFIX, LoadedModel
from tools.sources import CLIP_PREFIX, FILE_PREFIX, load_model
from tools.provenance import check_outputs, write_json_atomic
from tools.runtime import Runtime, default_batch_size

log = logging.getLogger(__name__)

ARCH_SEPARATOR = "@"
RUNS_FOLDER = "runs"
EXIT_SOME_FAILED = 1


# ----------------------------------------------------------------------------------------------------------
# Model specs

@dataclass(frozen=True)
class ModelSpec:
    """One entry of --models: what to load, and the names it goes by."""

    text: str
    source: str  # torchvision, timm, clip or file
    arch: str | None
    path: Path | None = None

    @property
    def slug(self) -> str:
        """A file name for this model: the spec made safe, and a short hash so that no two specs share one."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.text).strip("_.")[:80]
        return f"{safe}-{hashlib.sha256(self.text.encode()).hexdigest()[:8]}"

    def load(self, trust: bool = False) -> LoadedModel:
        return load_model(self.arch, checkpoint=self.path, trust=trust)


def parse_model_spec(text: str) -> ModelSpec:
    text = text.strip()
    if not text:
        raise UserError("an empty model spec; --models takes a comma-separated list such as resnet50,file:my.pt")
    if text.startswith(CLIP_PREFIX):
        return ModelSpec(text, "clip", text)
    arch, separator, rest = text.partition(ARCH_SEPARATOR)
    if separator:
        if not rest.startswith(FILE_PREFIX) or not arch:
            raise UserError(f"model spec {text!r}: ARCH@ must be followed by file:PATH, e.g. resnet18@file:model.pt")
        return ModelSpec(text, "file", arch, Path(rest[len(FILE_PREFIX):]).expanduser())
    if text.startswith(FILE_PREFIX):
        return ModelSpec(text, "file", None, Path(text[len(FILE_PREFIX):]).expanduser())
    if text.startswith(TIMM_PREFIX):
        return ModelSpec(text, "timm", text)
    return ModelSpec(text, "torchvision", text)


def read_models_file(path: Path) -> list[str]:
    """One spec per line; blank lines and `#` comments are ignored."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"cannot read --models-file {path}: {exc.strerror or exc}") from None
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def parse_model_specs(texts: list[str]) -> list[ModelSpec]:
    specs = [parse_model_spec(t) for t in texts]
    seen: set[str] = set()
    duplicates = [s.text for s in specs if s.text in seen or seen.add(s.text)]
    if duplicates:
        raise UserError(f"model(s) listed twice: {', '.join(duplicates)}")
    if not specs:
        raise UserError("no models: pass --models or --models-file")
    return specs


# ----------------------------------------------------------------------------------------------------------
# Running

@dataclass
class ZooSettings:
    """What every model's runs share."""

    data_path: Path
    challenge: ChallengeConfig
    batch_size: int
    workers: int
    cache_dir: Path | None = None
    trust: bool = False

    def fingerprint(self, runtime: Runtime) -> dict:
        """The settings a results file must have been made with to count as done."""
        return {"data_path": str(Path(self.data_path).resolve()), "precision": runtime.precision.value,
                "criterion": self.challenge.criterion.value, "recheck_margin": self.challenge.recheck_margin}


@dataclass
class Outcome:
    model: str
    status: str  # done, skipped or failed
    results_file: Path | None = None
    message: str | None = None
    summary: dict = field(default_factory=dict)


def results_path(output_dir: Path, spec: ModelSpec) -> Path:
    return Path(output_dir) / MODELS_FOLDER / f"{spec.slug}.json"


def _summary(payload: dict) -> dict:
    in9, challenge = payload["in9"], payload["challenge"]
    return {"original": in9["original"]["accuracy"], "bg_gap": in9["bg_gap"],
            "challenge_accuracy": challenge["challenge_accuracy"]}


def _finished(path: Path, settings: dict) -> dict | None:
    """The results file's contents if this model is done with these settings; an error if with others."""
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log.warning("unreadable results file %s: running its model again", path)
        return None
    if payload.get("settings") != settings:
        raise UserError(f"{path} was made with other settings ({payload.get('settings')}); use another --output-dir "
                        f"or delete the file to rerun")
    return payload


def evaluate_model(spec: ModelSpec, settings: ZooSettings, runtime: Runtime, output_dir: Path,
                   progress: bool = True) -> dict:
    """Both runs for one model (each resuming from OUTPUT/runs/<name>/), as the results file's contents."""
    loaded = spec.load(settings.trust)
    state_dir = Path(output_dir) / RUNS_FOLDER / spec.slug
    in9 = run_in9(loaded, runtime, settings.data_path, list(VARIATIONS), settings.batch_size, settings.workers,
                  state_dir, resume=True, progress=progress)
    challenge = run_challenge(loaded, runtime, settings.data_path, settings.challenge, state_dir,
                              (state_dir / STATE_NAME).is_file(), settings.workers, settings.cache_dir)
    weights = loaded.weights or (Path(loaded.source).name if loaded.source else None)
    return {"model": spec.text, "source": spec.source, "arch": loaded.arch, "weights": weights,
            "settings": settings.fingerprint(runtime), "in9": in9.to_json(), "challenge": challenge.to_json()}


def run_zoo(specs: list[ModelSpec], settings: ZooSettings, runtime: Runtime, output_dir: Path,
            progress: bool = True) -> list[Outcome]:
    """Every model in turn; done ones are skipped, a failing one is logged in one line and the rest go on."""
    outcomes = []
    fingerprint = settings.fingerprint(runtime)
    for index, spec in enumerate(specs, 1):
        path = results_path(output_dir, spec)
        log.info("[%d/%d] %s", index, len(specs), spec.text)
        try:
            payload = _finished(path, fingerprint)
            if payload is not None:
                log.info("%s is done already (%s): skipped", spec.text, path)
                outcomes.append(Outcome(spec.text, "skipped", path, summary=_summary(payload)))
                continue
            payload = evaluate_model(spec, settings, runtime, output_dir, progress)
            if runtime.group.is_main:  # under torchrun the processes share each model's runs; rank 0 writes
                write_json_atomic(path, payload)
            outcomes.append(Outcome(spec.text, "done", path, summary=_summary(payload)))
        except UserError as exc:
            log.error("%s: %s", spec.text, exc)
            outcomes.append(Outcome(spec.text, "failed", message=str(exc)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 (one model's crash must not lose the others' runs)
            log.exception("%s failed unexpectedly", spec.text)
            outcomes.append(Outcome(spec.text, "failed", message=f"{type(exc).__name__}: {exc}"))
        finally:
            gc.collect()
            if runtime.device.type == "cuda":
                torch.cuda.empty_cache()
    return outcomes


# ----------------------------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.zoo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_argument_group("models")
    models.add_argument("--models", default=None, metavar="SPEC[,SPEC...]",
                        help="comma-separated model specs (see above) (default: none)")
    models.add_argument("--models-file", type=Path, default=None, metavar="PATH",
                        help="a file with one model spec per line, # comments allowed (default: none)")
    options.add_trust_argument(models)
    options.add_data_arguments(parser)
    options.add_running_arguments(parser, shard=False)
    options.add_search_arguments(parser.add_argument_group("challenge"))
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("zoo_results"), metavar="DIR",
                     help=f"per-model results ({MODELS_FOLDER}/), resumable run state ({RUNS_FOLDER}/) and the "
                          f"leaderboard files (default: zoo_results)")
    out.add_argument("--leaderboard-only", type=Path, default=None, metavar="DIR",
                     help="run nothing: rebuild the leaderboard of the zoo output folder DIR (default: off)")
    out.add_argument("--no-leaderboard", action="store_true",
                     help="skip the leaderboard rebuild after the runs, e.g. in SLURM array tasks (default: off)")
    out.add_argument("--no-published", action="store_true",
                     help="leave the published reference rows out of the leaderboard (default: included)")
    cli.add_log_level_argument(out)
    return parser


def specs_from_args(args: argparse.Namespace) -> list[ModelSpec]:
    texts = [t for t in (args.models or "").split(",") if t.strip()]
    if args.models_file is not None:
        texts += read_models_file(args.models_file)
    return parse_model_specs(texts)


def _outcome_line(outcome: Outcome) -> str:
    if outcome.status == "failed":
        return f"{outcome.model}: failed"
    s = outcome.summary
    gap = "–" if s.get("bg_gap") is None else f"{s['bg_gap']:.2f}"
    return (f"{outcome.model}: {outcome.status}: original {s['original']:.2f}%, BG-gap {gap}, "
            f"challenge accuracy {s['challenge_accuracy']:.2f}%")


def _main(args: argparse.Namespace) -> int:
    check_outputs(folders={"--leaderboard-only": args.leaderboard_only} if args.leaderboard_only is not None
                  else {"--output-dir": args.output_dir})
    if args.leaderboard_only is not None:
        rows = build_leaderboard(args.leaderboard_only, not args.no_published)
        print(f"Leaderboard of {len(rows)} rows: {Path(args.leaderboard_only) / MARKDOWN_FILE}")
        return 0
    specs = specs_from_args(args)
    runtime = options.runtime_from_args(args, compile=args.compile)
    settings = ZooSettings(args.data_path, options.challenge_config_from_args(args, runtime),
                           args.batch_size or default_batch_size(runtime.device), args.workers,
                           options.cache_dir_from_args(args), args.trust_checkpoint)
    outcomes = run_zoo(specs, settings, runtime, args.output_dir, progress=not args.no_progress)
    failed = [o.model for o in outcomes if o.status == "failed"]
    if not runtime.group.is_main:
        return EXIT_SOME_FAILED if failed else 0
    print("\n".join(_outcome_line(o) for o in outcomes))
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} models done" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    if not args.no_leaderboard and (Path(args.output_dir) / MODELS_FOLDER).is_dir():
        rows = build_leaderboard(args.output_dir, not args.no_published)
        print(f"Leaderboard of {len(rows)} rows: {Path(args.output_dir) / MARKDOWN_FILE}")
    return EXIT_SOME_FAILED if failed else 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(build_parser(), _main, argv, on_interrupt="rerun the same command: finished models are "
                                                                  "skipped and the current one resumes")


if __name__ == "__main__":
    sys.exit(main())
