"""Image URLs (server.fetch_images): only public addresses are fetched — loopback, private,
link-local (cloud metadata) and IPv6 loopback refused before any connection, the address checked
is the one connected to, no redirect followed, the body bounded — and with the setting off, a
URL is a 400 saying to send the bytes. A real HTTP server on loopback stands in for the internet
(the address check told to let it through)."""

import http.server
import threading

import pytest

from conftest import DATA
from kiln.supervisor.http.common import JSONError
from kiln.supervisor.http.images import url_image
from kiln.supervisor.http.remote import FetchError, fetch_public

CAT = (DATA / "vision" / "cat.png").read_bytes()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
            return
        body = CAT if self.path == "/cat.png" else b"x" * 5000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{s.server_address[1]}"
    s.shutdown()


def anywhere(addr) -> bool:
    return True


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/x.png", "http://localhost/x.png", "http://[::1]/x.png",
                                 "http://10.1.2.3/x.png", "http://192.168.0.1/x.png", "http://169.254.169.254/latest",
                                 "https://100.64.0.1/x.png", "http://0.0.0.0/x.png"])
def test_non_public_addresses_are_refused_before_connecting(url):
    with pytest.raises(FetchError, match="not a public address"):
        fetch_public(url, 1 << 20)


def test_a_public_address_is_fetched_from_the_address_checked(server):
    assert fetch_public(server + "/cat.png", 1 << 20, allowed=anywhere) == CAT


def test_redirects_are_not_followed_and_bodies_are_bounded(server):
    with pytest.raises(FetchError, match="302.*redirects are not followed"):
        fetch_public(server + "/moved", 1 << 20, allowed=anywhere)
    with pytest.raises(FetchError, match="5000 bytes, over the"):
        fetch_public(server + "/big", 4096, allowed=anywhere)


@pytest.mark.parametrize("url, message", [("ftp://example.com/x.png", "only http"),
                                          ("http://user:pw@example.com/x.png", "credentials")])
def test_other_urls_are_refused(url, message):
    with pytest.raises(FetchError, match=message):
        fetch_public(url, 1 << 20)


def test_with_fetching_off_a_url_is_a_400_saying_to_send_the_bytes():
    with pytest.raises(JSONError) as e:
        url_image("https://example.com/cat.png", "messages[0].content[0].image_url.url")
    text = str(e.value.kiln_body)
    assert "server.fetch_images is off" in text and "data: URI" in text
