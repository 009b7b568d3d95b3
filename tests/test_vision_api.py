"""Images through a real daemon: the official openai, ollama and anthropic clients and llama-server's
multimodal /completion send an image to a vision model (its mmproj found beside it) and get the
answer the engine gives in-process for the same prompt; Gemma 3's image rows attended both ways
and Qwen2.5-VL's and Qwen3-VL's placed by M-RoPE through the worker's chunked prefill; a malformed, huge, remote or misplaced image is a 400 naming the
field, and the worker that refused it keeps its pid."""

import base64
import shutil
import struct
import zlib

import anthropic
import numpy as np
import ollama
import openai
import pytest

from conftest import DATA
from daemon_harness import Daemon, http_json, kiln
from kiln.native.chat_template import IMAGE, render_and_tokenize, template_for
from kiln.native.model import load_model
from kiln.native.vision import load_vision
from kiln.native.vision.layout import ImageTokens, image_key, prompt_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
VISION = DATA / "vision"
CAT = (VISION / "cat.png").read_bytes()
WIDE = (VISION / "wide.png").read_bytes()
N = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("vision")
    for name, proj in (("smol", "smolvlm"), ("gemma", "gemma3"), ("qwen", "qwen25vl"), ("qwen3", "qwen3vl")):
        (home / name).mkdir()
        model = {"smol": "tiny-smolvlm.gguf", "gemma": "tiny-gemma3v.gguf", "qwen": "tiny-qwen25vl.gguf",
                 "qwen3": "tiny-qwen3vl.gguf"}[name]
        shutil.copy(VISION / model, home / name / model)
        shutil.copy(VISION / f"mmproj-tiny-{proj}.gguf", home / name / f"mmproj-tiny-{proj}.gguf")
    with Daemon(home, {"vlm": {"kind": "inference", "model": str(home / "smol" / "tiny-smolvlm.gguf")},
                       "gemma": {"kind": "inference", "model": str(home / "gemma" / "tiny-gemma3v.gguf"),
                                 "settings": {"prefill_chunk": 7}},
                       "qwen": {"kind": "inference", "model": str(home / "qwen" / "tiny-qwen25vl.gguf"),
                                "settings": {"prefill_chunk": 7}},
                       "qwen3": {"kind": "inference", "model": str(home / "qwen3" / "tiny-qwen3vl.gguf"),
                                 "settings": {"prefill_chunk": 7}},
                       "text": {"kind": "inference", "model": str(DATA / "tiny" / "tiny-llama.gguf")}},
                server={"fetch_images": True}) as d:
        d.wait(lambda st: all(w["worker_state"] == "ready" for w in st["workers"]), timeout=60, what="models loaded")
        yield d


def local_answer(model_file: str, proj: str, messages: list[dict], images: list[bytes]) -> list[int]:
    """What the engine answers in-process: the template rendered around the images' rows, N greedy tokens."""
    model, enc = load_model(VISION / model_file), load_vision(VISION / f"mmproj-tiny-{proj}.gguf")
    it = ImageTokens(model.tokenizer, enc.config.projector)
    ids = []
    for data in images:
        tiles = enc.read(data)
        rows = enc.encode_image(tiles)
        grid = tiles.grid if enc.config.dynamic else None
        ids.append(it.around([model.media.add(image_key(enc.digest, data, j), r, proj == "gemma3", grid)
                              for j, r in enumerate(rows)], tiles.grid))
    prompt = render_and_tokenize(template_for(model), model.tokenizer, messages, images=ids)[1]
    return greedy(model, prompt)


def greedy(model, prompt: list[int]) -> list[int]:
    cache = model.new_cache(512)
    logits, out = model.forward(prompt, cache), []
    for _ in range(N):
        out.append(int(np.argmax(logits)))
        if out[-1] == model.tokenizer.special.eos:
            break
        logits = model.forward([out[-1]], cache)
    return out


def text_of(model_file: str, ids: list[int]) -> str:
    tok = load_model(VISION / model_file).tokenizer
    eos = tok.special.eos
    return tok.decode([t for t in ids if t != eos], skip_control=True)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_openai_client_sends_a_data_uri_image(served):
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="vlm", max_tokens=N, temperature=0, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(CAT)}},
        {"type": "text", "text": " here?"}]}])
    want = local_answer("tiny-smolvlm.gguf", "smolvlm", [{"role": "user", "content": f"what is {IMAGE} here?"}], [CAT])
    assert out.choices[0].message.content == text_of("tiny-smolvlm.gguf", want)
    assert out.usage.prompt_tokens > 20                # the tiles' rows are prompt tokens


def test_ollama_and_anthropic_clients_place_the_image_first_and_agree(served):
    want = text_of("tiny-smolvlm.gguf", local_answer("tiny-smolvlm.gguf", "smolvlm",
                                                    [{"role": "user", "content": IMAGE + "the cat"}], [WIDE]))
    o = ollama.Client(host=served.http, timeout=120).chat(
        model="vlm", messages=[{"role": "user", "content": "the cat", "images": [WIDE]}],
        options={"num_predict": N, "temperature": 0})
    assert o.message.content == want
    a = anthropic.Anthropic(base_url=served.http, api_key="unused", timeout=120, max_retries=0).messages.create(
        model="vlm", max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(WIDE)}},
            {"type": "text", "text": "the cat"}]}])
    assert a.content[0].text == want
    status, g = http_json(served, "POST", "/api/generate", {"model": "vlm", "prompt": "the cat", "images": [b64(WIDE)],
                                                            "stream": False, "options": {"num_predict": N, "temperature": 0}})
    assert status == 200 and g["response"] == want, g


