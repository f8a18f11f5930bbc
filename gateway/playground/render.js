// Shading: value - center (the concept's neutral point), on a fixed scale per concept and
// layer from the concept pack (`scales`): full colour at twice the scale. A pack without
// scales falls back to the largest value in the conversation, and the legend says so.
// Also the grids (concepts x tokens, layers x tokens), the legend and the tooltips.

import { $, el } from "./dom.js";
import { state, readoutsManifest } from "./state.js";

const POSITIVE = [255, 140, 0];

const NEGATIVE = [30, 144, 255];

const FULL_AT = 2; // scales at which the colour is full

export function makeToken(turn, part, record) {
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

export function selection() {
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
export function scaleOf({ layer, concept }) {
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

export function shadeToken(token, { layer, concept }, { scale }) {
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

export function renderAll() {
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
