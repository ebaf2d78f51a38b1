// The voiced page: the microphone to /v1/realtime (OpenAI's Realtime events), replies played as they stream.
"use strict";

const $ = (id) => document.getElementById(id);
const RATE = 24000; // audio/pcm in Realtime: 16-bit mono at 24 kHz, both ways

const state = {
  ws: null,
  ctx: null,
  capture: null,
  player: null,
  stream: null,
  configured: false,
  talking: false, // push-to-talk button held
  turns: new Map(), // item_id -> turn
  responses: new Map(), // response_id -> turn
  lastTurn: null,
  awaitingSound: null, // the turn whose reply has not sounded yet
  played: 0,
  sent: 0,
  asrModel: null,
};

function setStatus(text, kind = "idle") {
  $("status").textContent = text;
  $("status").dataset.state = kind;
}

function token() {
  return $("token").value.trim();
}

function handsFree() {
  return $("handsfree").checked;
}

// ------------------------------------------------------------------ turns on screen

function newTurn(itemId) {
  const li = $("turn-template").content.firstElementChild.cloneNode(true);
  li.dataset.item = itemId;
  $("turns").prepend(li);
  const turn = { li, itemId, stoppedAt: null, partial: "" };
  state.turns.set(itemId, turn);
  state.lastTurn = turn;
  return turn;
}

function turnFor(itemId) {
  return state.turns.get(itemId) || newTurn(itemId);
}

function showTiming(turn, ms) {
  turn.li.dataset.v2v = String(Math.round(ms));
  turn.li.querySelector(".timing").textContent = `voice to voice: ${Math.round(ms)} ms`;
}

// ------------------------------------------------------------------ audio

function toBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(text) {
  const s = atob(text);
  const bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return bytes.buffer;
}

async function startAudio() {
  state.ctx = new AudioContext({ sampleRate: RATE });
  await state.ctx.audioWorklet.addModule("capture-worklet.js");
  await state.ctx.audioWorklet.addModule("player-worklet.js");
  state.stream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  const mic = state.ctx.createMediaStreamSource(state.stream);
  state.capture = new AudioWorkletNode(state.ctx, "capture");
  const mute = state.ctx.createGain();
  mute.gain.value = 0; // the capture node must be pulled by the graph, but not heard
  mic.connect(state.capture).connect(mute).connect(state.ctx.destination);
  state.capture.port.onmessage = (e) => sendAudio(e.data);
  state.capture.port.postMessage({ active: handsFree() });

  state.player = new AudioWorkletNode(state.ctx, "player");
  state.player.connect(state.ctx.destination);
  state.player.port.onmessage = (e) => {
    state.played = e.data.played;
    document.body.dataset.played = String(state.played);
    if (e.data.playing && state.awaitingSound) {
      const turn = state.awaitingSound;
      state.awaitingSound = null;
      if (turn.stoppedAt !== null) showTiming(turn, performance.now() - turn.stoppedAt);
    }
  };
  await state.ctx.resume();
}

function stopPlayback() {
  if (state.player) state.player.port.postMessage({ clear: true });
}

function sendAudio(buffer) {
  const ws = state.ws;
  if (!ws || ws.readyState !== WebSocket.OPEN || !state.configured) return;
  if (!handsFree() && !state.talking) return;
  ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64(buffer) }));
  state.sent += buffer.byteLength / 2;
  document.body.dataset.sent = String(state.sent); // samples sent: what a test can wait on
}

// ------------------------------------------------------------------ the Realtime connection

function sessionUpdate() {
  const session = {
    type: "realtime",
    audio: {
      input: {
        format: { type: "audio/pcm", rate: RATE },
        turn_detection: handsFree() ? { type: "server_vad" } : null,
        // A streaming transcription model: partial transcripts while you speak.
        transcription: { model: state.asrModel || "gpt-4o-transcribe" },
      },
      output: { format: { type: "audio/pcm", rate: RATE } },
    },
  };
  if ($("voice").value) session.audio.output.voice = $("voice").value;
  if ($("instructions").value.trim()) session.instructions = $("instructions").value.trim();
  return { type: "session.update", session };
}

