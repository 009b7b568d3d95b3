// Kiln's chat page: conversations kept by the daemon (/v1/sessions — `kiln chat --session` ones
// too), answers streamed from /v1/chat/completions and rendered as markdown. Everything a model
// wrote goes through DOMPurify before it reaches the page; the user's own text is shown as text.
"use strict";

const DEFAULTS = { temperature: null, top_p: null, max_tokens: null };
const FORM = ["#name", "#system", "#model", "#adapter", ...Object.keys(DEFAULTS).map((k) => `#${k}`)];   // what render() fills
let current = null;              // {name, title, model, params, messages, branched_from, saved}
let controller = null;           // aborts the answer being streamed
let models = [];
let pending = [];                // images attached to the message being written (data: URIs)
let sees = false;                // whether the selected model takes images (its capabilities)

const stamp = () => `chat-${new Date().toISOString().slice(0, 19).replace(/[-:]/g, "").replace("T", "-")}`;
const visible = (m) => m.role !== "system";

// Model text is untrusted: marked makes HTML of it, DOMPurify keeps only inert markup — and no
// images or media, which would fetch a URL the text chose (a reply could leak the conversation
// through an image's address); links open apart, with no referrer.
const PURIFY = { FORBID_TAGS: ["img", "picture", "source", "video", "audio", "svg", "math", "style", "form", "input",
                               "button", "textarea", "select", "iframe", "object", "embed"], FORBID_ATTR: ["style"] };
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
});

function markdown(text) {
  const html = DOMPurify.sanitize(marked.parse(text || "", { gfm: true, breaks: true }), PURIFY);
  const box = el("div", { class: "md" });
  box.innerHTML = html;
  for (const pre of box.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const lang = code && [...code.classList].find((c) => c.startsWith("language-"));
    const bar = el("div", { class: "code-bar" }, el("span", { class: "muted" }, lang ? lang.slice(9) : "code"),
      el("button", { type: "button", class: "copy", "aria-label": "Copy code", onclick: (ev) => copy(ev.target, (code || pre).textContent) }, "Copy"));
    pre.before(bar);
  }
  return box;
}

