"""Vision: mmproj (clip) files as llama.cpp's mtmd reads them — images decoded and cut
(images.py), encoded into rows the text model reads (encoder.py), and placed in a prompt
between the model's image tokens (layout.py)."""

from .clip_config import PROJECTORS, VisionConfig, is_mmproj, read_vision_config
from .encoder import VisionEncoder, load_vision
from .images import MAX_PIXELS, ImageError, Tiles, decode, preprocess

__all__ = ["MAX_PIXELS", "PROJECTORS", "ImageError", "Tiles", "VisionConfig", "VisionEncoder", "decode",
           "is_mmproj", "load_vision", "preprocess", "read_vision_config"]
