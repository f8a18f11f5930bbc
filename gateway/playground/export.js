// The conversation's tokens, logprobs, readouts and features as JSON or CSV.

import { state, readoutsManifest } from "./state.js";

function exportRecords() {
  return state.turns.flatMap((turn) => [...turn.prompt, ...turn.tokens].map((t) => ({
    turn: turn.index, part: t.part, position: t.position, tokenId: t.id, text: t.text,
    logprob: t.logprob, top: t.top, values: t.values, features: t.features,
  })));
}

export function exportJSON() {
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
export function exportCSV() {
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
