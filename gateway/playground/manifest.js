// /playground/manifest.json: the model, its readouts and features; the controls are built from it.

import { $ } from "./dom.js";
import { state } from "./state.js";
import { authHeaders } from "./wire.js";
import { renderAll } from "./render.js";
import { showSteering } from "./steering.js";
import { showFeatures } from "./features.js";

export async function loadManifest() {
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
