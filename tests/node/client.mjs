// A treeserve gateway client in Node.js, written from transport/PROTOCOL.md (sections 1-8
// and 11, "Gateway messages") alone: one DEALER socket with its own routing id, msgpack
// header maps, requests multiplexed by id, heartbeats while calls are open, a connect wait.
//
// usage: node client.mjs <endpoint> '<json scenario>'
//   scenario keys (all optional):
//     connect_timeout_ms: how long to wait for the gateway to be reachable (default 60000)
//     prompt, max_tokens, cancel_prompt: the basic flow (info, a stream, a refused stream, a cancel)
//     calls: [{name, method, body, stream, timeout_ms}]: each sent in turn; its outcome printed
//     raw: [header, ...]: sent as they are, then an `info`; every answer before its reply printed
//     dup_id: {body}: a slow stream, then a request reusing its id
//     silent: {body}: a stream while sending nothing (no heartbeats)
//     oversize: {body}: a stream, then a frame above the gateway's limit (ZeroMQ drops us)
// Prints one JSON object per line: {"event": "info" | "item" | "end" | "error" | "cancel_sent" |
// "call" | "raw" | "dup" | "silent" | "oversize" | "stray_error" | "done" | "fatal", ...}.
// Exits 0 when the scenario ran, 1 on any failure.

import { randomBytes } from "node:crypto";
import { Dealer } from "zeromq";
import { decode, encode } from "@msgpack/msgpack";

const [endpoint, scenarioJson] = process.argv.slice(2);
const scenario = JSON.parse(scenarioJson ?? "{}");
const CONNECT_TIMEOUT_MS = scenario.connect_timeout_ms ?? 60000;
const CALL_TIMEOUT_MS = 20000;

// Our own routing id (section 1): after a reconnect the gateway can still reach us, so a stream
// it had to end still gets its final error (11.5).
const sock = new Dealer({ linger: 0, routingId: "node-" + randomBytes(12).toString("hex") });
let isConnected = false;
const connectedWaiters = [];
sock.events.on("handshake", () => {
  isConnected = true;
  connectedWaiters.splice(0).forEach((wake) => wake());
});
sock.events.on("disconnect", () => {
  isConnected = false;
});
sock.connect(endpoint);

const calls = new Map(); // request id -> handler(msg)
let nextId = 1;
let beatSeq = 0; // 11.5: seq starts at 0, +1 per beat
let isSilent = false;
let beatMs = 250;
let rawSink = null; // {replyId, answers} while runRaw collects

function print(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

// zeromq allows one send at a time: every send (heartbeats included) goes through one queue.
let sendQueue = Promise.resolve();
function sendRaw(data) {
  sendQueue = sendQueue.then(() => sock.send(data));
  return sendQueue;
}

function send(header) {
  return sendRaw(encode({ v: 1, ...header }));
}

// 11.5: a client started before its server waits for it, up to a connect timeout.
function waitConnected() {
  if (isConnected) return Promise.resolve();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`could not connect to ${endpoint} within ${CONNECT_TIMEOUT_MS / 1000} s`)),
      CONNECT_TIMEOUT_MS,
    );
    connectedWaiters.push(() => {
      clearTimeout(timer);
      resolve();
    });
  });
}

function request(method, body, stream, onMessage, timeoutMs = CALL_TIMEOUT_MS) {
  const id = nextId++;
  calls.set(id, onMessage);
  send({ kind: "request", id, target: "gateway", method, body, timeout_ms: timeoutMs, stream });
  return id;
}

async function readLoop() {
  for await (const frames of sock) {
    const msg = decode(frames[0]);
    if (msg.v !== 1) throw new Error(`unexpected protocol version ${msg.v}`);
    if (msg.kind === "heartbeat") continue;
    if (rawSink !== null && !(msg.kind === "reply" && msg.id === rawSink.replyId)) {
      rawSink.answers.push(outcome(msg));
      continue;
    }
    // Section 2: an error with id nil ends no request (it is about a message that started none).
    if (msg.kind === "error" && msg.id === null) {
      print({ event: "stray_error", code: msg.code, message: msg.message });
      for (const handler of calls.values()) handler({ ...msg, stray: true });
      continue;
    }
    const handler = calls.get(msg.id);
    if (handler) handler(msg);
  }
}

// Heartbeats tell the gateway we are alive while calls are open (section 11.5).
let beats = null;
function startBeats() {
  beats = setInterval(() => {
    if (calls.size > 0 && !isSilent) {
      send({ kind: "heartbeat", seq: beatSeq++, sent_at: Date.now() / 1000, node: "node-client" });
    }
  }, beatMs);
}

function unary(method, body, timeoutMs) {
  return new Promise((resolve) => {
    const id = request(method, body, false, (msg) => {
      if (msg.stray) return;
      calls.delete(id);
      resolve(msg);
    }, timeoutMs);
  });
}

