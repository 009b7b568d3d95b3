// What Kiln's pages share: the DOM helper, the API client (the API key kept in this tab only,
// asked for on a 401), and the server-sent events reader. Plain JavaScript, no build step.
"use strict";

const $ = (s) => document.querySelector(s);
let apiKey = sessionStorage.getItem("kiln-key") || "";

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v != null) e.setAttribute(k, v);          // null: no attribute (disabled: null is enabled)
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

// the form both pages show when the server asks for its API key, after the page's header
document.querySelector("header").after(el("form", { id: "keyform", hidden: "" },
  el("label", { for: "apikey" }, "API key"), " ", el("input", { id: "apikey", type: "password", autocomplete: "off" }), " ",
  el("button", { type: "submit" }, "Use key"), " ", el("span", { id: "keyerror", role: "alert" }), " ",
  el("span", { class: "muted" }, "This server needs its API key (server.api_key); it stays in this tab only.")));

const mib = (n) => (n == null ? "–" : `${(n / 2 ** 20).toFixed(0)} MiB`);
const secs = (s) => (s == null ? "–" : s < 90 ? `${s.toFixed(0)} s` : s < 5400 ? `${(s / 60).toFixed(0)} min` : `${(s / 3600).toFixed(1)} h`);

async function api(path, opts = {}) {
  const sentWith = apiKey;       // a 401 is about the key it was sent with, not the one we hold now
  const headers = Object.assign({}, opts.headers || {});
  if (sentWith) headers["Authorization"] = `Bearer ${sentWith}`;
  if (opts.body && typeof opts.body !== "string") { headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(opts.body); }
  const r = await fetch(path, Object.assign({}, opts, { headers }));
  if (r.status === 401) {
    // sent before the user gave the current key (the first refresh, a poll, the event stream):
    // again with it — only a refusal of the key we hold asks for it again
    if (apiKey && apiKey !== sentWith) return api(path, opts);
    askKey(sentWith ? "The server refused this key." : "");
    throw new Error("this server needs its API key");
  }
  return r;
}

async function json(path, opts) {
  const r = await api(path, opts);
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || `${r.status} ${r.statusText}`);
  return body;
}

function askKey(why) {
  const f = $("#keyform");
  $("#keyerror").textContent = why || "";
  if (!f.hidden) return;
  f.hidden = false;
  $("#apikey").focus();
}

// a page sets onKey to re-read what it shows once the user gave the key
let onKey = () => {};
$("#keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("#apikey").value.trim();
  sessionStorage.setItem("kiln-key", apiKey);
  $("#keyform").hidden = true;
  onKey();
});

async function* sseEvents(response) {
  const reader = response.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

