"""Vision: mmproj (clip) files as llama.cpp's mtmd reads them — images decoded and cut
(images.py), encoded into rows the text model reads (encoder.py), and placed in a prompt
between the model's image tokens (layout.py). Names load on first use: a front end that only
checks an image's header does not load the engine."""

from importlib import import_module

_WHERE = {"PROJECTORS": "clip_config", "VisionConfig": "clip_config", "is_mmproj": "clip_config",
          "read_vision_config": "clip_config", "VisionEncoder": "encoder", "load_vision": "encoder",
          "MAX_PIXELS": "images", "ImageError": "images", "Tiles": "images", "decode": "images",
          "preprocess": "images"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