function send(event) {
  if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(event));
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime"];
  if (token()) protocols.push("openai-insecure-api-key." + token());
  const ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=voiced`, protocols);
  state.ws = ws;
  state.configured = false;
  setStatus("connecting…");
  ws.onopen = () => send(sessionUpdate());
  ws.onmessage = (e) => onEvent(JSON.parse(e.data));
  ws.onclose = (e) => {
    state.ws = null;
    $("talk").disabled = true;
    $("connect").textContent = "Start";
    const why = e.code === 1006 ? "could not connect (is an API token needed? see settings)" : e.reason || `closed (${e.code})`;
    setStatus(why, e.code === 1000 ? "idle" : "error");
    stopPlayback();
  };
}

function onEvent(ev) {
  switch (ev.type) {
    case "session.created":
      break;
    case "session.updated":
      state.configured = true;
      $("talk").disabled = handsFree();
      $("connect").textContent = "Stop";
      setStatus(handsFree() ? "listening: just talk" : "hold the button (or space) to talk", "live");
      break;
    case "input_audio_buffer.speech_started":
      stopPlayback(); // barge-in: the reply stops at once; the server cancels it too
      newTurn(ev.item_id);
      break;
    case "input_audio_buffer.speech_stopped":
      turnFor(ev.item_id).stoppedAt = performance.now();
      break;
    case "input_audio_buffer.committed": {
      const turn = turnFor(ev.item_id);
      if (turn.stoppedAt === null) turn.stoppedAt = performance.now();
      break;
    }
    case "conversation.item.input_audio_transcription.delta": {
      const turn = turnFor(ev.item_id);
      turn.partial += ev.delta || "";
      turn.li.querySelector(".partial").textContent = turn.partial;
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const turn = turnFor(ev.item_id);
      turn.li.querySelector(".final").textContent = ev.transcript;
      turn.li.querySelector(".partial").textContent = "";
      turn.li.classList.add("heard");
      break;
    }
    case "response.created": {
      // The server names the user item a response answers: a reply can arrive after the next turn began,
      // so the latest turn is not always the one answered.
      const answers = ev.response.metadata && ev.response.metadata.item_id;
      const turn = (answers && turnFor(answers)) || state.lastTurn || newTurn(ev.response.id);
      state.responses.set(ev.response.id, turn);
      state.awaitingSound = turn;
      break;
    }
    case "response.output_audio_transcript.delta": {
      const turn = state.responses.get(ev.response_id);
      if (turn) turn.li.querySelector(".agent .text").textContent += ev.delta;
      break;
    }
    case "response.output_audio.delta":
      if (state.responses.has(ev.response_id) && state.player) {
        const pcm = fromBase64(ev.delta);
        state.player.port.postMessage({ pcm }, [pcm]);
      }
      break;
    case "response.done": {
      const turn = state.responses.get(ev.response.id);
      state.responses.delete(ev.response.id);
      if (ev.response.status === "cancelled") {
        stopPlayback();
        if (turn) turn.li.classList.add("interrupted");
      }
      break;
    }
    case "error":
      setStatus(`error: ${ev.error.message}`, state.configured ? "live" : "error");
      console.warn("voiced error", ev.error);
      break;
  }
}

// ------------------------------------------------------------------ controls

async function start() {
  if (state.ws) {
    state.ws.close(1000, "bye");
    return;
  }
  try {
    if (!state.ctx) await startAudio();
    connect();
  } catch (err) {
    setStatus(`microphone: ${err.message}`, "error");
  }
}

function talk(down) {
  if (handsFree() || !state.configured || down === state.talking) return;
  state.talking = down;
  $("talk").classList.toggle("active", down);
  state.capture.port.postMessage({ active: down });
  if (down) {
    stopPlayback();
    if (state.responses.size) send({ type: "response.cancel" });
  } else {
    // The capture node flushes what it holds when paused; commit after that audio has gone out.
    setTimeout(() => send({ type: "input_audio_buffer.commit" }), 60);
  }
}

// A server without a voice only listens: no voice to pick, and the page says so (and why) before you talk.
function showListeningOnly(why) {
  $("voice-picker").hidden = true;
  const note = $("listening-only");
  note.textContent = "This server only listens: you see what it heard and the agent's answer as text; " +
    "no reply is spoken." + (why ? ` (${why})` : "");
  note.hidden = false;
  document.body.dataset.listeningOnly = "true";
}

async function loadVoices() {
  try {
    const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
    const models = await fetch("v1/models", { headers });
    if (models.ok) {
      const data = (await models.json()).data;
      const asr = data.find((m) => m.kind === "transcription");
      if (asr) state.asrModel = asr.id;
      if (!data.some((m) => m.kind === "speech")) {
        const r = await fetch("v1/audio/voices", { headers });
        const body = r.ok ? null : await r.json().catch(() => null);
        showListeningOnly(body && body.error ? body.error.message : "");
        return;
      }
    }
    const r = await fetch("v1/audio/voices", { headers });
    if (!r.ok) return;
    const select = $("voice");
    for (const v of (await r.json()).data) {
      const o = document.createElement("option");
      o.value = v.name;
      o.textContent = `${v.name} (${v.kind})`;
      select.append(o);
    }
  } catch (err) {
    console.warn("voices", err);
  }
}

$("connect").onclick = start;
$("talk").onpointerdown = () => talk(true);
$("talk").onpointerup = $("talk").onpointerleave = () => talk(false);
document.addEventListener("keydown", (e) => {
  if (e.code === "Space" && !e.repeat && e.target.tagName !== "INPUT") { e.preventDefault(); talk(true); }
});
document.addEventListener("keyup", (e) => { if (e.code === "Space") talk(false); });
$("handsfree").onchange = () => {
  if (state.capture) state.capture.port.postMessage({ active: handsFree() });
  state.configured = false;
  send(sessionUpdate());
};
$("voice").onchange = () => send(sessionUpdate());
$("instructions").onchange = () => send(sessionUpdate());
$("token").value = localStorage.getItem("voiced-token") || "";
$("token").onchange = () => { localStorage.setItem("voiced-token", token()); loadVoices(); };
loadVoices();
