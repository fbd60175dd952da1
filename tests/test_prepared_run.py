"""tools.prepared_run: a model prepared on data listed for another request is refused before anything is built."""

from __future__ import annotations

import pytest
import torch

from tools.challenge import ChallengeConfig
from tools.data.compositing import MaskArithmetic
from tools.in9.evaluate import In9Config
from tools.prepared_run import Request, list_data, prepare
from tools.runtime import Runtime


def never_built():
    raise AssertionError("the model was built")


@pytest.mark.parametrize("other", [
    {"challenge": ChallengeConfig(mask_arithmetic=MaskArithmetic.ORIGINAL)},  # its decoded masks are binary
    {"in9": In9Config(("original",))},  # it listed mixed_rand
    {"workers": 2},
])
def test_data_listed_for_another_request_is_refused(other, dataset):
    """The data's request decides what is listed and how it decodes (the challenge's mask arithmetic, the in9
    variations): a run asked with other settings would silently run on the data's, so it is refused."""
    listed = Request(dataset.root, In9Config(("mixed_rand",)), ChallengeConfig(), workers=1, progress=False)
    data = list_data(listed)
    asked = Request(**{**{f: getattr(listed, f) for f in ("data_path", "in9", "challenge", "workers", "progress")},
                       **other})
    with pytest.raises(ValueError, match="listed for another request"):
        prepare(asked, Runtime(torch.device("cpu")), never_built, data)
