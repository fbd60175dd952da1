"""A model's identity is its record: everything that reached its loader. Every parameter of `load_model`, every
field of the `ModelOptions` a source receives and every model flag of the commands is in the record or declared,
with its reason, not to change the logits (`tools.models.sources.NOT_IN_IDENTITY`); two keys of one checkpoint
file are two models, to `--resume` and in the provenance alike. The sources' own inputs (a hub's configs, remote
code, CLIP's configuration, timm's data config) are tested beside each source: tests/test_models_hub.py,
tests/test_models_hf.py, tests/test_models_clip.py, tests/test_models_adapters.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

import in9_eval
from tests.helpers import check_error, files_read, run_in_process, unrecorded_reads
from tools import options, zoo
from tools.challenge import cli as challenge_cli
from tools.data import synthetic
from tools.in9.cli import build_parser as in9_parser
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.sources import NOT_IN_IDENTITY, ModelOptions, load_model
from tools.training.config import build_parser as train_parser

pytestmark = pytest.mark.usefixtures("one_thread")


def small_cnn(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SmallCNN(9).eval()


@pytest.fixture
def two_keys(tmp_path):
    """One checkpoint file holding two models, as timm's training saves them: `state_dict` and `state_dict_ema`."""
    path = tmp_path / "two.pt"
    torch.save({"state_dict": small_cnn(0).state_dict(), "state_dict_ema": small_cnn(1).state_dict()}, path)
    return path


def loader_inputs() -> set[str]:
    """What reaches the loader by name: load_model's parameters and the fields of the options a source receives."""
    return set(inspect.signature(load_model).parameters) | {f.name for f in dataclasses.fields(ModelOptions)}


def test_every_input_of_the_loader_is_in_its_record_or_declared(two_keys):
    with files_read() as read:
        loaded = load_model(SMALL_CNN, checkpoint=two_keys, checkpoint_key="state_dict_ema")
    assert unrecorded_reads(read, loaded.record) == [] and two_keys in read
    record = loaded.record.describe()
    recorded = set(record["settings"]) | set(record["files"])
    missing = sorted(name for name in loader_inputs() if name not in recorded and name not in NOT_IN_IDENTITY)
    assert not missing, f"inputs of the loader neither in the model's record nor declared in NOT_IN_IDENTITY: {missing}"
    assert set(NOT_IN_IDENTITY) <= loader_inputs(), "a declaration of an input the loader no longer has"
    assert not set(NOT_IN_IDENTITY) & recorded, "an input both recorded and declared as not recorded"
    assert all(len(reason.split()) >= 5 for reason in NOT_IN_IDENTITY.values()), "each declaration says why"


# The model flags of each command and the parameter of load_model each one reaches (the zoo's --models names the
# models, one `arch` each).
FLAG_PARAMETERS = {"arch": "arch", "weights": "weights", "checkpoint": "checkpoint", "checkpoint_key": "checkpoint_key",
                   "trust_checkpoint": "trust", "in9": "in9", "normalize": "normalize", "lora_alpha": "lora_alpha",
                   "lora_rslora": "lora_rslora", "trust_remote_code": "trust_remote_code", "models": "arch",
                   "models_file": "arch"}


def model_flags(parser) -> dict[str, object]:
    """The parser's flags in its model groups, by destination: their actions."""
    return {action.dest: action for group in parser._action_groups if group.title and "model" in group.title
            for action in group._group_actions}


@pytest.mark.parametrize("command", ["in9", "challenge", "zoo", "train"])
def test_every_model_flag_reaches_a_recorded_or_declared_input(command):
    parser = {"in9": in9_parser, "challenge": challenge_cli.build_parser, "zoo": zoo.build_parser,
              "train": lambda: train_parser("train")}[command]()
    flags = model_flags(parser)
    assert flags, f"{command} has no model flags"
    unknown = sorted(dest for dest in flags if dest not in FLAG_PARAMETERS)
    assert not unknown, f"model flags of {command} that reach no input of the loader named here: {unknown}"
    assert {FLAG_PARAMETERS[dest] for dest in flags} <= loader_inputs()


class Captured(Exception):
    """The loader's call, stopped once its arguments are seen."""


