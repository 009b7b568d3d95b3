"""The chat page (/ui/chat) in a real headless Chromium against a real daemon: a conversation is
answered, kept by the daemon across a reload and a daemon restart; a code block in an answer
renders with a copy button that copies it; a branch keeps both histories; markup in model text is
inert; conversations are searched, renamed, exported, imported and deleted; no console errors.
Screenshots go to tests/screenshots/ and docs/chat.png."""

import json
import time
import shutil
from pathlib import Path

import pytest

from browser_harness import require_browser, watch
from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SHOTS = Path(__file__).parent / "screenshots"
DOCS = Path(__file__).parent.parent / "docs"
VISION = Path(__file__).parent / "data" / "vision"
require_browser()

from playwright.sync_api import expect  # noqa: E402

HOSTILE = ("Here you go:\n\n```python\nprint('hi')\n```\n\n<script>window.pwned = 1</script>"
           "<img src=x onerror=\"window.pwned = 2\"><a href=\"javascript:window.pwned=3\">link</a>")


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("chat")
    (home / "vision").mkdir()
    for f in ("tiny-smolvlm.gguf", "mmproj-tiny-smolvlm.gguf"):       # a vision model, its mmproj beside it
        shutil.copy(VISION / f, home / "vision" / f)
    d = Daemon(home, {"default": {"kind": "inference", "model": str(default_model_path)},
                      "vlm": {"kind": "inference", "model": str(home / "vision" / "tiny-smolvlm.gguf")}}).start()
    d.wait(lambda st: all(w["worker_state"] == "ready" for w in st["workers"]), timeout=90, what="models loaded")
    yield d
    d.stop()


@pytest.fixture
def page(browser, served):
    ctx = browser.new_context(viewport={"width": 1300, "height": 900})
    ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=served.http)
    pg = watch(ctx.new_page())
    pg.on("dialog", lambda dlg: dlg.accept())
    yield pg
    ctx.close()


def put(served, name, doc):
    status, out = http_json(served, "PUT", f"/v1/sessions/{name}", doc)
    assert status == 200, out
    return out


def set_max_tokens(page, n):
    page.locator("#settings").evaluate("d => { d.open = true; }")
    page.locator("#max_tokens").fill(str(n))
    page.locator("#max_tokens").dispatch_event("change")


def ask(page, text):
    page.get_by_label("Message", exact=True).fill(text)
    page.keyboard.press("Enter")
    expect(page.locator("#send")).to_be_enabled(timeout=60_000)      # the answer is whole


def test_a_conversation_is_answered_and_survives_a_reload_and_a_daemon_restart(served, page):
    page.goto(served.http + "/ui/chat")
    page.get_by_role("button", name="New chat").click()
    set_max_tokens(page, 12)
    ask(page, "What is the capital of France?")
    answer = page.locator("article.msg.assistant .md").last
    expect(answer).not_to_be_empty()
    expect(page.locator("#status")).to_contain_text("tokens")          # the answer is whole
    text = answer.inner_text()
    name = page.locator("#name").input_value()
    expect(page.locator(f'#list li[data-name="{name}"]')).to_contain_text("What is the capital of France?")
    page.reload()
    expect(page.locator("article.msg.user .text")).to_have_text("What is the capital of France?")
    assert page.locator("article.msg.assistant .md").last.inner_text() == text
    doc = http_json(served, "GET", f"/v1/sessions/{name}")[1]
    assert doc["params"]["max_tokens"] == 12 and doc["messages"][-1]["stats"]["completion_tokens"] > 0
    expect(page.locator("#attach[data-checked]")).to_have_count(1)     # nothing in flight when the daemon stops
    served.stop()
    served.start()
    served.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model loaded")
    page.goto(served.http + "/ui/chat")
    page.locator(f'#list li[data-name="{name}"] button').click()
    assert page.locator("article.msg.assistant .md").last.inner_text() == text
    page.screenshot(path=str(DOCS / "chat.png"))
    assert not page.errors, page.errors


def test_model_text_renders_as_markdown_its_code_copies_and_its_markup_is_inert(served, page):
    put(served, "rendered", {"title": "rendering", "messages": [
        {"role": "user", "content": "<b>not bold</b> and `not code`"},
        {"role": "assistant", "content": HOSTILE, "reasoning": "Thinking about **it**."}]})
    page.goto(served.http + "/ui/chat")
    page.locator('#list li[data-name="rendered"] button').click()
    msg = page.locator("article.msg.assistant")
    expect(msg.locator("pre code")).to_have_text("print('hi')")
    expect(msg.locator("details.reasoning")).not_to_have_attribute("open", "")
    expect(msg.locator("details.reasoning strong")).to_have_text("it")         # folded, rendered
    assert page.evaluate("window.pwned") is None
    assert msg.locator("script").count() == 0 and msg.locator("img").count() == 0     # no URL fetched for it
    assert msg.locator('a[href^="javascript:"]').count() == 0
    expect(page.locator("article.msg.user .text")).to_have_text("<b>not bold</b> and `not code`")   # the user's text is text
    msg.get_by_role("button", name="Copy code").click()
    expect(msg.get_by_role("button", name="Copy code")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi')\n"
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat-rendered.png"))
    assert not page.errors, page.errors


def test_a_branch_keeps_both_histories(served, page):
    put(served, "trunk", {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "first answer"},
                                       {"role": "user", "content": "two"}, {"role": "assistant", "content": "second answer"}]})
    page.goto(served.http + "/ui/chat")
    page.locator('#list li[data-name="trunk"] button').click()
    page.get_by_role("button", name="Branch at message 2").click()
    expect(page.locator("#name")).to_have_value("trunk-branch")
    expect(page.locator("article.msg")).to_have_count(2)
    set_max_tokens(page, 4)
    ask(page, "something else")
    branch = http_json(served, "GET", "/v1/sessions/trunk-branch")[1]
    trunk = http_json(served, "GET", "/v1/sessions/trunk")[1]
    assert [m["content"] for m in branch["messages"][:3]] == ["one", "first answer", "something else"]
    assert branch["branched_from"] == {"name": "trunk", "at": 1} and len(branch["messages"]) == 4
    assert [m["content"] for m in trunk["messages"]] == ["one", "first answer", "two", "second answer"]
    assert not page.errors, page.errors


