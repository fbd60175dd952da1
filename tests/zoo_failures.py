"""`python -m tools.zoo` with failures that strike one process only, for tests/test_distributed.py (run it under
torchrun from the repository root: `python -m torch.distributed.run ... -m tests.zoo_failures ZOO-ARGS`).

A model fails in the phase its file name names, on the process given there, and nowhere else:

| word in the name | where, on which rank | as what |
| --- | --- | --- |
| `fail-load` | loading the model, rank 1 | a file missing on that machine |
| `fail-in9` | decoding the in9 run's second batch, rank 1 | a damaged image only that process decodes |
| `fail-decode` | decoding the challenge's data, rank 1 | a damaged image |
| `fail-search` | predicting a batch of the challenge's search, rank 1 | a crash in the model |
| `fail-save` | saving the search state, rank 0 | a full disk |
| `fail-write` | writing the results file, rank 0 | a full disk |

Everything else is the real code.
"""

from __future__ import annotations

import os
import sys

from tools import prepared_run, zoo
from tools.challenge import CompositePredictor, SearchState
from tools.data import image_sets
from tools.errors import UserError

RANK = int(os.environ["RANK"])
current = {"model": ""}  # the spec being run, set when it is loaded


def strikes(word: str, rank: int) -> bool:
    return RANK == rank and word in current["model"]


def patch(owner, name: str, make) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def load(original):
    def wrapper(spec, *args, **kwargs):
        current["model"] = spec.text
        if strikes("fail-load", 1):
            raise UserError(f"checkpoint {spec.path} does not exist (on rank {RANK} only)")
        return original(spec, *args, **kwargs)
    return wrapper


def batches(original):
    def wrapper(*args, **kwargs):
        for number, item in enumerate(original(*args, **kwargs)):
            if number == 1 and strikes("fail-in9", 1):
                raise UserError(f"cannot read image of batch {item[0]}: image file is truncated (on rank {RANK} only)")
            yield item
    return wrapper


def failing_on(word: str, rank: int, error: Exception, only=lambda *args: True):
    """A wrapper that raises `error` where `strikes(word, rank)` and `only(*args)`, else calls the original."""
    def make(original):
        def wrapper(*args, **kwargs):
            if strikes(word, rank) and only(*args):
                raise error
            return original(*args, **kwargs)
        return wrapper
    return make


patch(zoo, "load", load)
patch(image_sets, "iter_decoded_batches", batches)
patch(prepared_run, "load_challenge_data",
      failing_on("fail-decode", 1, UserError("cannot read image fg.JPEG: truncated")))
patch(CompositePredictor, "predict_pairs", failing_on("fail-search", 1, RuntimeError("the model crashed")))
patch(SearchState, "save", failing_on("fail-save", 0, OSError(28, "No space left on device")))
patch(zoo, "write_json_atomic", failing_on("fail-write", 0, OSError(28, "No space left on device"),
                                          only=lambda path, *rest: path.parent.name == zoo.MODELS_FOLDER))

if __name__ == "__main__":
    sys.exit(zoo.main())