def test_the_evaluation_scripts_hand_every_model_flag_to_the_loader(tmp_path, monkeypatch):
    """Each model flag of in9_eval.py and challenge_eval.py, given a value of its own, arrives as that value."""
    values = {"arch": "toolkit:small_cnn", "weights": "W", "checkpoint": str(tmp_path / "c.pt"), "checkpoint_key": "K",
              "trust_checkpoint": None, "in9": None, "normalize": "imagenet", "lora_alpha": "3", "lora_rslora": None,
              "trust_remote_code": None}
    for parser in (in9_parser(), challenge_cli.build_parser()):
        flags = model_flags(parser)
        assert set(flags) == set(values)
        argv = [arg for dest, action in flags.items() for arg in
                ([action.option_strings[0]] if values[dest] is None else [action.option_strings[0], values[dest]])]
        args = parser.parse_args(argv)
        calls = []

        def capture(*args, **kwargs):
            calls.append((args, kwargs))  # noqa: B023
            raise Captured

        monkeypatch.setattr(options, "load_model", capture)
        with pytest.raises(Captured):
            options.model_from_args(args, runtime=None, progress=False)
        bound = inspect.signature(load_model).bind(*calls[0][0], **calls[0][1]).arguments
        for dest in flags:
            assert bound[FLAG_PARAMETERS[dest]] == getattr(args, dest), dest
            assert getattr(args, dest) != parser.get_default(dest), dest  # each flag was really given


def test_two_checkpoint_keys_of_one_file_are_two_models(two_keys, tmp_path, capsys):
    """`--checkpoint-key state_dict_ema` and `state_dict` of one file: a state saved for the one is not resumed for
    the other, and the provenance of each says which it was."""
    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=1).root

    def run(key: str, output: str, *more: str):
        return run_in_process(in9_eval.main, ["--arch", SMALL_CNN, "--checkpoint", str(two_keys), "--checkpoint-key",
                                              key, "--data-path", str(data), "--device", "cpu", "--no-progress",
                                              "--eval-dataset", "original", "--output-dir", str(tmp_path / output),
                                              "--log-level", "WARNING", *more], capsys)

    code, out, err = run("state_dict_ema", "out", "--results-file", str(tmp_path / "ema.json"))
    assert code == 0, err
    code, out, err = run("state_dict", "out", "--resume")
    assert "another model" in check_error(code, out, err)
    code, out, err = run("state_dict", "fresh", "--results-file", str(tmp_path / "plain.json"))
    assert code == 0, err
    ema, plain = (json.loads((tmp_path / name).read_text())["provenance"] for name in ("ema.json", "plain.json"))
    assert ema["identity"] != plain["identity"]
    assert ema["model_record"]["settings"]["checkpoint_key"] == "state_dict_ema"
    assert plain["model_record"]["settings"]["checkpoint_key"] == "state_dict"
    assert ema["model_record"]["files"]["checkpoint"] == plain["model_record"]["files"]["checkpoint"]


STABLE_BUILDS = """
import json, sys, torch, torchvision
from torch import nn
from tools.models.boundary import state_sha256
from tools.models.record import ModelRecord
from transformers import ViTConfig, ViTForImageClassification


def scale(x):
    return x


def builds():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=1, hidden_dim=8,
                                               mlp_dim=8, num_classes=9)
    hf = ViTForImageClassification(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                              intermediate_size=8, image_size=32, patch_size=16, num_labels=9))
    kept = nn.Linear(2, 2)
    kept.names, kept.by_function = {"cat", "dog", "bird", "fish"}, {scale: 1.0, len: 2.0}
    return {"torchvision ViT": vit, "transformers ViT": hf, "kept set and functions as keys": kept,
            "torch.compile'd": torch.compile(nn.Sequential(nn.Linear(2, 2)))}


identities = {}
for name, model in builds().items():
    record = ModelRecord()
    record.setting("state", state_sha256(model))
    record.code(model)
    identities[name] = record.digest
print(json.dumps(identities))
"""


@pytest.mark.slow
def test_a_modules_identity_is_the_same_in_every_process(tmp_path):
    """The same build in two processes of other hash seeds (the order of sets and of strings' hashes) and memory
    layouts has one identity: library models as torchvision and transformers build them, a torch.compile'd module
    (whose wrapper keeps an id), and a module keeping a set of strings and a mapping keyed by functions (recorded by
    name, not by their addresses)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    pytest.importorskip("transformers")
    script = tmp_path / "identities.py"
    script.write_text(STABLE_BUILDS)
    found = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent.parent)
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert found[0] == found[1]
