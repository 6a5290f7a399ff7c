// A treeserve gateway client in Node.js, written from transport/PROTOCOL.md (sections 1-8
// and 11, "Gateway messages") alone: one DEALER socket, msgpack header maps, requests
// multiplexed by id, heartbeats while a stream is open.
//
// usage: node client.mjs <endpoint> '<json scenario>'
//   scenario: {"prompt": str, "max_tokens": int, "cancel_prompt": str}
// Prints one JSON object per line: {"event": "info" | "item" | "end" | "error" |
// "cancel_sent" | "done", ...}. Exits 0 when the scenario ran, 1 on any failure.

import { Dealer } from "zeromq";
import { decode, encode } from "@msgpack/msgpack";

const [endpoint, scenarioJson] = process.argv.slice(2);
const scenario = JSON.parse(scenarioJson ?? "{}");
const TIMEOUT_MS = 20000;

const sock = new Dealer({ linger: 0 });
sock.connect(endpoint);

const calls = new Map(); // request id -> handler(msg)
let nextId = 1;
let beatSeq = 0;

function print(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

async function send(header) {
  await sock.send(encode({ v: 1, ...header }));
}

function request(method, body, stream, onMessage) {
  const id = nextId++;
  calls.set(id, onMessage);
  send({ kind: "request", id, target: "gateway", method, body, timeout_ms: TIMEOUT_MS, stream });
  return id;
}

async function readLoop() {
  for await (const frames of sock) {
    const msg = decode(frames[0]);
    if (msg.v !== 1) throw new Error(`unexpected protocol version ${msg.v}`);
    if (msg.kind === "heartbeat") continue;
    const handler = calls.get(msg.id);
    if (handler) handler(msg);
  }
}

// Heartbeats tell the gateway we are alive while streams are open (section 11).
const beats = setInterval(() => {
  if (calls.size > 0) send({ kind: "heartbeat", seq: beatSeq++, sent_at: Date.now() / 1000, node: "node-client" });
}, 250);

function unary(method, body) {
  return new Promise((resolve, reject) => {
    const id = request(method, body, false, (msg) => {
      calls.delete(id);
      if (msg.kind === "reply") resolve(msg.body);
      else reject(new Error(`${msg.code}: ${msg.message}`));
    });
  });
}

// Streams a generate request. onItem returns false to cancel. Resolves with the
// stream_end body, or the error message, or "cancelled".
function generate(body, onItem) {
  return new Promise((resolve, reject) => {
    let expected = 0;
    const id = request("generate", body, true, (msg) => {
      if (msg.kind === "stream_item") {
        if (msg.seq !== expected) return reject(new Error(`seq ${msg.seq}, expected ${expected}`));
        expected += 1;
        if (onItem(msg) === false) {
          calls.delete(id);
          send({ kind: "cancel", id });
          print({ event: "cancel_sent", id, items: expected });
          resolve("cancelled");
        }
      } else if (msg.kind === "stream_end") {
        calls.delete(id);
        if (msg.seq !== expected) return reject(new Error(`end seq ${msg.seq}, expected ${expected}`));
        resolve(msg);
      } else if (msg.kind === "error") {
        calls.delete(id);
        resolve(msg);
      }
    });
  });
}

async function main() {
  readLoop().catch((err) => {
    if (!closing) {
      print({ event: "fatal", message: String(err) });
      process.exit(1);
    }
  });

  const info = await unary("info", null);
  print({ event: "info", ...info });

  const end = await generate({ prompt: scenario.prompt, max_tokens: scenario.max_tokens, temperature: 0 }, (msg) => {
    print({ event: "item", seq: msg.seq, text: msg.body.text, token_ids: msg.body.token_ids });
  });
  print({ event: "end", seq: end.seq, ...end.body });

  const bad = await generate({ prompt: scenario.prompt, max_tokens: 0 }, () => true);
  print({ event: "error", id: bad.id, code: bad.code, message: bad.message, retryable: bad.retryable });

  let seen = 0;
  const cancelled = await generate({ prompt: scenario.cancel_prompt, max_tokens: 400 }, () => ++seen < 2);
  if (cancelled !== "cancelled") throw new Error(`the long stream was not cancelled: ${JSON.stringify(cancelled)}`);

  print({ event: "done" });
}

let closing = false;
const timer = setTimeout(() => {
  print({ event: "fatal", message: "timed out" });
  process.exit(1);
}, TIMEOUT_MS);

main()
  .then(() => {
    closing = true;
    clearInterval(beats);
    clearTimeout(timer);
    sock.close();
    process.exit(0);
  })
  .catch((err) => {
    print({ event: "fatal", message: String(err && err.stack ? err.stack : err) });
    process.exit(1);
  });
