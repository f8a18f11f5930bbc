// prismgate playground: an Evergreen (evergreen.v2) client in plain JavaScript.
//
// One WebSocket to /evergreen is one session. Each turn sends a GENERATE action whose
// input node `prompt` is a non-leaf listing every earlier question and answer node (the
// server keeps them, so they are not re-sent) plus the new question leaf. The answer
// streams back as fragments of the `response` node, with `readouts` and `logprobs`
// NDJSON nodes alongside (one line per token) and a `usage` JSON node at the end.
// Evergreen reports readouts for generated tokens only, so the same conversation is also
// sent to /playground/score, which returns every prompt token with its readouts and logprob.
//
// Steering: a slider per concept (0 = off) at the layer chosen beside them. While any is away
// from 0, each question is also sent, with the spec in GenerateConfig `steering`, on a fresh
// WebSocket of its own: its prompt is the unsteered conversation so far, sent as text, plus the
// question, so the steered answer never enters the main session and the two answers differ only
// by the steering. Both run deterministic (docs/determinism.md): whatever else the server runs,
// the unsteered answer is bit for bit the one the conversation gets alone. Its readouts shade its tokens like any other answer's.
//
// Features: on a model with an SAE (manifest `features`), every answer also asks for the
// `features` output (the top features of each token at each SAE layer, NDJSON like readouts) and
// /playground/score returns the prompt tokens' too; hovering a token lists them with their labels
// (an id alone where the SAE's labels file names none). The Features panel searches the SAE's
// features by label or id (/playground/features) and adds a control per feature found: steer (a
// steering entry {feature, layer, scale}: scale times the feature's unit decoder row) or clamp
// ({feature, layer, clamp}: the feature's activation set to that value). They join the concept
// sliders' entries in the steered twin's spec; a server that refuses them fails the steered
// answer alone, and the panel says why.
//
// Shading: value - center (the concept's neutral point), on a fixed scale per concept and
// layer from the concept pack (`scales`): full colour at twice the scale. A pack without
// scales falls back to the largest value in the conversation, and the legend says so.
"use strict";

const STRUCT_URL = "type.googleapis.com/google.protobuf.Struct";
const POSITIVE = [255, 140, 0];
const NEGATIVE = [30, 144, 255];
const FULL_AT = 2; // scales at which the colour is full
const $ = (id) => document.getElementById(id);