async function copy(button, text) {
  try { await navigator.clipboard.writeText(text); button.textContent = "Copied"; }
  catch (e) { button.textContent = "Copy failed"; }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// A message's content: a string, or OpenAI's parts (text and image_url ones, the images the
// user attached — their own data: URIs, shown as such; never an address a text chose).
const textOf = (content) => (Array.isArray(content) ? content.filter((p) => p.type === "text").map((p) => p.text).join("") : content || "");
const imagesOf = (content) => (Array.isArray(content) ? content.filter((p) => p.type === "image_url").map((p) => p.image_url.url)
  .filter((u) => typeof u === "string" && /^data:image\/(png|jpeg|webp|gif|bmp);base64,/.test(u)) : []);

function messageView(m, i) {
  const body = el("div", { class: "body" });
  if (m.role === "assistant") {
    if (m.reasoning) body.append(el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"), markdown(m.reasoning)));
    for (const call of m.tool_calls || []) {
      const f = call.function || {};
      body.append(el("details", { class: "tool-call" }, el("summary", {}, `Tool call: ${f.name || "?"}`),
        el("pre", {}, typeof f.arguments === "string" ? f.arguments : JSON.stringify(f.arguments, null, 2))));
    }
    body.append(markdown(m.content));
  } else {
    body.append(el("div", { class: "text" }, textOf(m.content)));
    const pics = imagesOf(m.content);
    if (pics.length) body.append(el("div", { class: "images" }, ...pics.map((u, k) => el("img", { src: u, alt: `image ${k + 1}` }))));
  }
  const s = m.stats || {};
  const info = s.completion_tokens ? `${s.completion_tokens} tokens${s.tok_s ? ` · ${s.tok_s.toFixed(1)} tok/s` : ""}${s.stopped ? " · stopped" : ""}` : "";
  return el("article", { class: `msg ${m.role}`, "data-index": i },
    el("header", {}, el("strong", {}, m.role === "user" ? "You" : m.role === "assistant" ? "Assistant" : m.role),
      el("span", { class: "muted" }, info),
      el("button", { type: "button", class: "branch", title: "A new conversation with the messages up to here",
                     "aria-label": `Branch at message ${i + 1}`, onclick: () => branch(i) }, "Branch")),
    body);
}

function render() {
  const t = $("#transcript");
  t.replaceChildren(...current.messages.map((m, i) => [m, i]).filter(([m]) => visible(m)).map(([m, i]) => messageView(m, i)));
  if (!current.messages.some(visible)) t.append(el("p", { class: "muted empty" }, "Say something to start. Conversations are kept by the daemon."));
  t.scrollTop = t.scrollHeight;
  $("#name").value = current.name;
  const sys = current.messages[0] && current.messages[0].role === "system" ? current.messages[0].content : "";
  $("#system").value = sys;
  for (const k of Object.keys(DEFAULTS)) $(`#${k}`).value = current.params[k] ?? "";
  if (current.model && ![...$("#model").options].some((o) => o.value === current.model)) $("#model").append(el("option", {}, current.model));
  $("#model").value = current.model || $("#model").value;
  if (current.adapter && ![...$("#adapter").options].some((o) => o.value === current.adapter)) $("#adapter").append(el("option", {}, current.adapter));
  $("#adapter").value = current.adapter || "";
  $("#summary").textContent = `${current.model || "default model"}${current.adapter ? ` + ${current.adapter}` : ""}${sys ? " · system prompt" : ""}`;
  const last = current.messages[current.messages.length - 1];
  $("#regenerate").disabled = !!controller || !last || !["assistant", "user"].includes(last.role);
  for (const b of ["#rename", "#export", "#delete"]) $(b).disabled = !current.saved;
  for (const li of $("#list").children) li.classList.toggle("active", li.dataset.name === current.name);
}

let listAsked = 0;   // the latest list request: an older answer arriving after it is dropped

async function loadList() {
  const q = $("#search").value.trim();
  const asked = ++listAsked;
  let answer;
  try {
    answer = await json(`/v1/sessions${q ? `?q=${encodeURIComponent(q)}` : ""}`);
  } catch (e) {       // a busy or restarting daemon: say so and ask again, or the list stays the old one
    if (asked === listAsked) { $("#conn").textContent = `conversations: ${e.message}; retrying`; setTimeout(loadList, 1000); }
    return;
  }
  if (asked !== listAsked) return;   // a later search (or save) asked since: its list wins
  if ($("#conn").textContent.startsWith("conversations:")) $("#conn").textContent = "";
  const data = answer.data.filter((x) => !x.error).sort((a, b) => (b.updated || 0) - (a.updated || 0));
  $("#list").replaceChildren(...data.map((x) => el("li", { "data-name": x.name, class: current && x.name === current.name ? "active" : "" },
    el("button", { type: "button", onclick: () => open(x.name) }, el("span", { class: "title" }, x.title || x.name),
      el("span", { class: "muted" }, `${x.model || ""}${x.turns != null ? ` · ${x.turns} turns` : ""}`)))));
  if (!data.length) $("#list").append(el("li", { class: "muted" }, q ? "No conversation matches." : "No conversations yet."));
  // the box says something else than this list was asked for (typed while the page started, before
  // its first list came): ask again, so the list shown is always the box's
  if ($("#search").value.trim() !== q) setTimeout(loadList, 0);
}

async function open(name) {
  // the boxes render() fills are the one being opened's only once it has come: typed into before
  // (a slow daemon), what was typed would be overwritten — a rename silently not made, a setting
  // saved into the conversation left behind
  for (const id of FORM) $(id).disabled = true;
  try {
    const doc = await json(`/v1/sessions/${encodeURIComponent(name)}`);
    current = { name, title: doc.title || "", model: doc.model || "", adapter: doc.adapter || "", params: Object.assign({}, DEFAULTS, doc.params || {}),
                messages: doc.messages || [], branched_from: doc.branched_from || null, saved: true };
    localStorage.setItem("kiln-chat", name);
    render();
  } finally {
    for (const id of FORM) $(id).disabled = false;
  }
  checkVision();
}

function newChat(focus = true) {
  current = { name: stamp(), title: "", model: $("#model").value || "", adapter: "", params: Object.assign({}, DEFAULTS), messages: [], saved: false };
  localStorage.removeItem("kiln-chat");
  render();
  checkVision();
  if (focus) $("#message").focus();
}

async function save() {
  const doc = { messages: current.messages, model: current.model || undefined, adapter: current.adapter || undefined, params: current.params,
                title: current.title || undefined, branched_from: current.branched_from || undefined };
  await json(`/v1/sessions/${encodeURIComponent(current.name)}`, { method: "PUT", body: doc });
  current.saved = true;
  localStorage.setItem("kiln-chat", current.name);
  await loadList();
  render();
}

function unique(base, taken) {
  let n = 1, name = base;
  while (taken.has(name)) name = `${base}-${++n}`;
  return name;
}

async function branch(i) {
  const names = new Set((await json("/v1/sessions")).data.map((x) => x.name));
  current = { name: unique(`${current.name}-branch`, names), title: current.title ? `${current.title} (branch)` : "",
              model: current.model, adapter: current.adapter, params: Object.assign({}, current.params), messages: current.messages.slice(0, i + 1),
              branched_from: { name: current.name, at: i }, saved: false };
  await save();
}

// -- answering -------------------------------------------------------------------------------

function request() {
  const body = { messages: current.messages.map((m) => ({ role: m.role, content: Array.isArray(m.content) ? m.content : m.content || "",
    ...(m.tool_calls ? { tool_calls: m.tool_calls } : {}), ...(m.tool_call_id ? { tool_call_id: m.tool_call_id } : {}) })),
    stream: true, stream_options: { include_usage: true } };
  if (current.model) body.model = current.model;
  if (current.adapter) body.adapter = current.adapter;
  for (const [k, v] of Object.entries(current.params)) if (v !== null && v !== "" && v !== undefined) body[k] = Number(v);
  return body;
}

async function answer() {
  const m = { role: "assistant", content: "", reasoning: "", stats: {} };
  current.messages.push(m);
  const view = messageView(m, current.messages.length - 1);
  $(".empty") && $(".empty").remove();
  $("#transcript").append(view);
  controller = new AbortController();
  $("#send").disabled = true; $("#stop").disabled = false; $("#regenerate").disabled = true;
  let first = null, pieces = 0, drawn = 0, usage = null, served = "";
  let live = view;
  const redraw = () => { const v = messageView(m, current.messages.length - 1); live.replaceWith(v); live = v;
                         $("#transcript").scrollTop = $("#transcript").scrollHeight; drawn = performance.now(); };
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: request(), signal: controller.signal });
    if (!r.ok) { const e = await r.json().catch(() => ({})); throw new Error((e.error && e.error.message) || r.statusText); }
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      served = ev.model || served;
      if (ev.usage) usage = ev.usage;
      for (const ch of ev.choices || []) {
        const d = ch.delta || {};
        if (d.content) m.content += d.content;
        if (d.reasoning_content) m.reasoning += d.reasoning_content;
        for (const tc of d.tool_calls || []) {
          m.tool_calls = m.tool_calls || [];
          const at = m.tool_calls[tc.index ?? m.tool_calls.length] ||= { id: tc.id, type: "function", function: { name: "", arguments: "" } };
          if (tc.function && tc.function.name) at.function.name += tc.function.name;
          if (tc.function && tc.function.arguments) at.function.arguments += tc.function.arguments;
        }
        if (d.content || d.reasoning_content) { first = first || performance.now(); pieces += 1; }
      }
      const s = first ? (performance.now() - first) / 1000 : 0;
      $("#status").textContent = pieces ? `${pieces} tokens · ${s > 0 ? (pieces / s).toFixed(1) : "–"} tok/s` : "waiting for the first token…";
      if (performance.now() - drawn > 80) redraw();          // markdown re-rendered a few times a second
    }
  } catch (e) {
    if (e.name === "AbortError") m.stats.stopped = true;
    else { m.content = m.content || ""; m.error = e.message; }
  } finally {
    controller = null;
    $("#send").disabled = false; $("#stop").disabled = true;
  }
  if (m.error) {
    current.messages.pop();
    live.replaceWith(el("p", { class: "error", role: "alert" }, `error: ${m.error}`));
    delete m.error;
    render();
    return;
  }
  const secs = first ? (performance.now() - first) / 1000 : 0;
  m.stats.completion_tokens = usage ? usage.completion_tokens : pieces;
  if (usage) m.stats.prompt_tokens = usage.prompt_tokens;
  if (secs > 0) m.stats.tok_s = m.stats.completion_tokens / secs;
  if (!m.reasoning) delete m.reasoning;
  if (!current.title) current.title = textOf((current.messages.find((x) => x.role === "user") || {}).content).slice(0, 60);
  await save();
  showContext(served, usage);
}

