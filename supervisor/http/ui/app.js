// Kiln's dashboard: plain JavaScript over Kiln's own HTTP API, no build step, no CDN.
// Live state comes from the event stream (/v1/events); each event re-reads what it touches,
// and a slow poll refreshes the figures that change without events (RSS, CPU, KV use).
"use strict";

const history = [];              // the chat so far: [{role, content}]
let controller = null;           // aborts the answer being streamed
onKey = () => { refreshAll(); followEvents(); };

// -- workers ---------------------------------------------------------------------------------

function workerRow(w) {
  const state = w.state + (w.worker_state ? ` / ${w.worker_state}` : "");
  const exit = w.last_exit ? (w.last_exit.signal ? `signal ${w.last_exit.signal}` : `code ${w.last_exit.code}`) : "–";
  // an action only where it applies (supervisord's): start a stopped or given-up worker, stop
  // one that runs or is coming up, restart any but one already stopping
  const applies = { start: ["stopped", "fatal"].includes(w.state),
                    stop: ["running", "starting", "backoff"].includes(w.state),
                    restart: w.state !== "stopping" };
  const act = (a) => el("button", { type: "button", "aria-label": `${a} ${w.name}`, disabled: applies[a] ? null : "",
                                    onclick: () => workerAction(w.name, a) }, a);
  return el("tr", { "data-worker": w.name },
    el("th", { scope: "row" }, w.name), el("td", {}, w.kind),
    el("td", { class: `state-${w.state}`, "data-state": w.state, title: w.reason || "" }, state),
    el("td", w.node ? { "data-node": w.node, title: `on cluster node ${w.node}` } : {},
       w.pid ?? "–", w.node ? el("small", {}, ` on ${w.node}`) : ""), el("td", {}, secs(w.uptime_s)),
    el("td", { "data-restarts": w.restarts }, w.restarts),
    el("td", { title: (w.last_exit && w.last_exit.reason) || "" }, exit),
    el("td", {}, mib(w.rss_bytes)), el("td", {}, w.cpu_percent == null ? "–" : `${w.cpu_percent.toFixed(0)} %`),
    el("td", {}, act("restart"), " ", act("stop"), " ", act("start")));
}

async function workerAction(name, action) {
  try { await json(`/v1/workers/${encodeURIComponent(name)}/${action}`, { method: "POST" }); }
  catch (e) { note(`${action} ${name}: ${e.message}`); }
  refreshWorkers();
}

let workers = [];
async function refreshWorkers() {
  workers = (await json("/v1/workers")).data;
  $("#workers tbody").replaceChildren(...workers.map(workerRow));
  renderExperts();
}

function renderExperts() {
  const rows = workers.filter((w) => w.stats && w.stats.expert_cache).map((w) => {
    const c = w.stats.expert_cache;
    const memory = `${c.memory ?? "–"}${c.huge_page_bytes ? `, ${mib(c.huge_page_bytes)} in huge pages` : ""}`;
    return el("tr", {}, el("th", { scope: "row" }, w.name), el("td", {}, c.io_mode),
      el("td", { title: c.memory_why ?? "" }, memory),
      el("td", {}, c.hit_rate == null ? "–" : `${(100 * c.hit_rate).toFixed(1)} %`), el("td", {}, c.hits),
      el("td", {}, c.misses), el("td", {}, mib(c.bytes_read)), el("td", { title: c.read_queue_depth == null ? "" :
        `${c.read_queue_depth} reads in flight on average while reading` }, c.read_gb_s ?? "–"),
      el("td", {}, `${c.used}/${c.slots}`));
  });
  $("#experts tbody").replaceChildren(...rows);
  $("#no-experts").hidden = rows.length > 0;
}

// -- models ----------------------------------------------------------------------------------

