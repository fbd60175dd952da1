"""Backgrounds Challenge toolkit: IN-9 accuracy, the adversarial-background challenge, and analyses.

Importing it changes nothing, except in one of the toolkit's commands: there Ctrl-C while it loads (seconds,
before `tools.cli.run_main` can catch anything) is one line and exit code 130, not a traceback from an import.
"""

import os
import signal
import sys

__version__ = "0.2.0"

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports Ctrl-C
ROOT_SCRIPTS = ("in9_eval.py", "challenge_eval.py", "train.py")  # the console scripts are bgc-*


def interrupted_while_loading(signum, frame) -> None:
    """SIGINT's handler while a command loads."""
    print("interrupted: rerun the same command", file=sys.stderr)
    raise SystemExit(EXIT_INTERRUPTED)


def _is_command() -> bool:
    """Whether this process runs one of the toolkit's commands, as it was typed (`sys.orig_argv`)."""
    typed = sys.orig_argv
    module = typed[typed.index("-m", 1) + 1] if "-m" in typed[1:-1] else ""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return module.split(".")[0] == "tools" or script in ROOT_SCRIPTS or script.startswith("bgc-")


if _is_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted_while_loading)


def __getattr__(name: str):
    """`from tools import benchmark` is imported on first use, so that `import tools` stays light."""
    if name == "benchmark":
        from tools.api import benchmark  # noqa: PLC0415
        return benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