async function showContext(served, usage) {
  let text = usage ? `${usage.completion_tokens} tokens` : "";
  try {
    const loaded = (await json("/v1/ps")).models.find((x) => x.model === served || x.worker === served) || {};
    if (usage && loaded.n_ctx) text += ` · context ${usage.prompt_tokens + usage.completion_tokens} of ${loaded.n_ctx.toLocaleString()}`;
  } catch (e) { /* the figure is a nicety: the answer stands without it */ }
  $("#status").textContent = text;
}

$("#composer").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("#message").value.trim();
  if ((!text && !pending.length) || controller) return;
  $("#message").value = "";
  const content = pending.length ? [...(text ? [{ type: "text", text }] : []),
    ...pending.map((url) => ({ type: "image_url", image_url: { url } }))] : text;
  pending = [];
  showPending();
  current.messages.push({ role: "user", content });
  render();
  await answer();
});

$("#regenerate").addEventListener("click", async () => {
  if (controller) return;
  if (current.messages[current.messages.length - 1].role === "assistant") current.messages.pop();
  render();
  await answer();
});

// -- the conversation's settings, list and files ---------------------------------------------

function settingChanged() {
  current.model = $("#model").value;
  current.adapter = $("#adapter").value;
  const sys = $("#system").value;
  const has = current.messages[0] && current.messages[0].role === "system";
  if (sys && has) current.messages[0].content = sys;
  else if (sys) current.messages.unshift({ role: "system", content: sys });
  else if (has) current.messages.shift();
  for (const k of Object.keys(DEFAULTS)) current.params[k] = $(`#${k}`).value === "" ? null : Number($(`#${k}`).value);
  checkVision();
  if (current.saved) save().catch((e) => { $("#status").textContent = `not saved: ${e.message}`; });
  else render();
}
for (const id of ["#model", "#adapter", "#system", "#temperature", "#top_p", "#max_tokens"]) $(id).addEventListener("change", settingChanged);

