// What the page holds: the manifest, the session's WebSocket, the conversation and its turns.

export const state = {
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

export function readoutsManifest() {
  return state.manifest && state.manifest.readouts;
}

export function featuresManifest() {
  return state.manifest && state.manifest.features;
}