const plans = new Map();         // model id -> its plan's verdict text (read once)
function planCell(id, loaded) {
  const td = el("td", { "data-plan": id }, loaded ? "loaded" : plans.get(id) || "…");
  if (!loaded && !plans.has(id)) {
    plans.set(id, "…");
    json(`/v1/models/${encodeURIComponent(id)}/plan`).then((p) => {
      const gib = (b) => (b / 2 ** 30).toFixed(2);
      plans.set(id, `${p.verdict} (${gib(p.total_bytes)} of ${gib(p.budget_left_bytes)} GiB left)`);
      const cell = document.querySelector(`td[data-plan="${CSS.escape(id)}"]`);
      if (cell) { cell.textContent = plans.get(id); cell.title = p.advice || ""; }
    }).catch((e) => plans.set(id, `unknown: ${e.message}`));
  }
  return td;
}

async function refreshModels() {
  const [models, ps] = await Promise.all([json("/v1/models"), json("/v1/ps")]);
  const loaded = new Map(ps.models.map((m) => [m.worker, m]));
  const byModel = new Map(ps.models.map((m) => [m.model, m]));
  if (ps.budget_bytes != null) $("#budget").textContent = `Memory: ${mib(ps.used_bytes)} of a ${mib(ps.budget_bytes)} budget` +
    (ps.active_model ? ` · default model: ${ps.active_model}` : "");
  const rows = models.data.map((m) => {
    const l = loaded.get(m.id) || byModel.get(m.id);
    const until = !l ? "–" : l.pinned ? "pinned" : l.unloading ? "unloading" : l.expires_at ? secs(l.expires_at - Date.now() / 1000) : "kept";
    const btn = l ? el("button", { type: "button", disabled: l.pinned ? "" : null, onclick: () => modelAction(m.id, "unload") }, "unload")
      : el("button", { type: "button", onclick: () => modelAction(m.id, "load") }, "load");
    if (l && l.pinned) btn.disabled = true;
    return el("tr", { "data-model": m.id }, el("th", { scope: "row" }, m.id), el("td", {}, l ? (l.worker_state || l.state) : "no"),
      el("td", {}, l ? l.worker : "–"), el("td", {}, mib(l && l.rss_bytes)), el("td", {}, mib(l && l.planned_bytes)),
      el("td", {}, mib(l && l.kv_cache_bytes)), el("td", { "data-weights": (l && l.weights) || "" }, (l && l.weights) || "–"),
      el("td", {}, until), planCell(m.id, !!l), el("td", {}, btn));
  });
  $("#models tbody").replaceChildren(...rows);
  const pick = $("#model"), keep = pick.value;
  pick.replaceChildren(...models.data.map((m) => el("option", { value: m.id }, m.id + (!m.meta || m.meta.loaded !== false ? "" : m.meta.state ? ` (${m.meta.state})` : " (loads on use)"))));
  if (keep) pick.value = keep;
}

async function modelAction(model, action) {
  try { await json(`/v1/models/${encodeURIComponent(model)}/${action}`, { method: "POST" }); }
  catch (e) { note(`${action} ${model}: ${e.message}`); }
  refreshModels();
}

async function refreshAdapters() {
  const a = await json("/v1/adapters");
  const pick = $("#adapter"), keep = pick.value;
  pick.replaceChildren(el("option", { value: "" }, "none"), ...a.data.map((x) => el("option", { value: x.name }, x.name)));
  pick.value = keep;
}

// -- training and evaluation ---------------------------------------------------------------

function lossCurve(losses) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "loss");
  svg.setAttribute("viewBox", "0 0 300 90");
  svg.setAttribute("role", "img");
  const ys = losses.map((l) => l.loss).filter((v) => typeof v === "number");
  svg.setAttribute("aria-label", ys.length ? `loss from ${ys[0].toFixed(3)} to ${ys[ys.length - 1].toFixed(3)} over ${ys.length} steps` : "no loss yet");
  if (ys.length > 1) {
    const lo = Math.min(...ys), hi = Math.max(...ys), span = hi - lo || 1;
    const pts = ys.map((y, i) => `${(300 * i / (ys.length - 1)).toFixed(1)},${(85 - 80 * (y - lo) / span).toFixed(1)}`).join(" ");
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts); line.setAttribute("fill", "none"); line.setAttribute("stroke", "#b4441c"); line.setAttribute("stroke-width", "1.5");
    svg.append(line);
  }
  return svg;
}

