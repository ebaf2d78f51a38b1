// Reply audio: 16-bit PCM pieces queued as they arrive and played in order. {clear: true} drops
// everything queued at once (barge-in); the processor reports what it played so the page can show
// when a reply started sounding and how much of it was heard.
class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0; // into queue[0]
    this.played = 0;
    this.playing = false;
    this.port.onmessage = (e) => {
      if (e.data.clear) {
        this.queue = [];
        this.offset = 0;
        this.report(false);
      } else if (e.data.pcm) {
        this.queue.push(new Int16Array(e.data.pcm));
      }
    };
  }

  report(playing) {
    if (playing !== this.playing) {
      this.playing = playing;
      this.port.postMessage({ playing, played: this.played });
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    while (i < out.length && this.queue.length) {
      const head = this.queue[0];
      const n = Math.min(out.length - i, head.length - this.offset);
      for (let k = 0; k < n; k++) out[i + k] = head[this.offset + k] / 32768;
      i += n;
      this.offset += n;
      this.played += n;
      if (this.offset === head.length) {
        this.queue.shift();
        this.offset = 0;
      }
    }
    out.fill(0, i);
    if (i > 0) this.report(true);
    else if (!this.queue.length) this.report(false);
    return true;
  }
}

registerProcessor("player", Player);
