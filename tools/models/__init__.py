"""Models: the boundary (`PixelModel`, `LoadedModel`), architectures, the source registry, checkpoint
reading and CLIP zero-shot."""
