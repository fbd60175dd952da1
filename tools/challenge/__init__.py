"""The Backgrounds Challenge: the adversarial-background search: which foregrounds can some test background make
the model misclassify.

Everything is decoded once onto the device as uint8; composites are made there (`where(mask, fg, bg)`,
which equals `bg * (1 - m) + fg * m` for a 0/1 mask) and normalised inside the model. Batches hold
(foreground, background) pairs of many foregrounds at once. A foreground leaves the search the moment
it is found vulnerable; a robust one is tested against every background, so the verdicts equal those
of an exhaustive search whatever the order. The order only decides how much work is done: each round
offers every open foreground its next k untested backgrounds by a score (the model's prediction on the
background alone, refined by how often each background has fooled foregrounds of that class so far),
with k doubling from round to round.

All scheduling state lives in `SearchState`, saved atomically under the output folder, so a run stopped
at any point (even by kill -9) resumes into exactly the sequence of batches it would have run.

The package: `config` (the settings: `ChallengeConfig`, the criterion), `data` (what is read, decoded once),
`predictor` (composites on the device, predicted), `state` (everything saved for --resume), `scheduler` (which pairs
to test next, and what the results mean), `run` (`run_challenge`, the whole run, and the search loop it drives:
progress, saving), `result` (the summary, the results JSON, the per-foreground CSV), `cli` (the command:
challenge_eval.py, bgc-challenge).
"""

from tools.challenge.config import ChallengeConfig, Criterion
from tools.challenge.data import (
                                  ChallengeData,
                                  ChallengeFiles,
                                  list_challenge_files,
                                  load_challenge_data,
)
from tools.challenge.predictor import CompositePredictor
from tools.challenge.result import ChallengeResult
from tools.challenge.run import Search, run_challenge
from tools.challenge.scheduler import Scheduler
from tools.challenge.state import ROBUST, STATE_NAME, UNKNOWN, VULNERABLE, SearchState

__all__ = ["ChallengeConfig", "ChallengeData", "ChallengeFiles", "ChallengeResult", "CompositePredictor",
           "Criterion", "ROBUST", "STATE_NAME", "Scheduler", "Search", "SearchState", "UNKNOWN", "VULNERABLE",
           "list_challenge_files", "load_challenge_data", "run_challenge"]