$("#rename").addEventListener("click", async () => {
  const to = $("#name").value.trim();
  if (!to || to === current.name) return;
  try {
    await json(`/v1/sessions/${encodeURIComponent(current.name)}/rename`, { method: "POST", body: { to } });
    await open(to);
    await loadList();
  } catch (e) { $("#status").textContent = `rename: ${e.message}`; }
});

$("#delete").addEventListener("click", async () => {
  if (!confirm(`Delete the conversation ${current.name}?`)) return;
  await json(`/v1/sessions/${encodeURIComponent(current.name)}`, { method: "DELETE" });
  newChat();
  await loadList();
});

$("#export").addEventListener("click", async () => {
  const doc = await json(`/v1/sessions/${encodeURIComponent(current.name)}`);
  const a = el("a", { href: URL.createObjectURL(new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" })),
                      download: `${current.name}.json` });
  a.click();
  URL.revokeObjectURL(a.href);
});

$("#import-file").addEventListener("change", async (ev) => {
  const file = ev.target.files[0];
  ev.target.value = "";
  if (!file) return;
  try {
    const doc = JSON.parse(await file.text());
    const names = new Set((await json("/v1/sessions")).data.map((x) => x.name));
    const base = String(doc.name || file.name.replace(/\.json$/i, "")).replace(/[^A-Za-z0-9_.-]/g, "-").replace(/^[^A-Za-z0-9]+/, "") || stamp();
    const name = unique(base.slice(0, 56), names);
    delete doc.name; delete doc.updated;
    await json(`/v1/sessions/${encodeURIComponent(name)}`, { method: "PUT", body: doc });
    await loadList();
    await open(name);
  } catch (e) { $("#status").textContent = `import: ${e.message}`; }
});

// -- images: attached when the model sees them (its capabilities say "vision") ---------------------

async function checkVision() {
  const model = $("#model").value;
  let caps = [];
  try { caps = model ? (await json("/api/show", { method: "POST", body: { model } })).capabilities || [] : []; }
  catch (e) { /* a model the server cannot describe: no images */ }
  if (model !== $("#model").value) return;          // the choice changed while we asked
  sees = caps.includes("vision");
  $("#attach").disabled = !sees;
  $("#attach").dataset.checked = model;             // what the button says now is about this model
  $("#attach").title = sees ? "Attach an image (PNG, JPEG, WebP, GIF, BMP)" : "This model does not see images";
  if (!sees && pending.length) { pending = []; showPending(); }
}

function showPending() {
  $("#attached").replaceChildren(...pending.map((u, k) => el("span", {}, el("img", { src: u, alt: `attached image ${k + 1}` }),
    el("button", { type: "button", "aria-label": `Remove image ${k + 1}`, onclick: () => { pending.splice(k, 1); showPending(); } }, "×"))));
}

$("#attach").addEventListener("click", () => $("#attach-file").click());
$("#attach-file").addEventListener("change", async (ev) => {
  const files = [...ev.target.files];
  ev.target.value = "";
  for (const f of files) {
    if (!/^image\/(png|jpeg|webp|gif|bmp)$/.test(f.type)) { $("#status").textContent = `${f.name}: not an image the model reads`; continue; }
    pending.push(await new Promise((ok, fail) => { const r = new FileReader(); r.onload = () => ok(r.result); r.onerror = fail; r.readAsDataURL(f); }));
  }
  showPending();
});

let searching = null;
$("#search").addEventListener("input", () => { clearTimeout(searching); searching = setTimeout(loadList, 200); });
$("#new").addEventListener("click", () => newChat());
$("#stop").addEventListener("click", () => controller && controller.abort());

document.addEventListener("keydown", (ev) => {
  const typing = ["TEXTAREA", "INPUT", "SELECT"].includes(document.activeElement.tagName);
  if (ev.key === "Escape" && controller) { ev.preventDefault(); controller.abort(); }
  else if (ev.altKey && ev.key.toLowerCase() === "n") { ev.preventDefault(); newChat(); }
  else if (ev.altKey && ev.key.toLowerCase() === "r") { ev.preventDefault(); $("#regenerate").click(); }
  else if (ev.key === "/" && !typing) { ev.preventDefault(); $("#search").focus(); }
});
$("#message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#composer").requestSubmit(); }
});

async function start() {
  try {
    models = (await json("/v1/models")).data.map((m) => m.id);
    $("#model").replaceChildren(...models.map((id) => el("option", { value: id }, id)));
    const adapters = (await json("/v1/adapters")).data.map((x) => x.name);
    $("#adapter").replaceChildren(el("option", { value: "" }, "none"), ...adapters.map((n) => el("option", { value: n }, n)));
    await loadList();
    const last = localStorage.getItem("kiln-chat");
    // the composer takes the focus only if the user has not put it somewhere while the page loaded:
    // moving it mid-typing sent the rest of a search into the message box
    if (last && $(`#list li[data-name="${CSS.escape(last)}"]`)) await open(last); else newChat(document.activeElement === document.body);
    $("#conn").textContent = "";
  } catch (e) { $("#conn").textContent = `error: ${e.message}`; }
}
onKey = start;
start();