async function refreshTraining() {
  const jobs = (await json("/v1/train/jobs")).data.slice(-5).reverse();
  if (!jobs.length) return;
  const blocks = [];
  for (const j of jobs) {
    const full = await json(`/v1/train/jobs/${encodeURIComponent(j.id)}`);
    const last = full.losses.length ? full.losses[full.losses.length - 1] : null;
    blocks.push(el("div", { class: "job", "data-job": j.id },
      el("div", {}, el("strong", {}, j.id), ` · ${j.state} · adapter ${j.adapter || "–"} · step ${j.step ?? 0}/${j.total_steps ?? "?"}`,
        last ? ` · loss ${last.loss.toFixed(4)}` : ""),
      lossCurve(full.losses)));
  }
  $("#train-jobs").replaceChildren(...blocks);
}

async function refreshEval() {
  const jobs = (await json("/v1/eval/jobs")).data.slice(-8).reverse();
  const rows = [];
  for (const j of jobs) {
    const arms = Object.entries(j.metrics || {});
    if (!arms.length) rows.push(el("tr", {}, el("th", { scope: "row" }, j.id), el("td", {}, j.state), el("td", {}, j.suite || j.spec && j.spec.suite || "–"), el("td", {}, "–"), el("td", {}, "–"), el("td", {}, "–"), el("td", {}, j.done ?? "–")));
    for (const [arm, m] of arms) {
      const ci = m.accuracy_ci95 ? `${(100 * m.accuracy_ci95[0]).toFixed(1)}–${(100 * m.accuracy_ci95[1]).toFixed(1)} %` : "–";
      rows.push(el("tr", {}, el("th", { scope: "row" }, j.id), el("td", {}, j.state), el("td", {}, j.suite || (j.spec && j.spec.suite) || "–"),
        el("td", {}, arm), el("td", {}, `${(100 * m.accuracy).toFixed(1)} %`), el("td", {}, ci), el("td", {}, m.n)));
    }
  }
  $("#evals tbody").replaceChildren(...rows);
}

function openenvRow(r) {
  const ev = r.evaluation;
  const heldOut = ev ? `${ev.base_mean.toFixed(3)} → ${ev.adapter_mean.toFixed(3)} (p ${ev.p_value.toFixed(3)})` : "–";
  // cancel what may still run; resume what a cancel or a failure ended (it goes on from its episodes)
  const act = (a, applies) => el("button", { type: "button", "aria-label": `${a} ${r.id}`, disabled: applies ? null : "",
                                             onclick: () => openenvAction(r.id, a) }, a);
  return el("tr", { "data-run": r.id },
    el("th", { scope: "row" }, r.id), el("td", { "data-state": r.state, title: r.error || r.note || "" }, r.state),
    el("td", {}, r.phase || "–"), el("td", {}, `${r.done ?? 0}/${r.total ?? "?"}`),
    el("td", {}, r.mean_return == null ? "–" : r.mean_return.toFixed(3)), el("td", {}, heldOut),
    el("td", {}, r.spec.env),
    el("td", {}, act("cancel", ["queued", "running"].includes(r.state)), " ",
       act("resume", ["failed", "cancelled"].includes(r.state))));
}

async function openenvAction(id, action) {
  const [path, method] = action === "cancel" ? [`/v1/openenv/runs/${encodeURIComponent(id)}`, "DELETE"]
                                             : [`/v1/openenv/runs/${encodeURIComponent(id)}/resume`, "POST"];
  try { await json(path, { method }); } catch (e) { note(`${action} ${id}: ${e.message}`); }
  refreshOpenEnv();
}

async function refreshOpenEnv() {
  const runs = (await json("/v1/openenv/runs")).data.slice(-8).reverse();
  $("#openenv-runs tbody").replaceChildren(...runs.map(openenvRow));
}

async function refreshSessions() {
  const rows = (await json("/v1/sessions")).data.map((x) => el("tr", { "data-session": x.name },
    el("th", { scope: "row" }, x.name), el("td", {}, x.model || "–"), el("td", {}, x.turns ?? "–"),
    el("td", {}, x.updated ? new Date(x.updated * 1000).toLocaleString() : "–")));
  $("#sessions tbody").replaceChildren(...rows);
}

