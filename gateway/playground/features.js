// Features: on a model with an SAE (manifest `features`), every answer also asks for the
// `features` output (the top features of each token at each SAE layer, NDJSON like readouts) and
// /playground/score returns the prompt tokens' too; hovering a token lists them with their labels
// (an id alone where the SAE's labels file names none). The Features panel searches the SAE's
// features by label or id (/playground/features) and adds a control per feature found: steer (a
// steering entry {feature, layer, scale}: scale times the feature's unit decoder row) or clamp
// ({feature, layer, clamp}: the feature's activation set to that value). They join the concept
// sliders' entries in the steered twin's spec; a server that refuses them fails the steered
// answer alone, and the panel says why.

import { $, el } from "./dom.js";
import { authHeaders } from "./wire.js";
import { describeSteering } from "./steering.js";

const FEATURE_SCALE = { min: -64, max: 64, step: 1, start: 16 }; // scale x the unit decoder row

const FEATURE_CLAMP = { min: 0, max: 64, step: 0.5, start: 10 }; // the activation it is held at

function featureName(id, label) {
  return label ? `#${id} ${label}` : `#${id} (no label)`;
}

export function showFeatures(f) {
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

export async function searchFeatures() {
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
export function addFeatureControl(id, label, layer, mode) {
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
export function featureSpec() {
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
