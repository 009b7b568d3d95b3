"""Images in requests, whatever the dialect: OpenAI's `image_url` parts (a data: URI), Ollama's
`images` (base64), Anthropic's image blocks (base64 source), llama-server's `multimodal_data`.
Each becomes its bytes, collected in the request's order, and a mark in the message's text where
it goes (the worker's template renders around it; native/chat_template.py IMAGE). The bytes are
only decoded here from base64: whether they are an image the worker says (native/vision/images.py),
a 400 naming the field either way.

Remote URLs are not fetched: a server that fetches what a request names can be made to reach
addresses its client cannot (loopback, the LAN) — send the image's bytes.
"""

from __future__ import annotations

import base64
import binascii
import re

from kiln.native.vision.layout import IMAGE, MARKER as MEDIA_MARKER

from .common import JSONError


def bad(param: str, message: str, code: str = "invalid_value") -> JSONError:
    return JSONError(400, code, message, param=param)

MAX_IMAGES = 16
MAX_IMAGE_BYTES = 64 * 1024 * 1024
_DATA_URI = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def b64_image(value, where: str) -> bytes:
    """The bytes of a base64 string (whitespace allowed, as Ollama's clients wrap it)."""
    if not isinstance(value, str) or not value:
        raise bad(where, "an image must be a non-empty base64 string", "invalid_type")
    if len(value) > MAX_IMAGE_BYTES * 4 // 3 + 4096:
        raise bad(where, f"the image is over the {MAX_IMAGE_BYTES >> 20} MiB limit")
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad(where, "the image is not valid base64") from None


def url_image(url, where: str, fetch: bool = False) -> bytes:
    """An image_url's bytes: a data: URI, or with `fetch` (server.fetch_images) an http(s) URL
    fetched from a public address (remote.py); else a 400 saying why a remote URL is not fetched."""
    if not isinstance(url, str) or not url:
        raise bad(where, "url must be a non-empty string", "invalid_type")
    m = _DATA_URI.match(url)
    if m:
        if not m.group("b64"):
            raise bad(where, "a data: URI image must be base64 (data:image/png;base64,...)")
        kind = (m.group("type") or "").lower()
        if kind and not kind.startswith("image/") and kind != "application/octet-stream":
            raise bad(where, f"a data: URI of type {kind!r} is not an image")
        return b64_image(url[m.end():], where)
    if url.lower().startswith(("http://", "https://")) and fetch:
        from .remote import FetchError, fetch_public
        try:
            return fetch_public(url, MAX_IMAGE_BYTES)
        except FetchError as e:
            raise bad(where, str(e)) from None
    if url.lower().startswith(("http://", "https://")):
        raise bad(where, "Kiln does not fetch images from URLs (server.fetch_images is off) (a server that fetches what a request names can "
                         "be made to reach addresses its client cannot); send the bytes as a data: URI "
                         "(data:image/png;base64,...)")
    raise bad(where, "url must be a data: URI (data:image/png;base64,...)")


def b64_parts(images, text, where: str) -> list[dict]:
    """Base64 images (Ollama's `images`) before a message's text (where Ollama places them), as
    chat content parts."""
    field = f"{where}.images" if where != "images" else "images"
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise bad(field, "images must be a list of base64 strings", "invalid_type")
    for k, i in enumerate(images):             # checked here, so that an error names Ollama's own field
        _checked(b64_image(i, f"{field}[{k}]"), f"{field}[{k}]")
    return [{"type": "image_url", "image_url": {"url": "data:application/octet-stream;base64," + i}} for i in images] \
        + ([{"type": "text", "text": text}] if isinstance(text, str) and text else [])


def _checked(data: bytes, where: str) -> bytes:
    """`data`, its header checked (an image Kiln reads, at most 50 MP), or a 400 naming `where`."""
    from kiln.native.vision.images import ImageError, check_header
    try:
        check_header(data, where)
    except ImageError as e:
        raise bad(where, str(e)) from None
    return data


def fetching(sup) -> bool:
    """server.fetch_images: whether http(s) image URLs are fetched."""
    return bool(sup.cfg["server"].get("fetch_images"))


class Images:
    """A request's images in order, bounded in count; `fetch`: http(s) URLs are fetched
    (server.fetch_images)."""

    def __init__(self, fetch: bool = False):
        self.items: list[bytes] = []
        self.fetch = fetch

    def add(self, data: bytes, where: str) -> str:
        """Keep `data`; the mark its place in a text gets."""
        if len(self.items) >= MAX_IMAGES:
            raise bad(where, f"at most {MAX_IMAGES} images a request")
        self.items.append(_checked(data, where))   # not an image, or too many pixels: said here, naming the field
        return IMAGE

    def work(self) -> dict:
        """The Work fields these images give (none without images)."""
        return {"images": list(self.items)} if self.items else {}


def no_mark(text: str, where: str) -> str:
    """A text a client wrote, refused if it holds the private mark images use."""
    if IMAGE in text:
        raise bad(where, "the text holds U+E002, which Kiln reserves for where images go; remove it")
    return text


def media_prompt(prompt: dict) -> dict:
    """llama-server's multimodal prompt object as the work it asks for: the text (special tokens
    parsed) with an image at each marker."""
    extra = set(prompt) - {"prompt_string", "multimodal_data"}
    if extra:
        raise bad(f"prompt.{sorted(extra)[0]}", "a prompt object is {\"prompt_string\": …, \"multimodal_data\": [base64, …]}")
    text, data = prompt.get("prompt_string"), prompt.get("multimodal_data") or []
    if not isinstance(text, str) or not text:
        raise bad("prompt.prompt_string", "prompt_string must be a non-empty string", "invalid_type")
    if not isinstance(data, list):
        raise bad("prompt.multimodal_data", "multimodal_data must be a list of base64 strings", "invalid_type")
    if text.count(MEDIA_MARKER) != len(data):
        raise bad("prompt.multimodal_data", f"prompt_string has {text.count(MEDIA_MARKER)} {MEDIA_MARKER} markers "
                                            f"for {len(data)} images: one marker where each image goes")
    images = Images()
    for i, d in enumerate(data):
        images.add(b64_image(d, f"prompt.multimodal_data[{i}]"), f"prompt.multimodal_data[{i}]")
    return {"text": text, "special": True, **images.work()}
