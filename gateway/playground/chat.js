// The conversation. One WebSocket to /evergreen is one session. Each turn sends a GENERATE action
// whose input node `prompt` is a non-leaf listing every earlier question and answer node (the
// server keeps them, so they are not re-sent) plus the new question leaf. The answer
// streams back as fragments of the `response` node, with `readouts` and `logprobs`
// NDJSON nodes alongside (one line per token) and a `usage` JSON node at the end.
// Evergreen reports readouts for generated tokens only, so the same conversation is also
// sent to /playground/score, which returns every prompt token with its readouts and logprob.
//
// While any steering slider or feature control is on, each question is also sent, with the spec
// in GenerateConfig `steering`, on a fresh WebSocket of its own: its prompt is the unsteered
// conversation so far, sent as text, plus the question, so the steered answer never enters the
// main session and the two answers differ only by the steering. Both run deterministic
// (docs/determinism.md): whatever else the server runs, the unsteered answer is bit for bit the
// one the conversation gets alone. Its readouts shade its tokens like any other answer's.

import { $, el, setStatus } from "./dom.js";
import { state, readoutsManifest, featuresManifest } from "./state.js";
import { uuid, fromBase64, authQuery, authHeaders, outputIds, generateAction, textLeaf } from "./wire.js";
import { selection, scaleOf, shadeToken, renderAll, makeToken } from "./render.js";
import { steeringSpec, describeSteering } from "./steering.js";
import { featureSpec } from "./features.js";
import { loadManifest } from "./manifest.js";

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

export async function send(prompt) {
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

export function newChat() {
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
