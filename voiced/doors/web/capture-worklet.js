// Microphone -> 16-bit PCM at the AudioContext's rate (24 kHz: Realtime's audio/pcm), in 40 ms pieces.
// The page posts {active: bool} to pause and resume sending (push-to-talk).
class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.size = Math.round(sampleRate * 0.04);
    this.buffer = new Int16Array(this.size);
    this.filled = 0;
    this.active = true;
    this.port.onmessage = (e) => {
      if ("active" in e.data) {
        this.active = e.data.active;
        if (!this.active) this.flush();
      }
    };
  }

  flush() {
    if (this.filled > 0) {
      const out = this.buffer.slice(0, this.filled);
      this.port.postMessage(out.buffer, [out.buffer]);
      this.filled = 0;
    }
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel || !this.active) return true;
    for (let i = 0; i < channel.length; i++) {
      const s = Math.max(-1, Math.min(1, channel[i]));
      this.buffer[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.filled === this.size) this.flush();
    }
    return true;
  }
}

registerProcessor("capture", Capture);
