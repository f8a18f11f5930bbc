// Evergreen's JSON frames as the page builds them (GENERATE actions, text leaves, node ids), the
// base64 of their chunks, and the credentials a request carries.

import { $ } from "./dom.js";
import { readoutsManifest, featuresManifest } from "./state.js";

const STRUCT_URL = "type.googleapis.com/google.protobuf.Struct";

export function uuid() {
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

export function fromBase64(data) {
  const bin = atob(data || "");
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// The token: a header on fetches; in the URL only for WebSockets, which cannot carry headers
// (the server takes ?access_token= on a WebSocket handshake only).
export function authQuery() {
  const token = $("token").value.trim();
  return token ? `?access_token=${encodeURIComponent(token)}` : "";
}

export function authHeaders() {
  const token = $("token").value.trim();
  return token ? { authorization: `Bearer ${token}` } : {};
}

export function outputIds() {
  return { prompt: uuid(), question: uuid(), response: uuid(), readouts: uuid(), features: uuid(), logprobs: uuid(), usage: uuid() };
}

export function generateAction(ids, config) {
  const outputs = [{ name: "response", id: ids.response }, { name: "logprobs", id: ids.logprobs }, { name: "usage", id: ids.usage }];
  if (readoutsManifest()) outputs.push({ name: "readouts", id: ids.readouts });
  if (featuresManifest()) outputs.push({ name: "features", id: ids.features });
  return { name: "GENERATE", inputs: [{ name: "prompt", id: ids.prompt }], outputs, configs: [{ "@type": STRUCT_URL, value: config }] };
}

export function textLeaf(id, role, text) {
  return { id, chunkFragment: { metadata: { mimetype: "text/plain", role }, data: toBase64(text) } };
}
