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

import { $, download } from "./dom.js";
import { renderAll } from "./render.js";
import { summarizeSteering } from "./steering.js";
import { addFeatureControl, searchFeatures } from "./features.js";
import { loadManifest } from "./manifest.js";
import { send, newChat } from "./chat.js";
import { exportJSON, exportCSV } from "./export.js";

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
// The page's globals: the hooks a script driving the page (the browser tests) calls. Modules
// keep everything else to themselves; addFeatureControl is also reachable by its bare name, as
// the page's scripted callers have always called it.
window.prismgatePlayground = { exportJSON, exportCSV, addFeatureControl };
window.addFeatureControl = addFeatureControl;

loadManifest();
