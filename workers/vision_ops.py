"""Images for an inference worker (mixed into InferenceWorker): its model's vision projector, found
and checked at boot, and a request's images turned into the rows the prompt carries.

The projector is the worker's `mmproj` setting (a path or library name; "off": none) or else the
first `mmproj*.gguf` in the model's folder that belongs to it, the name nearest the model's tried
first — llama-server's `--mmproj`, and how `-hf` lays a vision model's files out. One named
outright that does not belong to the model stops the boot; one found beside it that does not is
left out, the reason in the worker's status.
"""

from __future__ import annotations

from pathlib import Path

from kiln.native.gguf_file import GGUFError
from kiln.native.models.hub_refs import mmprojs_beside
from kiln.native.models.library import ModelNotFound, resolve_model
from kiln.native.vision import ImageError, load_vision
from kiln.native.vision.layout import ImageTokens, image_key

from .worker import BootError, OpError

MAX_IMAGES = 16           # a request's images (each up to 50 MP before it is resized)


class VisionOps:
    """Needs `self.model`, `self.settings`; gives `self.vision` (None: no images) and `_images`."""

    def _boot_vision(self) -> None:
        self.vision, self.vision_note = None, None
        setting = self.settings.get("mmproj")
        if setting == "off":
            self.vision_note = "mmproj = off"
            return
        explicit = bool(setting)
        try:
            paths = [resolve_model(setting)] if explicit else mmprojs_beside(Path(self.model.path))
        except ModelNotFound as e:
            raise BootError(f"mmproj {setting!r}: {e}") from None
        notes = []
        for path in paths:             # beside the model: the first that belongs to it
            try:
                enc = load_vision(path)
                mc = self.model.config
                reads = mc.n_embd * (1 + mc.get("deepstack", 0))      # Qwen3-VL: and a slice per deepstack layer
                if enc.config.n_text != mc.n_embd or enc.config.row_width != reads:
                    raise ValueError(f"its projector gives rows of {enc.config.row_width} values and "
                                     f"{self.model.path.name} reads {reads}: it belongs to another model")
                self.image_tokens = ImageTokens(self.model.tokenizer, enc.config.projector)
            except (GGUFError, ValueError) as e:
                if explicit:
                    raise BootError(f"mmproj {Path(path).name}: {e}") from None
                notes.append(f"{Path(path).name} left out: {e}")
                continue
            self.vision = enc
            return
        self.vision_note = "; ".join(notes) or None

    def vision_status(self) -> dict:
        if self.vision is None:
            return {"vision": False, **({"vision_note": self.vision_note} if self.vision_note else {})}
        c = self.vision.config
        size = {"max_image_tokens": c.max_pixels // (2 * c.patch_size) ** 2} if c.dynamic else \
            {"image_size": c.image_size, "tokens_per_tile": c.tokens_per_tile}
        return {"vision": True, "mmproj": {"path": str(self.vision.path), "projector": c.projector, **size}}

    def _images(self, body: dict) -> list[list[int]] | None:
        """Each of the request's images as the ids its prompt carries (rows held by the model),
        or None without images. A 400 names an image that is not one, or a model without vision."""
        images = body.get("images")
        if not images:
            return None
        if self.vision is None:
            why = f" ({self.vision_note})" if self.vision_note else ""
            raise OpError("bad_request", f"{self.model.path.stem} has no vision projector{why}: it reads text only. "
                                         f"Put its mmproj-*.gguf beside the model or set the worker's mmproj")
        if not isinstance(images, list) or len(images) > MAX_IMAGES:
            raise OpError("bad_request", f"images: at most {MAX_IMAGES} images a request")
        enc, out = self.vision, []
        bidirectional = enc.config.projector == "gemma3"       # mtmd decodes Gemma 3's images non-causally
        for i, data in enumerate(images):
            if not isinstance(data, (bytes, bytearray)):
                raise OpError("bad_request", f"images[{i}] must be the image's bytes")
            try:
                tiles = enc.read(bytes(data), f"images[{i}]")
            except ImageError as e:
                raise OpError("bad_request", str(e)) from None
            keys = [image_key(enc.digest, bytes(data), j)
                    for j in range(len(tiles.squares) + (tiles.overview is not None))]
            media = self.model.media
            squares = [media.ids_if_held(k, bidirectional) for k in keys]   # seen lately: not encoded again
            if any(sq is None for sq in squares):
                grid = tiles.grid if enc.config.dynamic else None     # M-RoPE places its rows in 2D
                squares = [media.add(k, r, bidirectional, grid) for k, r in zip(keys, enc.encode_image(tiles))]
            out.append(self.image_tokens.around(squares, tiles.grid))
        return out
