"""Models: the boundary (`PixelModel`, `LoadedModel`), the grammar of model names, architectures, the source
registry, checkpoint reading and CLIP zero-shot."""


def list_sources() -> dict[str, dict[str, str]]:
    """{"sources": {prefix: description}, "architectures": {prefix: description}}, each description the first paragraph
    of the registered function's docstring ("" is no prefix)."""
    from tools.models.architectures import ARCHITECTURES  # noqa: PLC0415 (the package imports nothing itself)
    from tools.models.sources import SOURCES  # noqa: PLC0415
    return {"sources": {prefix: _summary(source) for prefix, source in SOURCES.items()},
            "architectures": {prefix: _summary(family.build) for prefix, family in ARCHITECTURES.items()}}


def _summary(function) -> str:
    paragraph = (function.__doc__ or function.__name__).strip().split("\n\n")[0]
    return " ".join(paragraph.split())