def test_search_rename_export_import_and_delete(served, page, tmp_path):
    put(served, "findme", {"messages": [{"role": "user", "content": "a question about zeppelins"}]})
    # the user types while the page still loads (its adapters held back): when the page is ready it
    # must leave the focus where the user put it — moving it sent the rest of a search into the composer
    held = []
    page.route("**/v1/adapters", lambda route: held.append(route))
    page.goto(served.http + "/ui/chat")
    page.get_by_placeholder("Search conversations (/)").fill("zepp")
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(20)
    held[0].continue_()
    expect(page.locator("#name")).not_to_have_value("")              # ready: a new chat is open
    page.keyboard.type("elin")
    expect(page.locator("#search")).to_have_value("zeppelin")
    expect(page.locator("#message")).to_have_value("")
    expect(page.locator("#list li")).to_have_count(1)
    # a slow daemon: while the chosen conversation comes, the boxes it fills take no typing (what
    # was typed would be overwritten when it came: the rename silently not made)
    opening = []
    page.route("**/v1/sessions/findme", lambda route: opening.append(route))
    page.locator('#list li[data-name="findme"] button').click()
    page.locator("#settings summary").click()
    deadline = time.monotonic() + 10
    while not opening and time.monotonic() < deadline:
        page.wait_for_timeout(20)
    for box in ("#name", "#system", "#model", "#temperature"):
        expect(page.locator(box)).to_be_disabled()
    page.unroute("**/v1/sessions/findme")
    opening[0].continue_()
    expect(page.locator("#name")).to_have_value("findme")
    page.locator("#name").fill("airships")
    page.get_by_role("button", name="Rename").click()
    expect(page.locator('#list li[data-name="airships"]')).to_have_count(1)
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export").click()
    exported = tmp_path / "airships.json"
    dl.value.save_as(exported)
    assert json.loads(exported.read_text())["messages"][0]["content"] == "a question about zeppelins"
    page.locator("#import-file").set_input_files(str(exported))
    expect(page.locator("#name")).to_have_value("airships-2")
    page.get_by_role("button", name="Delete").click()                           # confirm() accepted
    expect(page.locator('#list li[data-name="airships-2"]')).to_have_count(0)
    names = [x["name"] for x in http_json(served, "GET", "/v1/sessions")[1]["data"]]
    assert "airships" in names and "airships-2" not in names and "findme" not in names
    assert not page.errors, page.errors


def test_an_image_attaches_when_the_model_sees_images(served, page):
    page.goto(served.http + "/ui/chat")
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#attach")).to_be_disabled()                   # the default model reads text only
    page.locator("#settings").evaluate("d => { d.open = true; }")
    page.locator("#model").select_option("vlm")
    expect(page.locator("#attach")).to_be_enabled()
    set_max_tokens(page, 4)
    page.locator("#attach-file").set_input_files(str(VISION / "cat.png"))
    expect(page.locator("#attached img")).to_have_count(1)
    ask(page, "What is in the picture?")
    expect(page.locator("article.msg.user .images img")).to_have_count(1)
    expect(page.locator("#attached img")).to_have_count(0)              # sent: the composer is clear
    name = page.locator("#name").input_value()
    expect(page.locator(f'#list li[data-name="{name}"]')).to_have_count(1)       # answered and saved
    doc = http_json(served, "GET", f"/v1/sessions/{name}")[1]
    user = doc["messages"][0]
    assert doc["model"] == "vlm" and user["content"][0] == {"type": "text", "text": "What is in the picture?"}
    assert user["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert doc["messages"][1]["role"] == "assistant" and doc["messages"][1]["stats"]["prompt_tokens"] > 20
    page.reload()
    expect(page.locator("article.msg.user .images img")).to_have_count(1)
    page.screenshot(path=str(SHOTS / "chat-image.png"))


def test_the_sessions_api_refuses_what_it_cannot_keep(served):
    for doc, words in (({"messages": "hi"}, "messages must be a list"),
                       ({"messages": [], "colour": "red"}, "unsupported field 'colour'"),
                       ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0] must be"),
                       ({"messages": [{"role": "user", "content": "x", "html": "<b>"}]}, "unsupported field 'html'"),
                       ({"messages": [], "name": "other"}, "the URL names 'ok'"),
                       # images only as data: URIs: a session never holds an address the page would fetch
                       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                           "url": "http://169.254.169.254/x.png"}}]}]}, "data:image/"),
                       ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "onload": "y"}]}]},
                        "messages[0] must be"),
                       ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
                        "messages[0] must be")):
        status, out = http_json(served, "PUT", "/v1/sessions/ok", doc)
        assert status == 400 and words in out["error"]["message"], (doc, out)
    status, out = http_json(served, "PUT", "/v1/sessions/..%2Fescape", {"messages": []})
    assert status in (400, 404), out
    assert http_json(served, "GET", "/v1/sessions/nope")[0] == 404