const state = {
  manifest: null,
  ws: null,
  wsReady: null,
  history: [], // node ids of earlier question and answer leaves, in order
  messages: [], // the same conversation for /playground/score: {role, content, tokens?}
  nodes: new Map(), // output node id -> {turn, kind}
  turns: [],
  nextPosition: 0, // where the next turn's prompt tokens start in the session's timeline
  busy: false,
  running: new Set(), // turns still streaming: the page takes a new question when none is
  sockets: new Set(), // the steered runs' own WebSockets, closed by New chat
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

// The token: a header on fetches; in the URL only for WebSockets, which cannot carry headers
// (the server takes ?access_token= on a WebSocket handshake only).
function authQuery() {
  const token = $("token").value.trim();
  return token ? `?access_token=${encodeURIComponent(token)}` : "";
}

function authHeaders() {
  const token = $("token").value.trim();
  return token ? { authorization: `Bearer ${token}` } : {};
}

async function loadManifest() {
  for (let attempt = 0; attempt < 120; attempt++) {
    const response = await fetch("/playground/manifest.json", { cache: "no-store", headers: authHeaders() });
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

function readoutsManifest() {
  return state.manifest && state.manifest.readouts;
}

function featuresManifest() {
  return state.manifest && state.manifest.features;
}

function showManifest(m) {
  document.body.dataset.ready = "1";
  $("model").textContent = `model ${m.model} · context ${m.maxModelLen} tokens` + (m.readouts ? "" : " · no concept pack: no readouts");
  if (m.features) showFeatures(m.features);
  const concept = $("concept");
  const layer = $("layer");
  concept.innerHTML = "";
  layer.innerHTML = "";
  if (!m.readouts) {
    concept.disabled = layer.disabled = true;
    document.querySelectorAll("#view input").forEach((input) => (input.disabled = true));
    return;
  }
  m.readouts.concepts.forEach((name, i) => concept.add(new Option(name, String(i))));
  m.readouts.layers.forEach((l, i) => layer.add(new Option(`L${l}`, String(i))));
  layer.value = String(m.readouts.defaultLayer ?? m.readouts.layers.length - 1);
  concept.value = String(m.readouts.defaultConcept ?? 0);
  showSteering(m.readouts);
  renderAll();
}

// The sliders start from the pack's measurement (manifest `steering`): the concept steered first
// sits at its measured starting scale, at its measured layer, so the first question already shows
// steered and unsteered answers side by side; each slider reaches its concept's measured fluent
// range, and the layer follows the first slider moved away from 0 to that concept's own layer.
function showSteering(readouts) {
  const layer = $("steer-layer");
  const sliders = $("steer-sliders");
  layer.innerHTML = "";
  sliders.innerHTML = "";
  readouts.layers.forEach((l) => layer.add(new Option(`L${l}`, String(l))));
  const steering = readouts.steering ?? { layer: readouts.layers[readouts.defaultLayer ?? 0], range: 64, concepts: {} };
  const measured = steering.concepts || {};
  layer.value = String(steering.layer);
  for (const name of readouts.concepts) {
    const label = el("label");
    const slider = el("input", "steer");
    const reach = String((measured[name] || steering).range);
    const start = name === steering.concept ? String(steering.scale) : "0";
    Object.assign(slider, { type: "range", min: `-${reach}`, max: reach, step: "1", value: start });
    slider.dataset.concept = name;
    if (measured[name]) {
      const m = measured[name];
      label.title = `measured: steers at L${m.layer}, +${m.scale} moved its readout ${m.effect} scales, fluent up to ${m.range}`;
    }
    const shown = el("output", "", start);
    label.classList.toggle("on", start !== "0");
    slider.addEventListener("input", () => {
      const wasOff = !steeringSpec().some((e) => e.concept !== name);
      shown.textContent = slider.value;
      label.classList.toggle("on", Number(slider.value) !== 0);
      if (Number(slider.value) !== 0) {
        // the only slider on: steer at the layer measured for its concept
        if (wasOff && measured[name]) layer.value = String(measured[name].layer);
        // shade by the concept being steered, so the effect shows in the colours too
        $("concept").value = String(readouts.concepts.indexOf(name));
        renderAll();
      }
      summarizeSteering();
    });
    label.append(el("span", "", name), slider, shown);
    sliders.appendChild(label);
  }
  summarizeSteering();
  $("steering").hidden = false;
}

// The steering spec for GenerateConfig: one entry per slider away from 0, or none.
function steeringSpec() {
  const layer = Number($("steer-layer").value);
  return Array.from(document.querySelectorAll("#steer-sliders input.steer"))
    .filter((slider) => Number(slider.value) !== 0)
    .map((slider) => ({ concept: slider.dataset.concept, layer, scale: Number(slider.value) }));
}

function summarizeSteering() {
  const spec = steeringSpec();
  $("steer-summary").textContent = spec.length ? describeSteering(spec) : "off";
}

function describeSteering(spec) {
  const concepts = spec.filter((e) => e.concept !== undefined);
  const parts = concepts.length
    ? [concepts.map((e) => `${e.concept} ${e.scale > 0 ? "+" : ""}${e.scale}`).join(", ") + ` at L${concepts[0].layer}`]
    : [];
  for (const e of spec.filter((x) => x.feature !== undefined)) {
    const how = e.clamp !== undefined ? `= ${e.clamp}` : `${e.scale > 0 ? "+" : ""}${e.scale}`;
    parts.push(`#${e.feature} ${how} at L${e.layer}`);
  }
  return parts.join("; ");
}

// -- features: search, steer and clamp -------------------------------------------------------

const FEATURE_SCALE = { min: -64, max: 64, step: 1, start: 16 }; // scale x the unit decoder row
const FEATURE_CLAMP = { min: 0, max: 64, step: 0.5, start: 10 }; // the activation it is held at

function featureName(id, label) {
  return label ? `#${id} ${label}` : `#${id} (no label)`;
}

function showFeatures(f) {
  const layer = $("feature-layer");
  layer.innerHTML = "";
  f.layers.forEach((l) => layer.add(new Option(`L${l}`, String(l))));
  const from = f.layers.map((l, i) => f.labelled[i]
    ? `L${l}: ${f.labelled[i]} of ${f.widths[i]} features labelled, from ${f.labelsFrom[i] || "the SAE's labels file"}`
    : `L${l}: ${f.widths[i]} features, no labels (search by id)`);
  $("feature-source").textContent = `Labels: ${from.join("; ")}.`;
  $("features").hidden = false;
  searchFeatures();
}

async function searchFeatures() {
  const params = new URLSearchParams({ q: $("feature-search").value.slice(0, 100), layer: $("feature-layer").value, limit: "20" });
  const list = $("feature-results");
  try {
    const response = await fetch(`/playground/features?${params}`, { cache: "no-store", headers: authHeaders() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    if (params.get("q") !== $("feature-search").value.slice(0, 100)) return; // a newer search is on its way
    list.innerHTML = "";
    $("feature-count").textContent = `${body.total} found` + (body.total > body.features.length ? `, first ${body.features.length}` : "");
    for (const f of body.features) {
      const item = el("li", "feature-hit");
      item.dataset.feature = String(f.id);
      const add = (mode) => {
        const button = el("button", `add-${mode}`, mode);
        button.type = "button";
        button.addEventListener("click", () => addFeatureControl(f.id, f.label, body.layer, mode));
        return button;
      };
      item.append(el("span", "", featureName(f.id, f.label)), add("steer"), add("clamp"));
      list.appendChild(item);
    }
  } catch (err) {
    $("feature-count").textContent = `search failed: ${err.message || err}`;
  }
}

// One control per feature and layer: a slider for the scale (steer) or the value (clamp), and x to remove it.
function addFeatureControl(id, label, layer, mode) {
  const key = `${id}@${layer}`;
  const old = document.querySelector(`#feature-controls [data-key="${key}"]`);
  if (old) old.remove();
  const range = mode === "clamp" ? FEATURE_CLAMP : FEATURE_SCALE;
  const row = el("label", "on");
  row.dataset.key = key;
  const slider = el("input", "feature-steer");
  Object.assign(slider, { type: "range", min: String(range.min), max: String(range.max), step: String(range.step), value: String(range.start) });
  Object.assign(slider.dataset, { feature: String(id), layer: String(layer), mode });
  const shown = el("output", "", slider.value);
  slider.addEventListener("input", () => {
    shown.textContent = slider.value;
    summarizeFeatures();
  });
  const remove = el("button", "remove", "\u00d7");
  remove.type = "button";
  remove.title = "remove";
  remove.addEventListener("click", () => {
    row.remove();
    summarizeFeatures();
  });
  row.append(el("span", "", `${mode} ${featureName(id, label)} at L${layer}`), slider, shown, remove);
  $("feature-controls").appendChild(row);
  $("feature-error").textContent = "";
  summarizeFeatures();
}

// The feature entries of the steering spec: a steer at scale 0 does nothing and is left out; a
// clamp always counts (clamping to 0 turns a feature off).
function featureSpec() {
  return Array.from(document.querySelectorAll("#feature-controls input.feature-steer"))
    .filter((s) => s.dataset.mode === "clamp" || Number(s.value) !== 0)
    .map((s) => {
      const entry = { feature: Number(s.dataset.feature), layer: Number(s.dataset.layer) };
      if (s.dataset.mode === "clamp") entry.clamp = Number(s.value);
      else entry.scale = Number(s.value);
      return entry;
    });
}

function summarizeFeatures() {
  const spec = featureSpec();
  $("feature-summary").textContent = spec.length ? describeSteering(spec) : "";
}

function connect() {
  if (state.ws && state.ws.readyState <= 1) return state.wsReady;
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/evergreen${authQuery()}`);
  state.ws = ws;
  state.history = [];
  state.messages = [];
  state.nextPosition = 0;
  state.wsReady = new Promise((resolve, reject) => {
    ws.onopen = () => resolve(ws);
    ws.onerror = () => reject(new Error("the WebSocket failed to open"));
  });
  ws.onmessage = (event) => {
    if (typeof event.data === "string") onMessage(JSON.parse(event.data));
  };
  ws.onclose = (event) => {
    if (state.ws !== ws) return; // replaced (New chat closed it on purpose): nothing to report
    state.ws = null;
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
  $("chat").appendChild(el("div", "turn error", text));
}

function finishBusy() {
  state.busy = false;
  state.running.clear();
  $("send").disabled = false;
}

// An answer box and the turn that streams into it; `part` names its tokens ("answer" or "steered")
// and `index` the question it answers (a steered answer shares its unsteered twin's).
function newTurn(index, ids, part, label, userBox, userBody) {
  const box = el("div", `turn assistant${part === "steered" ? " steered" : ""}`);
  const body = el("span", "answer");
  const stats = el("span", "stats muted", "");
  box.append(el("span", "role muted", label), body, stats);
  const turn = {
    index, part,
    ids, userBox, userBody, box, body, stats,
    prompt: [], // prompt tokens, from /playground/score (the unsteered turn's)
    tokens: [], // answer tokens, from the Evergreen stream
    text: "", decoder: new TextDecoder(), lines: {}, done: false,
  };
  state.turns.push(turn);
  state.running.add(turn);
  for (const kind of ["response", "readouts", "features", "logprobs", "usage"]) state.nodes.set(ids[kind], { turn, kind });
  return turn;
}

function outputIds() {
  return { prompt: uuid(), question: uuid(), response: uuid(), readouts: uuid(), features: uuid(), logprobs: uuid(), usage: uuid() };
}

function generateAction(ids, config) {
  const outputs = [{ name: "response", id: ids.response }, { name: "logprobs", id: ids.logprobs }, { name: "usage", id: ids.usage }];
  if (readoutsManifest()) outputs.push({ name: "readouts", id: ids.readouts });
  if (featuresManifest()) outputs.push({ name: "features", id: ids.features });
  return { name: "GENERATE", inputs: [{ name: "prompt", id: ids.prompt }], outputs, configs: [{ "@type": STRUCT_URL, value: config }] };
}

function textLeaf(id, role, text) {
  return { id, chunkFragment: { metadata: { mimetype: "text/plain", role }, data: toBase64(text) } };
}

// The steered twin of a question, on a WebSocket (so a session) of its own that closes when
// the answer is done: the conversation so far goes as text leaves, then the question.
function runSteered(turn, messages, prompt, config) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/evergreen${authQuery()}`);
  turn.ws = ws;
  state.sockets.add(ws);
  ws.onmessage = (event) => {
    if (typeof event.data === "string") onMessage(JSON.parse(event.data));
  };
  ws.onopen = () => {
    const leaves = messages.map((m) => textLeaf(uuid(), m.role, m.content));
    leaves.push(textLeaf(turn.ids.question, "user", prompt));
    ws.send(JSON.stringify({ actions: [generateAction(turn.ids, config)] }));
    ws.send(JSON.stringify({ nodeFragments: [{ id: turn.ids.prompt, childIds: leaves.map((l) => l.id) }, ...leaves] }));
  };
  ws.onclose = (event) => {
    state.sockets.delete(ws);
    if (turn.done) return;
    const why = `steered run ended: ${event.code} ${event.reason || ""}`.trim();
    if ((config.steering || []).some((e) => e.feature !== undefined)) {
      $("feature-error").textContent = `The server refused this feature steering (the unsteered answer is unaffected): ${why}`;
    }
    turn.box.appendChild(el("span", "stats muted error", why));
    turn.box.classList.add("failed");
    settle(turn);
  };
}

// A turn is over: the page takes the next question once every turn of this one is.
function settle(turn) {
  turn.done = true;
  state.running.delete(turn);
  if (!state.running.size) {
    finishBusy();
    setStatus("idle");
  }
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
  const ids = outputIds();
  // deterministic: the unsteered answer is the answer this conversation gets alone, every time, and
  // the steered twin differs from it by the steering only (a sampled pair shares one fresh seed)
  const temperature = Number($("temperature").value) || 0;
  const config = { maxTokens: Number($("max-tokens").value) || 64, temperature, topLogprobs: 5, deterministic: true };
  if (temperature > 0) config.seed = Math.floor(Math.random() * 2 ** 31);
  if (featuresManifest()) config.features = { topK: featuresManifest().topK };
  const steering = [...(readoutsManifest() ? steeringSpec() : []), ...(featuresManifest() ? featureSpec() : [])];

  const userBox = el("div", "turn user");
  const userBody = el("span", "prompt", prompt);
  userBox.append(el("span", "role muted", "prompt"), userBody);
  $("chat").appendChild(userBox);
  const index = state.turns.filter((t) => t.part === "answer").length;
  const turn = newTurn(index, ids, "answer", steering.length ? "unsteered" : "answer", userBox, userBody);
  if (steering.length) {
    const steered = newTurn(index, outputIds(), "steered", `steered: ${describeSteering(steering)}`, userBox, userBody);
    const pair = el("div", "pair");
    pair.append(turn.box, steered.box);
    $("chat").appendChild(pair);
    runSteered(steered, state.messages.slice(), prompt, { ...config, steering });
  } else {
    $("chat").appendChild(turn.box);
  }

  ws.send(JSON.stringify({ actions: [generateAction(ids, config)] }));
  ws.send(JSON.stringify({ nodeFragments: [{ id: ids.prompt, childIds: [...state.history, ids.question] }, textLeaf(ids.question, "user", prompt)] }));
  state.history.push(ids.question, ids.response);
  state.messages.push({ role: "user", content: prompt });
  scorePrompt(turn, state.messages.slice(), state.nextPosition);
  setStatus("generating...");
}

// The prompt tokens this turn added to the session, with their readouts and logprobs.
async function scorePrompt(turn, messages, start) {
  turn.scoring = true;
  try {
    const response = await fetch("/playground/score", {
      method: "POST",
      headers: { "content-type": "application/json", ...authHeaders() },
      body: JSON.stringify({ messages }),
    });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    turn.userBody.textContent = "";
    for (const t of body.tokens) {
      if (t.position < start) continue;
      const token = makeToken(turn, "prompt", t);
      if (!turn.prompt.length && /^\n+$/.test(token.text)) {
        // a later turn's prompt opens with the template's newline after the last answer's end token
        token.span.textContent = "\u21b5";
        token.span.classList.add("special");
      }
      turn.prompt.push(token);
      turn.userBody.appendChild(token.span);
    }
    turn.userBox.classList.add("scored");
  } catch (err) {
    turn.userBox.appendChild(el("span", "stats muted", `no prompt readouts: ${err.message || err}`));
  } finally {
    turn.scoring = false;
    renderAll();
  }
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
    } else if (kind === "readouts" || kind === "features" || kind === "logprobs") {
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

function makeToken(turn, part, record) {
  const span = el("span", "tok");
  const token = {
    turn, part, span,
    position: record.position, id: record.tokenId, text: record.text || "",
    logprob: record.logprob ?? null, top: record.top || null, values: record.values || null,
    features: record.layers || null, // each SAE layer's top features: [{layer, top: [{id, activation, label}]}]
  };
  span.textContent = token.text;
  if (/^<\|.*\|>$/.test(token.text)) span.classList.add("special");
  span.dataset.position = String(token.position);
  span.addEventListener("mouseenter", (e) => showTip(e, token));
  span.addEventListener("mousemove", moveTip);
  span.addEventListener("mouseleave", hideTip);
  if (token.logprob !== null) span.dataset.logprob = String(token.logprob);
  return token;
}

function answerToken(turn, record) {
  while (turn.tokens.length <= record.index) {
    const token = makeToken(turn, turn.part, { position: null, text: "" });
    token.span.dataset.index = String(turn.tokens.length);
    turn.tokens.push(token);
    turn.body.appendChild(token.span);
  }
  return turn.tokens[record.index];
}

function onRecord(turn, kind, record) {
  if (record.index === undefined) return; // the readouts header line (concepts, layers)
  const token = answerToken(turn, record);
  token.text = record.text;
  token.id = record.tokenId;
  token.position = record.position;
  token.span.textContent = record.text;
  token.span.dataset.position = String(record.position);
  if (kind === "features") {
    token.features = record.layers;
    token.span.dataset.features = String(record.layers.reduce((n, l) => n + l.top.length, 0));
  } else if (kind === "readouts") {
    token.values = record.values;
    shadeToken(token, selection(), scaleOf(selection()));
  } else {
    token.logprob = record.logprob;
    token.top = record.top;
    token.span.dataset.logprob = String(record.logprob);
  }
}

function endTurn(turn) {
  const shown = turn.tokens.map((t) => t.text).join("");
  if (turn.text.startsWith(shown) && turn.text.length > shown.length) {
    turn.body.appendChild(el("span", "tail", turn.text.slice(shown.length)));
  } else if (!turn.tokens.length) {
    turn.body.textContent = turn.text;
  }
  turn.box.classList.add("done");
  $("export-json").disabled = $("export-csv").disabled = false;
  if (turn.part === "steered") {
    turn.done = true; // before the close, which then has nothing to report
    turn.ws.close(1000, "answered");
    renderAll();
    settle(turn);
    return;
  }
  const ids = turn.tokens.map((t) => t.id);
  state.messages.push(ids.length ? { role: "assistant", content: turn.text, tokens: ids } : { role: "assistant", content: turn.text });
  const last = turn.tokens.length ? turn.tokens[turn.tokens.length - 1].position : null;
  if (last !== null && last !== undefined) state.nextPosition = last + 1;
  renderAll();
  settle(turn);
}

// -- scale, colour and the views ------------------------------------------------------------

function selection() {
  return { concept: Number($("concept").value || 0), layer: Number($("layer").value || 0) };
}

function view() {
  const checked = document.querySelector("#view input:checked");
  return checked ? checked.value : "text";
}

function allTokens() {
  return state.turns.flatMap((turn) => [...turn.prompt, ...turn.tokens]);
}

// The concept's center at a layer (its neutral point, from the concept pack), or null when the
// pack has none. Readouts arrive as raw dot products; each concept has its own baseline.
function centerOf(layer, concept) {
  const centers = readoutsManifest() && readoutsManifest().centers;
  if (!centers || !centers[layer]) return null;
  const c = centers[layer][concept];
  return c === null || c === undefined ? null : Number(c);
}

function centered(value, layer, concept) {
  if (value === null || value === undefined) return null;
  const c = centerOf(layer, concept);
  return c === null ? value : value - c;
}

function rawValue(token, layer, concept) {
  return token.values && token.values[layer] ? token.values[layer][concept] : null;
}

// {scale, calibrated}: the pack's scale for the concept at the layer, or (a pack without
// scales) the largest |value - center| in the conversation, position 0 (the attention sink) left out.
function scaleOf({ layer, concept }) {
  const scales = readoutsManifest() && readoutsManifest().scales;
  if (scales && scales[layer] && scales[layer][concept] > 0) return { scale: scales[layer][concept], calibrated: true };
  let largest = 1e-9;
  for (const t of allTokens()) {
    const v = centered(rawValue(t, layer, concept), layer, concept);
    if (t.position !== 0 && v !== null) largest = Math.max(largest, Math.abs(v));
  }
  return { scale: largest / FULL_AT, calibrated: false };
}

function colour(v, scale) {
  const t = Math.max(-1, Math.min(1, v / (FULL_AT * scale)));
  const rgb = t >= 0 ? POSITIVE : NEGATIVE;
  return { css: `rgba(${rgb.join(", ")}, ${(Math.abs(t) * 0.85).toFixed(3)})`, strength: Math.abs(t) };
}

function shadeToken(token, { layer, concept }, { scale }) {
  const span = token.span;
  const raw = rawValue(token, layer, concept);
  const v = token.position === 0 ? null : centered(raw, layer, concept);
  if (v === null) {
    span.style.backgroundColor = "";
    delete span.dataset.value;
    delete span.dataset.centered;
    return;
  }
  const { css, strength } = colour(v, scale);
  span.style.backgroundColor = css;
  span.dataset.value = String(raw);
  span.dataset.strength = strength.toFixed(4);
  if (centerOf(layer, concept) !== null) span.dataset.centered = String(v);
  else delete span.dataset.centered;
}

function renderAll() {
  if (!readoutsManifest()) return;
  const sel = selection();
  const scale = scaleOf(sel);
  for (const token of allTokens()) shadeToken(token, sel, scale);
  renderLegend(sel, scale);
  renderGrid(sel);
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "-" : Number(x).toFixed(digits);
}

function signed(x, digits = 2) {
  return `${x >= 0 ? "+" : "\u2212"}${Math.abs(x).toFixed(digits)}`;
}

function renderLegend({ layer, concept }, { scale, calibrated }) {
  const m = readoutsManifest();
  const name = m.concepts[concept];
  const legend = $("legend");
  legend.hidden = false;
  const gridView = view();
  const what = gridView === "concepts" ? `every concept at layer L${m.layers[layer]}`
    : gridView === "layers" ? `${name} at every layer` : `${name} at layer L${m.layers[layer]}`;
  $("legend-title").textContent = `Shading: ${what}, value \u2212 center`;
  const ticks = $("legend-ticks");
  ticks.innerHTML = "";
  const rows = gridView === "concepts" ? m.concepts.map((_, c) => ({ layer, concept: c }))
    : gridView === "layers" ? m.layers.map((_, li) => ({ layer: li, concept })) : null;
  for (const k of [-FULL_AT, -1, 0, 1, FULL_AT]) {
    const tick = el("span", "tick");
    // a grid's rows each have their own scale: its ticks are in scales, not in one row's units
    const number = k === 0 ? "0" : rows && calibrated ? `${signed(k, 0)}\u00d7` : signed(k * scale, scale >= 10 ? 1 : 2);
    tick.append(el("b", "", number), el("small", "", k === 0 ? "center" : `${signed(k, 0)} scale`));
    ticks.appendChild(tick);
  }
  legend.dataset.scale = String(scale);
  legend.dataset.calibrated = calibrated ? "1" : "0";
  const perRow = rows && calibrated
    ? rows.map((row) => `${gridView === "concepts" ? m.concepts[row.concept] : `L${m.layers[row.layer]}`} ${fmt(scaleOf(row).scale, 1)}`).join(", ")
    : "";
  $("legend-note").textContent = !calibrated
    ? "This concept pack has no scales: shading is relative to the largest value in this conversation."
    : rows
      ? `Fixed scales from the concept pack, one per row (half the gap between its positive and negative prompts): ${perRow}.`
      : `Fixed scale from the concept pack: 1 scale = ${fmt(scale, 2)} for ${name} at L${m.layers[layer]}, half the gap between its positive and negative prompts.`;
}

function renderGrid({ layer, concept }) {
  const v = view();
  const grid = $("grid");
  const table = $("grid-table");
  table.innerHTML = "";
  const m = readoutsManifest();
  const tokens = allTokens().filter((t) => t.values && t.position !== 0);
  if (v === "text" || !m || !tokens.length) {
    grid.hidden = true;
    return;
  }
  grid.hidden = false;
  const rows = v === "concepts"
    ? m.concepts.map((name, c) => ({ label: name, layer, concept: c }))
    : m.layers.map((l, li) => ({ label: `L${l}`, layer: li, concept }));
  $("grid-title").textContent = v === "concepts"
    ? `Concepts \u00d7 tokens at layer L${m.layers[layer]} (prompt tokens in grey headers)`
    : `Layers \u00d7 tokens for ${m.concepts[concept]} (prompt tokens in grey headers)`;
  table.dataset.view = v;
  const head = el("tr");
  head.appendChild(el("th", "corner"));
  let previousTurn = null;
  for (const t of tokens) {
    const th = el("th", `tokhead ${t.part}`);
    const label = el("span", "", t.text.replace(/\n/g, "\u21b5") || (t.part === "prompt" ? "\u00b7" : "end"));
    if (!t.text && t.part !== "prompt") {
      th.classList.add("special");
      th.title = "the end-of-sequence token: it ends the answer and has no text";
    }
    th.appendChild(label);
    if (t.turn !== previousTurn) th.classList.add("turn-start");
    previousTurn = t.turn;
    head.appendChild(th);
  }
  table.appendChild(head);
  for (const row of rows) {
    const tr = el("tr");
    tr.appendChild(el("th", "rowhead", row.label));
    const scale = scaleOf(row);
    previousTurn = null;
    for (const t of tokens) {
      const value = centered(rawValue(t, row.layer, row.concept), row.layer, row.concept);
      const td = el("td", "cell");
      if (t.turn !== previousTurn) td.classList.add("turn-start");
      previousTurn = t.turn;
      if (value !== null) {
        td.style.backgroundColor = colour(value, scale.scale).css;
        td.dataset.centered = String(value);
      }
      td.addEventListener("mouseenter", (e) => showCellTip(e, t, row, value, scale.scale));
      td.addEventListener("mousemove", moveTip);
      td.addEventListener("mouseleave", hideTip);
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

// -- tooltips -------------------------------------------------------------------------------

function showTip(event, token) {
  const tip = $("tooltip");
  const m = readoutsManifest();
  const { concept, layer } = selection();
  tip.innerHTML = "";
  tip.appendChild(el("div", "", `${token.part} token ${JSON.stringify(token.text)} (id ${token.id ?? "?"}, position ${token.position ?? "?"})`));
  tip.appendChild(el("div", "", `logprob ${fmt(token.logprob)}` + (token.logprob !== null && token.logprob !== undefined ? ` (p=${Math.exp(token.logprob).toFixed(3)})` : "")));
  if (token.top && token.top.length) {
    tip.appendChild(el("div", "muted", "top: " + token.top.map((t) => `${JSON.stringify(t.text)} ${fmt(t.logprob)}`).join(", ")));
  }
  if (token.position === 0) tip.appendChild(el("div", "muted", "position 0 is the attention sink: its readouts are not comparable"));
  if (token.values && m) {
    const withCenters = Boolean(m.centers);
    tip.appendChild(el("div", "", `readouts at layer L${m.layers[layer]}` + (withCenters ? " (raw, minus the concept's center, in scales):" : ":")));
    const table = el("table");
    const head = el("tr", "head");
    head.append(el("th", "", "concept"), el("th", "", "raw"));
    if (withCenters) head.append(el("th", "", "\u2212 center"));
    if (withCenters && scaleOf({ layer, concept }).calibrated) head.append(el("th", "", "scales"));
    table.appendChild(head);
    m.concepts.forEach((name, c) => {
      const row = el("tr", c === concept ? "sel" : "");
      const value = token.values[layer][c];
      row.append(el("td", "", name), el("td", "", fmt(value)));
      if (withCenters) {
        const v = centered(value, layer, c);
        row.append(el("td", "centered", `${v >= 0 ? "+" : ""}${fmt(v)}`));
        const { scale, calibrated } = scaleOf({ layer, concept: c });
        if (calibrated) row.append(el("td", "units", `${signed(v / scale, 2)}\u00d7`));
      }
      table.appendChild(row);
    });
    tip.appendChild(table);
  }
  for (const layer of token.features || []) {
    tip.appendChild(el("div", "", `top features at L${layer.layer} (activation, label):`));
    const list = el("table", "features");
    for (const f of layer.top) {
      const row = el("tr", "feature");
      row.dataset.feature = String(f.id);
      row.append(el("td", "", `#${f.id}`), el("td", "", fmt(f.activation, 2)), el("td", f.label ? "label" : "label muted", f.label || "(no label)"));
      list.appendChild(row);
    }
    if (!layer.top.length) list.appendChild(el("tr", "muted", "none active"));
    tip.appendChild(list);
  }
  tip.hidden = false;
  moveTip(event);
}

function showCellTip(event, token, row, value, scale) {
  const tip = $("tooltip");
  const m = readoutsManifest();
  tip.innerHTML = "";
  tip.appendChild(el("div", "", `${token.part} token ${JSON.stringify(token.text)} (position ${token.position})`));
  tip.appendChild(el("div", "", `${m.concepts[row.concept]} at L${m.layers[row.layer]}: value \u2212 center ${value === null ? "-" : signed(value, 3)}`));
  if (value !== null) tip.appendChild(el("div", "muted", `${signed(value / scale, 2)} scales (1 scale = ${fmt(scale, 2)})`));
  tip.appendChild(el("div", "muted", `logprob ${fmt(token.logprob)}`));
  tip.hidden = false;
  moveTip(event);
}

function moveTip(event) {
  const tip = $("tooltip");
  tip.style.left = `${Math.max(8, Math.min(event.clientX + 12, window.innerWidth - tip.offsetWidth - 8))}px`;
  tip.style.top = `${event.clientY + 16}px`;
}

function hideTip() {
  $("tooltip").hidden = true;
}

// -- export ---------------------------------------------------------------------------------

function exportRecords() {
  return state.turns.flatMap((turn) => [...turn.prompt, ...turn.tokens].map((t) => ({
    turn: turn.index, part: t.part, position: t.position, tokenId: t.id, text: t.text,
    logprob: t.logprob, top: t.top, values: t.values, features: t.features,
  })));
}

function exportJSON() {
  const m = readoutsManifest();
  return JSON.stringify({
    model: state.manifest ? state.manifest.model : null,
    readouts: m ? { concepts: m.concepts, layers: m.layers, layerConvention: m.layerConvention, centers: m.centers, scales: m.scales } : null,
    tokens: exportRecords(),
  }, null, 2);
}

function csvField(x) {
  if (x === null || x === undefined) return "";
  const s = String(x);
  return /[",\n\r]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
}

// One row per token; readout columns are raw values named L<layer>:<concept> (centers and
// scales are in the JSON export and /playground/manifest.json).
function exportCSV() {
  const m = readoutsManifest();
  const columns = ["turn", "part", "position", "token_id", "token", "logprob"];
  const cells = [];
  if (m) m.layers.forEach((l, li) => m.concepts.forEach((c, ci) => { columns.push(`L${l}:${c}`); cells.push([li, ci]); }));
  const lines = [columns.join(",")];
  for (const r of exportRecords()) {
    const row = [r.turn, r.part, r.position, r.tokenId, r.text, r.logprob];
    for (const [li, ci] of cells) row.push(r.values ? r.values[li][ci] : null);
    lines.push(row.map(csvField).join(","));
  }
  return lines.join("\r\n") + "\r\n";
}

function download(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = el("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

window.prismgatePlayground = { exportJSON, exportCSV };

// -- the rest -------------------------------------------------------------------------------

function newChat() {
  if (state.ws) state.ws.close(1000, "new chat");
  for (const ws of state.sockets) ws.close(1000, "new chat");
  state.sockets.clear();
  state.ws = null;
  state.history = [];
  state.messages = [];
  state.nextPosition = 0;
  state.turns = [];
  state.nodes.clear();
  $("chat").innerHTML = "";
  $("export-json").disabled = $("export-csv").disabled = true;
  renderAll();
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
$("concept").addEventListener("change", renderAll);
$("layer").addEventListener("change", renderAll);
document.querySelectorAll("#view input").forEach((input) => input.addEventListener("change", renderAll));
$("new-chat").addEventListener("click", newChat);
$("steer-layer").addEventListener("change", summarizeSteering);
let searchTimer = null;
$("feature-search").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(searchFeatures, 150);
});
$("feature-layer").addEventListener("change", searchFeatures);
$("steer-reset").addEventListener("click", () => document.querySelectorAll("#steer-sliders input.steer").forEach((slider) => {
  slider.value = "0";
  slider.dispatchEvent(new Event("input"));
}));
$("export-json").addEventListener("click", () => download("prismgate-conversation.json", "application/json", exportJSON()));
$("export-csv").addEventListener("click", () => download("prismgate-conversation.csv", "text/csv", exportCSV()));
loadManifest();
