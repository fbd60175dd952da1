"""Backgrounds Challenge toolkit: IN-9 accuracy, the adversarial-background challenge, and analyses."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from tools import benchmark` (tools.api) is imported on first use, so that `import tools` stays light."""
    if name == "benchmark":
        from tools.api import benchmark  # noqa: PLC0415
        return benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
