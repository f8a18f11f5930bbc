// Steering: a slider per concept (0 = off) at the layer chosen beside them; the entries of the
// sliders away from 0 make the steered twin's spec (chat.js).

import { $, el } from "./dom.js";
import { renderAll } from "./render.js";

// The sliders start from the pack's measurement (manifest `steering`): the concept steered first
// sits at its measured starting scale, at its measured layer, so the first question already shows
// steered and unsteered answers side by side; each slider reaches its concept's measured fluent
// range, and the layer follows the first slider moved away from 0 to that concept's own layer.
export function showSteering(readouts) {
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
export function steeringSpec() {
  const layer = Number($("steer-layer").value);
  return Array.from(document.querySelectorAll("#steer-sliders input.steer"))
    .filter((slider) => Number(slider.value) !== 0)
    .map((slider) => ({ concept: slider.dataset.concept, layer, scale: Number(slider.value) }));
}

export function summarizeSteering() {
  const spec = steeringSpec();
  $("steer-summary").textContent = spec.length ? describeSteering(spec) : "off";
}

export function describeSteering(spec) {
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
