"""Many models, one command: the IN-9 `all` run and the challenge for each, one results file each, a leaderboard.

    python -m tools.zoo --output-dir zoo \\
        --models resnet50,vit_b_16,timm:convnext_tiny,clip:ViT-B-32/openai,file:my.pt,resnet18@file:sd.pt
    python -m tools.zoo --leaderboard-only zoo

Model specs:
- NAME: a torchvision architecture with its pretrained weights (IMAGENET1K_V1 where it has them);
- timm:NAME: a timm architecture (timm installed); clip:ARCH/PRETRAINED: CLIP zero-shot (open_clip_torch);
- file:PATH: a TorchScript or torch.export file, or a checkpoint that records its architecture ("arch");
- ARCH@file:PATH: a checkpoint of architecture ARCH (a torchvision name, timm:NAME or toolkit:NAME), e.g. a plain
  state dict.
These are the names --arch takes in the scripts and train.py (one grammar: tools.models.spec).

Each model writes OUTPUT/models/<name>.json when both runs are done, and is skipped while its data content, model
and settings are unchanged; its runs resume from OUTPUT/runs/<name>/. A model that fails is reported in one line
and the others go on; exit code 0 when all succeeded, 1 when some failed, 2 for bad input to the command itself.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tools import __version__, cli, distributed, options
from tools.challenge import STATE_NAME, ChallengeConfig, flags
from tools.data.hashing import sha256_file
from tools.data.store import DecodedCache
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config
from tools.models import hub
from tools.models.boundary import LoadedModel
from tools.models.device_check import verified
from tools.models.record import ModelRecord, installed_version
from tools.models.sources import load_model
from tools.models.spec import ModelSpec
from tools.prepared_run import EvaluationData, Request, list_data, prepare
from tools.provenance import check_outputs, read_json, write_json_atomic
from tools.results.leaderboard import MARKDOWN_FILE, MODELS_FOLDER, build_leaderboard
from tools.runtime import Runtime

log = logging.getLogger(__name__)

RUNS_FOLDER = "runs"
RUN_IDENTITY_FILE = "identity.json"  # in OUTPUT/runs/<name>/: what the saved state there is of
EXIT_SOME_FAILED = 1


# ----------------------------------------------------------------------------------------------------------
# Model specs

def parse_model_spec(text: str) -> ModelSpec:
    """One entry of --models, in the grammar every command shares (`tools.models.spec`)."""
    text = text.strip()
    if not text:
        raise UserError("an empty model spec; --models takes a comma-separated list such as resnet50,file:my.pt")
    return ModelSpec.parse(text)


def load(spec: ModelSpec, trust: bool = False, runtime: Runtime | None = None, progress: bool = False,
         trust_remote_code: bool = False, cache: DecodedCache | None = None) -> LoadedModel:
    return load_model(spec.text, trust=trust, runtime=runtime, progress=progress, lora_options=None,
                      trust_remote_code=trust_remote_code, cache=cache)


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
    batch_size: int | None  # None: the runtime's default
    workers: int
    cache: DecodedCache | None = None
    trust: bool = False
    trust_remote_code: bool = False
    allow_inexact_device: bool = False  # run a model on even when the start-up device check finds it inexact

    def request(self, progress: bool) -> Request:
        """Both runs of every model: in9's `all` and the challenge."""
        return Request(self.data_path, In9Config(VARIATIONS, self.batch_size, self.workers, progress,
                                                 self.challenge.recheck_margin),
                       self.challenge, self.workers, self.cache, progress, self.allow_inexact_device)

    def fingerprint(self, runtime: Runtime) -> dict:
        """The settings that change a model's numbers (the batch size too) and the toolkit's version. Where the runs
        were made is not a setting: the provenance says it and the leaderboard groups rows by it."""
        return {"precision": runtime.precision.value, "compile": runtime.compile,
                "channels_last": runtime.channels_last, "criterion": self.challenge.criterion.value,
                "recheck_margin": runtime.recheck_margin(self.challenge.recheck_margin),
                "mask_arithmetic": self.challenge.mask_arithmetic.value,
                "batch_size": runtime.batch_size(self.batch_size), "toolkit": __version__}


def identity(data: EvaluationData, model_identity: str | None, settings: dict) -> dict:
    """What a result (and its runs' saved state) is of."""
    return {"data_sha256": data.sha256, "model": model_identity, "settings": settings}


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


def _read_json(path: Path) -> dict | None:
    try:
        payload = read_json(path)
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