def test_kiln_run_with_an_image(served):
    want = text_of("tiny-smolvlm.gguf", local_answer("tiny-smolvlm.gguf", "smolvlm",
                                                    [{"role": "user", "content": IMAGE + "the cat"}], [WIDE]))
    out = kiln(served.home, "run", "--model", "vlm", "--image", str(VISION / "wide.png"), "-t", "0",
               "--max-tokens", str(N), "the cat")
    assert out.returncode == 0 and out.stdout.rstrip("\n") == want.replace("\r", "\n"), out.stderr   # text mode
    out = kiln(served.home, "run", "--model", "vlm", "--image", str(VISION / "references.json"), "hi")
    assert out.returncode == 2 and "references.json: not an image Kiln reads" in out.stderr, out.stderr


def test_llama_server_multimodal_prompt_gives_the_engines_tokens(served):
    body = {"model": "vlm", "n_predict": N, "temperature": 0, "return_tokens": True,
            "prompt": {"prompt_string": "look <__media__> now", "multimodal_data": [b64(CAT)]}}
    status, out = http_json(served, "POST", "/completion", body)
    assert status == 200, out
    model, enc = load_model(VISION / "tiny-smolvlm.gguf"), load_vision(VISION / "mmproj-tiny-smolvlm.gguf")
    tiles = enc.read(CAT)
    rows = [model.media.add(image_key(enc.digest, CAT, j), r) for j, r in enumerate(enc.encode_image(tiles))]
    prompt = prompt_ids(model.tokenizer, "look <__media__> now", [ImageTokens(model.tokenizer, "idefics3").around(rows, tiles.grid)])
    assert out["tokens"] == greedy(model, prompt)[:len(out["tokens"])] and out["tokens_evaluated"] == len(prompt)


def test_gemma3_image_through_chunked_prefill_matches_the_engine(served):
    """The worker prefills in chunks of 7: a chunk never ends inside the image (its 16 rows attend
    both ways, as in llama.cpp's one batch)."""
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model="gemma", max_tokens=N, temperature=0, messages=[{"role": "user", "content": [
        {"type": "text", "text": "the cat"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(CAT)}}]}])
    want = local_answer("tiny-gemma3v.gguf", "gemma3", [{"role": "user", "content": "the cat" + IMAGE}], [CAT])
    assert out.choices[0].message.content == text_of("tiny-gemma3v.gguf", want)


@pytest.mark.parametrize("worker, model_file, proj, rows", [("qwen", "tiny-qwen25vl.gguf", "qwen25vl", 77),
                                                            ("qwen3", "tiny-qwen3vl.gguf", "qwen3vl", 54)])
def test_qwen_vl_image_through_chunked_prefill_matches_the_engine(served, worker, model_file, proj, rows):
    """Qwen2.5-VL's and Qwen3-VL's rows are placed by M-RoPE (an image of 11×7 rows takes 11
    positions; Qwen3-VL's carry deepstack slices): the worker prefills in chunks of 7, so chunks end
    inside the image and the positions carry across them; the follow-up turn reuses the cached
    prefix, the image's rows included."""
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120)
    large = (VISION / "large.png").read_bytes()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(large)}}
    want = local_answer(model_file, proj, [{"role": "user", "content": IMAGE + "the cat"}], [large])
    for _ in range(2):
        out = client.chat.completions.create(model=worker, max_tokens=N, temperature=0, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "the cat"}]}])
        assert out.choices[0].message.content == text_of(model_file, want)
        assert out.usage.prompt_tokens > rows
    status, props = http_json(served, "GET", f"/props?model={worker}")
    assert status == 200 and props["modalities"]["vision"] is True, props


def test_capabilities_say_vision(served):
    assert http_json(served, "GET", "/props?model=vlm")[1]["modalities"]["vision"] is True
    assert http_json(served, "GET", "/props?model=text")[1]["modalities"]["vision"] is False
    status, show = http_json(served, "POST", "/api/show", {"model": "vlm"})
    assert status == 200 and "vision" in show["capabilities"], show


def huge_png() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("part, field, message", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(b"not an image")}},
     "messages[0].content[1]", "not an image Kiln reads"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(huge_png())}},
     "messages[0].content[1]", "9000×9000 pixels is over the 50 megapixel limit"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "messages[0].content[1].image_url.url",
     "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}, "messages[0].content[1].image_url.url",
     "not a public address"),                      # server.fetch_images is on: never loopback
    ({"type": "image_url", "image_url": {"url": "data:text/html;base64," + b64(CAT)}},
     "messages[0].content[1].image_url.url", "not an image"),
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[1]", "a content part must be"),
])
def test_a_bad_image_is_a_400_naming_the_field(served, part, field, message):
    before = {w["name"]: w["pid"] for w in served.status()["workers"]}
    status, out = http_json(served, "POST", "/v1/chat/completions", {"model": "vlm", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
    assert status == 400 and out["error"]["param"] == field and message in out["error"]["message"], out
    assert {w["name"]: w["pid"] for w in served.status()["workers"]}["vlm"] == before["vlm"]


def test_a_text_model_refuses_images_saying_why(served):
    status, out = http_json(served, "POST", "/api/chat", {"model": "text", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [b64(CAT)]}]})
    assert status == 400 and "has no vision projector" in out["error"], out


def test_a_raw_prompt_takes_no_images_and_markers_must_match(served):
    status, out = http_json(served, "POST", "/api/generate", {"model": "vlm", "prompt": "x", "raw": True,
                                                              "images": [b64(CAT)], "stream": False})
    assert status == 400 and "raw prompt takes no images" in out["error"], out
    status, out = http_json(served, "POST", "/completion", {"model": "vlm", "prompt": {
        "prompt_string": "no marker", "multimodal_data": [b64(CAT)]}})
    assert status == 400 and out["error"]["param"] == "prompt.multimodal_data", out