// -- chat ------------------------------------------------------------------------------------

function say(role, text) {
  const m = el("div", { class: `msg ${role}` }, text);
  $("#transcript").append(m);
  $("#transcript").scrollTop = $("#transcript").scrollHeight;
  return m;
}

$("#chat").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("#message").value.trim();
  if (!text || controller) return;
  $("#message").value = "";
  history.push({ role: "user", content: text });
  say("user", text);
  const out = say("assistant", "");
  controller = new AbortController();
  $("#send").disabled = true; $("#stop").disabled = false;
  const body = { model: $("#model").value || undefined, messages: history, stream: true };
  if ($("#adapter").value) body.adapter = $("#adapter").value;
  let answer = "", tokens = 0, first = null;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
    if (!r.ok) { const e = await r.json().catch(() => ({})); throw new Error((e.error && e.error.message) || r.statusText); }
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const ev = JSON.parse(data);
      if (ev.error) throw new Error(ev.error.message);
      for (const ch of ev.choices || []) {
        const piece = (ch.delta && ch.delta.content) || "";
        if (piece) {
          first = first || performance.now(); tokens += 1; answer += piece; out.textContent = answer;
          $("#transcript").scrollTop = $("#transcript").scrollHeight;
          const s = (performance.now() - first) / 1000;
          if (s > 0) $("#speed").textContent = `${tokens} chunks · ${(tokens / s).toFixed(1)} tok/s`;
        }
      }
    }
    history.push({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name === "AbortError") { history.push({ role: "assistant", content: answer }); out.append(el("span", { class: "muted" }, " [stopped]")); }
    else { out.classList.add("error"); out.textContent = `error: ${e.message}`; history.pop(); }
  } finally {
    controller = null; $("#send").disabled = false; $("#stop").disabled = true;
  }
});

$("#message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("#chat").requestSubmit(); }
});
$("#stop").addEventListener("click", () => controller && controller.abort());
$("#clear").addEventListener("click", () => { history.length = 0; $("#transcript").replaceChildren(); $("#speed").textContent = ""; });

// -- live updates ----------------------------------------------------------------------------

function note(text, ts) {
  // an event's own time (seconds since the epoch), not when the page heard of it; a page
  // message without one is stamped now
  const at = ts ? new Date(ts * 1000) : new Date();
  const list = $("#events");
  list.prepend(el("li", {}, el("time", { datetime: at.toISOString() }, at.toLocaleTimeString()), ` ${text}`));
  while (list.children.length > 60) list.lastChild.remove();
}

let pending = null;
function soon(fn) { clearTimeout(pending); pending = setTimeout(fn, 150); }

async function refreshAll() {
  const jobs = [refreshWorkers(), refreshModels(), refreshAdapters(), refreshTraining(), refreshEval(), refreshOpenEnv(), refreshSessions()];
  const done = await Promise.allSettled(jobs);
  const failed = done.filter((d) => d.status === "rejected");
  if (failed.length) $("#conn").textContent = `error: ${failed[0].reason.message}`;
  const up = workers.filter((w) => w.state === "running").length;
  $("#daemon").textContent = workers.length ? `${up} of ${workers.length} workers running` : "";
}

let lastSeq = 0;
async function followEvents() {
  for (;;) {
    try {
      const r = await api(`/v1/events?after=${lastSeq}`);
      if (!r.ok) throw new Error(`${r.status}`);
      $("#conn").textContent = "live";
      for await (const data of sseEvents(r)) {
        const e = JSON.parse(data);
        lastSeq = Math.max(lastSeq, e.seq);
        note(`${e.worker ? `[${e.worker}] ` : ""}${e.event} ${e.detail || ""}`, e.ts);
        soon(refreshAll);
      }
    } catch (e) {
      $("#conn").textContent = "reconnecting…";
      if (!$("#keyform").hidden) return;          // waiting for the key
    }
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

refreshAll();
followEvents();
setInterval(() => { if (!document.hidden) refreshAll(); }, 3000);