// Streams a generate request. onItem returns false to cancel. Resolves with the stream_end
// message, or the error message, or "cancelled".
function generate(body, onItem = () => true, timeoutMs = CALL_TIMEOUT_MS, onStart = () => {}) {
  return new Promise((resolve, reject) => {
    let expected = 0;
    const id = request("generate", body, true, (msg) => {
      if (msg.stray) return;
      if (msg.kind === "stream_item") {
        if (msg.seq !== expected) return reject(new Error(`seq ${msg.seq}, expected ${expected}`));
        expected += 1;
        if (onItem(msg, id) === false) {
          calls.delete(id);
          send({ kind: "cancel", id });
          print({ event: "cancel_sent", id, items: expected });
          resolve("cancelled");
        }
      } else if (msg.kind === "stream_end") {
        calls.delete(id);
        if (msg.seq !== expected) return reject(new Error(`end seq ${msg.seq}, expected ${expected}`));
        resolve({ ...msg, items: expected });
      } else if (msg.kind === "error") {
        calls.delete(id);
        resolve({ ...msg, items: expected });
      }
    }, timeoutMs);
    onStart(id);
  });
}

function outcome(msg) {
  if (msg.kind === "error") {
    return { kind: "error", id: msg.id, code: msg.code, message: msg.message, retryable: msg.retryable,
      details: msg.details };
  }
  return { kind: msg.kind, id: msg.id, body: msg.body, items: msg.items };
}

async function basicFlow() {
  const end = await generate({ prompt: scenario.prompt, max_tokens: scenario.max_tokens, temperature: 0 }, (msg) => {
    print({ event: "item", seq: msg.seq, text: msg.body.text, token_ids: msg.body.token_ids });
  });
  print({ event: "end", seq: end.seq, ...end.body });

  const bad = await generate({ prompt: scenario.prompt, max_tokens: 0 });
  print({ event: "error", id: bad.id, code: bad.code, message: bad.message, retryable: bad.retryable });

  let seen = 0;
  const cancelled = await generate({ prompt: scenario.cancel_prompt, max_tokens: 400 }, () => ++seen < 2);
  if (cancelled !== "cancelled") throw new Error(`the long stream was not cancelled: ${JSON.stringify(cancelled)}`);
}

async function runCalls() {
  for (const call of scenario.calls) {
    const timeoutMs = call.timeout_ms === undefined ? CALL_TIMEOUT_MS : call.timeout_ms;
    const msg = call.stream
      ? await generate(call.body, () => true, timeoutMs)
      : await unary(call.method, call.body ?? null, timeoutMs);
    print({ event: "call", name: call.name, ...outcome(msg) });
  }
}

// Sends each raw header, then an `info`: everything the gateway answers before the info's reply
// is an answer to the raw messages.
async function runRaw() {
  const replyId = nextId++;
  rawSink = { replyId, answers: [] };
  for (const header of scenario.raw) await sendRaw(encode(header));
  const reply = await unaryWithId(replyId);
  const answers = rawSink.answers;
  rawSink = null;
  print({ event: "raw", answers, reply: outcome(reply) });
}

function unaryWithId(id) {
  return new Promise((resolve) => {
    calls.set(id, (msg) => {
      calls.delete(id);
      resolve(msg);
    });
    send({ kind: "request", id, target: "gateway", method: "info", body: null, timeout_ms: CALL_TIMEOUT_MS, stream: false });
  });
}

async function runDupId() {
  let streamId = null;
  const end = await generate(scenario.dup_id.body, (msg, id) => {
    if (msg.seq === 0) {
      // Reuse the open stream's id: the gateway must refuse it without ending the stream.
      send({ kind: "request", id, target: "gateway", method: "generate", body: { prompt: "zz" },
        timeout_ms: CALL_TIMEOUT_MS, stream: true });
    }
  }, CALL_TIMEOUT_MS, (id) => { streamId = id; });
  print({ event: "dup", id: streamId, end: outcome(end) });
}

async function runSilent() {
  isSilent = true;
  const end = await generate(scenario.silent.body);
  isSilent = false;
  print({ event: "silent", end: outcome(end) });
}

async function runOversize() {
  const end = await generate(scenario.oversize.body, (msg) => {
    if (msg.seq === 0) sendRaw(Buffer.alloc(3 * 1024 * 1024)); // above the gateway's 2 MiB frame limit
  });
  print({ event: "oversize", end: outcome(end) });
}

async function main() {
  readLoop().catch((err) => {
    if (!closing) {
      print({ event: "fatal", message: String(err) });
      process.exit(1);
    }
  });
  await waitConnected();

  const info = (await unary("info", null)).body;
  print({ event: "info", ...info });
  beatMs = Math.max(10, (info.heartbeat_interval_s * 1000) / 2); // at least as often as the gateway's
  startBeats();

  if (scenario.prompt !== undefined) await basicFlow();
  if (scenario.calls) await runCalls();
  if (scenario.raw) await runRaw();
  if (scenario.dup_id) await runDupId();
  if (scenario.silent) await runSilent();
  if (scenario.oversize) await runOversize();
  print({ event: "done" });
}

let closing = false;
const timer = setTimeout(() => {
  print({ event: "fatal", message: "timed out" });
  process.exit(1);
}, CONNECT_TIMEOUT_MS + 60000);

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
