// prismgate playground: an Evergreen (evergreen.v2) client in plain JavaScript.
//
// One WebSocket to /evergreen is one session. Each turn sends a GENERATE action whose
// input node `prompt` is a non-leaf listing every earlier question and answer node (the
// server keeps them, so they are not re-sent) plus the new question leaf. The answer
// streams back as fragments of the `response` node, with `readouts` and `logprobs`
// NDJSON nodes alongside (one line per token) and a `usage` JSON node at the end.
"use strict";

const STRUCT_URL = "type.googleapis.com/google.protobuf.Struct";
const $ = (id) => document.getElementById(id);

const state = {
  manifest: null,
  ws: null,
  wsReady: null,
  history: [], // node ids of earlier question and answer leaves, in order
  nodes: new Map(), // output node id -> {turn, kind}
  turns: [],
  busy: false,
};

function uuid() {
  if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
  const b = new Uint8Array(16);
  (window.crypto || { getRandomValues: (a) => a.map(() => Math.floor(Math.random() * 256)) }).getRandomValues(b);
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

function toBase64(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  for (const byte of bytes) bin += String.fromCharCode(byte);
  return btoa(bin);
}

function fromBase64(data) {
  const bin = atob(data || "");
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function setStatus(text) {
  $("status").textContent = text;
}

function authQuery() {
  const token = $("token").value.trim();
  return token ? `?access_token=${encodeURIComponent(token)}` : "";
}

async function loadManifest() {
  for (let attempt = 0; attempt < 120; attempt++) {
    const response = await fetch(`/playground/manifest.json${authQuery()}`, { cache: "no-store" });
    if (response.status === 401) {
      $("model").textContent = "this server needs a token: enter it above, then reload";
      return;
    }
    const manifest = await response.json();
    if (manifest.ready) {
      state.manifest = manifest;
      showManifest(manifest);
      return;
    }
    $("model").textContent = "model loading...";
    await new Promise((r) => setTimeout(r, 1000));
  }
}

function showManifest(m) {
  document.body.dataset.ready = "1";
  $("model").textContent = `model ${m.model} · context ${m.maxModelLen} tokens` + (m.readouts ? "" : " · no concept pack: no readouts");
  const concept = $("concept");
  const layer = $("layer");
  concept.innerHTML = "";
  layer.innerHTML = "";
  if (!m.readouts) {
    concept.disabled = layer.disabled = true;
    return;
  }
  m.readouts.concepts.forEach((name, i) => concept.add(new Option(name, String(i))));
  m.readouts.layers.forEach((l, i) => layer.add(new Option(`L${l}`, String(i))));
  layer.value = String(m.readouts.layers.length - 1);
}

function connect() {
  if (state.ws && state.ws.readyState <= 1) return state.wsReady;
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/evergreen${authQuery()}`);
  state.ws = ws;
  state.history = [];
  state.wsReady = new Promise((resolve, reject) => {
    ws.onopen = () => resolve(ws);
    ws.onerror = () => reject(new Error("the WebSocket failed to open"));
  });
  ws.onmessage = (event) => {
    if (typeof event.data === "string") onMessage(JSON.parse(event.data));
  };
  ws.onclose = (event) => {
    if (state.ws === ws) state.ws = null;
    if (event.code !== 1000 && event.code !== 1005) {
      addError(`session ended: ${event.code} ${event.reason || ""}`.trim());
    }
    finishBusy();
    setStatus("disconnected (the next message starts a new session)");
  };
  return state.wsReady;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addError(text) {
  const box = el("div", "turn error", text);
  $("chat").appendChild(box);
}

function finishBusy() {
  state.busy = false;
  $("send").disabled = false;
}

async function send(prompt) {
  if (state.busy || !prompt.trim()) return;
  if (!state.manifest) await loadManifest();
  state.busy = true;
  $("send").disabled = true;
  setStatus("connecting...");
  let ws;
  try {
    ws = await connect();
  } catch (err) {
    addError(String(err));
    finishBusy();
    return;
  }
  const ids = { prompt: uuid(), question: uuid(), response: uuid(), readouts: uuid(), logprobs: uuid(), usage: uuid() };
  const withReadouts = Boolean(state.manifest && state.manifest.readouts);
  const outputs = [{ name: "response", id: ids.response }, { name: "logprobs", id: ids.logprobs }, { name: "usage", id: ids.usage }];
  if (withReadouts) outputs.push({ name: "readouts", id: ids.readouts });
  const config = { maxTokens: Number($("max-tokens").value) || 64, temperature: Number($("temperature").value) || 0, topLogprobs: 5 };

  const userBox = el("div", "turn user", prompt);
  $("chat").appendChild(userBox);
  const box = el("div", "turn assistant");
  const body = el("span", "answer");
  const stats = el("span", "stats muted", "");
  box.append(body, stats);
  $("chat").appendChild(box);
  const turn = { ids, box, body, stats, tokens: [], text: "", decoder: new TextDecoder(), lines: {}, done: false };
  state.turns.push(turn);
  for (const kind of ["response", "readouts", "logprobs", "usage"]) state.nodes.set(ids[kind], { turn, kind });

  ws.send(JSON.stringify({ actions: [{ name: "GENERATE", inputs: [{ name: "prompt", id: ids.prompt }], outputs, configs: [{ "@type": STRUCT_URL, value: config }] }] }));
  ws.send(JSON.stringify({
    nodeFragments: [
      { id: ids.prompt, childIds: [...state.history, ids.question] },
      { id: ids.question, chunkFragment: { metadata: { mimetype: "text/plain", role: "user" }, data: toBase64(prompt) } },
    ],
  }));
  state.history.push(ids.question, ids.response);
  setStatus("generating...");
}

function onMessage(message) {
  for (const fragment of message.nodeFragments || []) {
    const entry = state.nodes.get(fragment.id);
    if (!entry) continue;
    const { turn, kind } = entry;
    const chunk = fragment.chunkFragment;
    const bytes = chunk && chunk.data ? fromBase64(chunk.data) : new Uint8Array(0);
    const final = !fragment.continued;
    if (kind === "response") {
      turn.text += turn.decoder.decode(bytes, { stream: !final });
      if (final) endTurn(turn);
    } else if (kind === "readouts" || kind === "logprobs") {
      const pending = (turn.lines[kind] || "") + new TextDecoder().decode(bytes);
      const parts = pending.split("\n");
      turn.lines[kind] = parts.pop();
      for (const line of parts) if (line.trim()) onRecord(turn, kind, JSON.parse(line));
    } else if (kind === "usage" && bytes.length) {
      const u = JSON.parse(new TextDecoder().decode(bytes));
      turn.usage = u;
      turn.stats.textContent = `${u.finishReason} · ${u.completionTokens} tokens · prompt ${u.promptTokens} (${u.cachedTokens} cached, ${u.appendedTokens} sent)`;
      turn.box.dataset.cachedTokens = String(u.cachedTokens);
    }
  }
}

function tokenAt(turn, index) {
  while (turn.tokens.length <= index) {
    const span = el("span", "tok");
    span.dataset.index = String(turn.tokens.length);
    const token = { span, text: "", readout: null, logprob: null };
    span.addEventListener("mouseenter", (e) => showTip(e, turn, token));
    span.addEventListener("mousemove", moveTip);
    span.addEventListener("mouseleave", hideTip);
    turn.tokens.push(token);
    turn.body.appendChild(span);
  }
  return turn.tokens[index];
}

function onRecord(turn, kind, record) {
  if (record.index === undefined) return; // the readouts header line (concepts, layers)
  const token = tokenAt(turn, record.index);
  token.text = record.text;
  token.id = record.tokenId;
  token.span.textContent = record.text;
  if (kind === "readouts") {
    token.readout = record.values;
    shade(turn);
  } else {
    token.logprob = record.logprob;
    token.top = record.top;
    token.span.dataset.logprob = String(record.logprob);
  }
}

function endTurn(turn) {
  turn.done = true;
  const shown = turn.tokens.map((t) => t.text).join("");
  if (turn.text.startsWith(shown) && turn.text.length > shown.length) {
    turn.body.appendChild(el("span", "tail", turn.text.slice(shown.length)));
  } else if (!turn.tokens.length) {
    turn.body.textContent = turn.text;
  }
  turn.box.classList.add("done");
  shade(turn);
  finishBusy();
  setStatus("idle");
}

function selection() {
  return { concept: Number($("concept").value || 0), layer: Number($("layer").value || 0) };
}

// The concept's center at a layer (its neutral point, from the concept pack), or null when the
// pack has none. Readouts arrive as raw dot products; each concept has its own baseline, so the
// page shades and shows value - center.
function centerOf(layer, concept) {
  const centers = state.manifest && state.manifest.readouts && state.manifest.readouts.centers;
  if (!centers || !centers[layer]) return null;
  const c = centers[layer][concept];
  return c === null || c === undefined ? null : Number(c);
}

function centered(value, layer, concept) {
  const c = centerOf(layer, concept);
  return value === null || value === undefined || c === null ? value : value - c;
}

function shade(turn) {
  const { concept, layer } = selection();
  const raw = turn.tokens.map((t) => (t.readout && t.readout[layer] ? t.readout[layer][concept] : null));
  const values = raw.map((v) => centered(v, layer, concept));
  const scale = Math.max(1e-9, ...values.filter((v) => v !== null && v !== undefined).map((v) => Math.abs(v)));
  const hasCenter = centerOf(layer, concept) !== null;
  turn.tokens.forEach((token, i) => {
    const v = values[i];
    if (v === null || v === undefined) return;
    const alpha = Math.min(1, Math.abs(v) / scale) * 0.75 + 0.05;
    const rgb = v >= 0 ? "255, 140, 0" : "30, 144, 255";
    token.span.style.backgroundColor = `rgba(${rgb}, ${alpha.toFixed(3)})`;
    token.span.dataset.value = String(raw[i]);
    if (hasCenter) token.span.dataset.centered = String(v);
    else delete token.span.dataset.centered;
  });
}

function reshadeAll() {
  state.turns.forEach(shade);
}

function fmt(x) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(3);
}

function showTip(event, turn, token) {
  const tip = $("tooltip");
  const m = state.manifest;
  const { concept, layer } = selection();
  tip.innerHTML = "";
  tip.appendChild(el("div", "", `token ${JSON.stringify(token.text)} (id ${token.id ?? "?"})`));
  tip.appendChild(el("div", "", `logprob ${fmt(token.logprob)}` + (token.logprob !== null && token.logprob !== undefined ? ` (p=${Math.exp(token.logprob).toFixed(3)})` : "")));
  if (token.top && token.top.length) {
    tip.appendChild(el("div", "muted", "top: " + token.top.map((t) => `${JSON.stringify(t.text)} ${fmt(t.logprob)}`).join(", ")));
  }
  if (token.readout && m && m.readouts) {
    const withCenters = Boolean(m.readouts.centers);
    tip.appendChild(el("div", "", `readouts at layer L${m.readouts.layers[layer]}` + (withCenters ? " (raw, and minus the concept's center):" : ":")));
    const table = el("table");
    m.readouts.concepts.forEach((name, c) => {
      const row = el("tr", c === concept ? "sel" : "");
      const value = token.readout[layer][c];
      row.append(el("td", "", name), el("td", "", fmt(value)));
      if (withCenters) {
        const v = centered(value, layer, c);
        row.append(el("td", "centered", `${v >= 0 ? "+" : ""}${fmt(v)}`));
      }
      table.appendChild(row);
    });
    tip.appendChild(table);
  }
  tip.hidden = false;
  moveTip(event);
}

function moveTip(event) {
  const tip = $("tooltip");
  tip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - tip.offsetWidth - 8)}px`;
  tip.style.top = `${event.clientY + 16}px`;
}

function hideTip() {
  $("tooltip").hidden = true;
}

function newChat() {
  if (state.ws) state.ws.close(1000, "new chat");
  state.ws = null;
  state.history = [];
  state.turns = [];
  state.nodes.clear();
  $("chat").innerHTML = "";
  finishBusy();
  setStatus("idle");
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("composer").requestSubmit();
});
$("concept").addEventListener("change", reshadeAll);
$("layer").addEventListener("change", reshadeAll);
$("new-chat").addEventListener("click", newChat);
loadManifest();