# The files a loader reads at a path its model's name fixes: the checkpoint the name (or --checkpoint) names, and
# pretrained weights at their URL's place in torch's hub cache. Where the record holds others, the files a loader
# would read now may be others (a folder's new processor config, an adapter's .safetensors beside its .bin).
FIXED_FILES = {"checkpoint", "weights"}


def recorded_model_unchanged(payload: dict) -> bool | None:
    """Whether a results file's model is still that model, told from its recorded files and versions without
    building it; None where only building can tell (docs/zoo.md: a hub cache's file, a part computed at load)."""
    described = ((payload.get("in9") or {}).get("provenance") or {}).get("model_record")
    if not isinstance(described, dict) or ModelRecord.digest_of(described) != payload["identity"].get("model"):
        return None
    files = described.get("files", {})
    if described.get("computed") or any(role not in FIXED_FILES or "path" not in entry or
                                        hub.in_cache(Path(entry["path"])) for role, entry in files.items()):
        return None
    for entry in files.values():
        path = Path(entry["path"])
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            return False
    return all(installed_version(name) == version for name, version in described.get("libraries", {}).items())


def reusable_result(path: Path, spec: ModelSpec, data: EvaluationData, settings: dict, trust: bool = False,
                    runtime: Runtime | None = None, progress: bool = False, trust_remote_code: bool = False,
                    cache: DecodedCache | None = None) -> tuple[dict | None, LoadedModel | None]:
    """(the results file's contents if of this data, model and settings, else None; the model if loaded)."""
    if not path.is_file():
        return None, None
    payload = _read_json(path)
    if payload is None or "model" not in payload.get("identity", {}):
        log.warning("%s is unreadable or older than the data and model identities it must hold: running its model "
                    "again", path)
        return None, None
    if payload.get("model") != spec.text:  # a file of another model (copied here): its record is not this model's
        log.warning("%s holds the results of %r, not of %s: running %s", path, payload.get("model"), spec.text,
                    spec.text)
        return None, None
    recorded = payload["identity"]
    if recorded.get("settings") != settings:
        raise UserError(f"{path} was made with other settings ({recorded.get('settings')}); use another "
                        f"--output-dir or delete the file to rerun")
    if recorded.get("data_sha256") != data.sha256:
        log.info("the data's content changed since %s was made: running its model again", path)
        return None, None
    unchanged, loaded = recorded_model_unchanged(payload), None
    if unchanged is None:
        loaded = load(spec, trust, runtime, progress, trust_remote_code, cache)
        unchanged = loaded.identity == recorded.get("model")
    if not unchanged:
        log.info("the model %s changed since %s was made (its record says what it is made of): running it again",
                 spec.text, path)
        return None, loaded
    return payload, loaded


def set_aside_other_state(state_dir: Path, wanted: dict) -> None:
    """Set a model's state folder aside (NAME.stale-N, one log line) unless it is of `wanted`; record `wanted`."""
    record = state_dir / RUN_IDENTITY_FILE
    if state_dir.is_dir() and any(state_dir.iterdir()) and _read_json(record) != wanted:
        aside = next(path for path in (state_dir.with_name(f"{state_dir.name}.stale-{n}") for n in itertools.count(1))
                     if not path.exists())
        state_dir.rename(aside)
        log.warning("%s holds the state of a run on other data, model or settings: set aside as %s", state_dir,
                    aside.name)
    write_json_atomic(record, wanted)


def evaluate_model(loaded: LoadedModel, spec: ModelSpec, settings: ZooSettings, runtime: Runtime,
                   data: EvaluationData, output_dir: Path) -> dict:
    """Both runs for one model (resuming from OUTPUT/runs/<name>/), as the results file's contents; torchrun's
    processes leave together when one fails."""
    state_dir = Path(output_dir) / RUNS_FOLDER / spec.slug
    # the scripts' start-up device check; refused, it fails this model alone (one line, `run_zoo`)
    prepared = prepare(data.request, runtime, lambda: loaded, data)
    with distributed.agree(runtime.group, runtime.device):
        if runtime.group.is_main:  # the state of the runs of another model, settings, arithmetic (the device model,
            # torch's version), decoder or device check's verdict aside: what their saved states are keyed by
            set_aside_other_state(state_dir, {**identity(data, loaded.identity, settings.fingerprint(runtime)),
                                              "arithmetic": runtime.arithmetic(), "decoders": data.decoders,
                                              "verified": verified(prepared.device_check)})
    with distributed.agree(runtime.group, runtime.device):
        in9 = prepared.in9(state_dir, resume=True)
    with distributed.agree(runtime.group, runtime.device):
        challenge = prepared.challenge(state_dir, (state_dir / STATE_NAME).is_file())
    weights = loaded.weights or (Path(loaded.source).name if loaded.source else None)
    # the path as loaded, links kept: a hub cache's snapshots/REV/FILE is a link into blobs/, and only the snapshot
    # path says which revision was loaded (a moved refs/main loads another)
    weights_file = Path(loaded.source).absolute() if loaded.source and Path(loaded.source).is_file() else None
    return {"model": spec.text, "source": spec.source, "arch": loaded.arch, "weights": weights,
            "weights_file": str(weights_file) if weights_file else None,
            "weights_file_sha256": sha256_file(weights_file) if weights_file else None,
            "identity": identity(data, loaded.identity, settings.fingerprint(runtime)),
            "in9": in9.to_json(), "challenge": challenge.to_json()}


