"""The Backgrounds Challenge, the adversarial-background search: which foregrounds some test background makes the
model misclassify. A foreground leaves the search once found vulnerable and a robust one meets every background,
so the verdicts equal an exhaustive search's in any order (the order only decides the work); the state is saved
atomically, so a stopped run resumes into the very batches it would have run. See docs/how-it-works.md, The
search. Modules: `config`, `data`, `predictor`, `state` (for --resume), `scheduler` (what to test next, what
results mean), `run` (`run_challenge`), `result` (summary, JSON, CSV), `cli` (challenge_eval.py)."""

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