def run_zoo(specs: list[ModelSpec], settings: ZooSettings, runtime: Runtime, output_dir: Path,
            progress: bool = True) -> list[Outcome]:
    """Every model in turn; done ones are skipped, a failing one is logged in one line and the rest go on. Under
    torchrun every process takes each decision with the others."""
    device = runtime.device
    with distributed.agree(runtime.group, device):
        data = list_data(settings.request(progress), hold=True)  # decoded for the first model, held for the rest
    fingerprint = settings.fingerprint(runtime)
    outcomes = []
    for index, spec in enumerate(specs, 1):
        path = results_path(output_dir, spec)
        log.info("[%d/%d] %s", index, len(specs), spec.text)
        try:
            with distributed.agree(runtime.group, device):
                payload, loaded = reusable_result(path, spec, data, fingerprint, settings.trust, runtime, progress,
                                                  settings.trust_remote_code, settings.cache)
            if distributed.all_reduce(np.array([payload is not None], np.int64), "min", device)[0]:  # all or none
                log.info("%s is done already (%s): skipped", spec.text, path)
                outcomes.append(Outcome(spec.text, "skipped", path, summary=_summary(payload)))
                continue
            with distributed.agree(runtime.group, device):
                loaded = loaded or load(spec, settings.trust, runtime, progress, settings.trust_remote_code,
                                        settings.cache)
            payload = evaluate_model(loaded, spec, settings, runtime, data, output_dir)
            with distributed.agree(runtime.group, device):
                if runtime.group.is_main:  # under torchrun the processes share each model's runs; rank 0 writes
                    write_json_atomic(path, payload)
            outcomes.append(Outcome(spec.text, "done", path, summary=_summary(payload)))
        except UserError as exc:
            log.error("%s: %s", spec.text, exc)
            outcomes.append(Outcome(spec.text, "failed", message=str(exc)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            log.exception("%s failed unexpectedly", spec.text)
            outcomes.append(Outcome(spec.text, "failed", message=f"{type(exc).__name__}: {exc}"))
        finally:
            loaded = None
            runtime.release()
    return outcomes


# ----------------------------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__, epilog=cli.examples(
        "python -m tools.zoo --models resnet18,resnet50 --output-dir zoo",
        "python -m tools.zoo --leaderboard-only zoo"))
    models = parser.add_argument_group("models")
    models.add_argument("--models", default=None, metavar="SPEC[,SPEC...]",
                        help="comma-separated model specs (see above) (default: none)")
    models.add_argument("--models-file", type=Path, default=None, metavar="PATH",
                        help="a file with one model spec per line, # comments allowed (default: none)")
    options.add_trust_argument(models)
    options.add_remote_code_argument(models)
    options.add_data_arguments(parser)
    options.add_running_arguments(parser, shard=False, device_check=True)
    cli.reword(parser, "batch_size", options.BATCH_HELP["zoo"])
    flags.add_search_arguments(parser.add_argument_group("challenge"))
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
    checked = options.check_arguments(args)
    runtime = options.runtime_from_args(args, compile=args.compile)
    settings = ZooSettings(checked.data_path, flags.challenge_config_from_args(args, checked.progress),
                           args.batch_size, args.workers, flags.cache_from_args(args), args.trust_checkpoint,
                           args.trust_remote_code, args.allow_inexact_device)
    outcomes = run_zoo(specs, settings, runtime, args.output_dir, progress=checked.progress)
    failed = [o.model for o in outcomes if o.status == "failed"]
    # under torchrun the other processes wait for rank 0's report: one that exits first ends the job
    with distributed.agree(runtime.group, runtime.device):
        if runtime.group.is_main:
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
