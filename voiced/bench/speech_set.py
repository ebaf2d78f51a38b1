"""A small real-speech evaluation set made on the spot: espeak-ng reading known sentences.

    voiced eval make-set DIR --n 50 [--noise] [--phone]

Each utterance is `utt-0001.wav` with its reference `utt-0001.txt`, and `manifest.jsonl` lists them
(`{"audio": "utt-0001.wav", "text": ...}`), so `voiced eval DIR` reads the set either way. Voices
and speaking rates vary over espeak-ng's English voices; `--noise` adds pink (room-like) noise at a
signal-to-noise ratio (default 15 dB); `--phone` sends the result through a telephone line: 8 kHz,
300-3400 Hz, G.711 mu-law, written as the mu-law WAV a phone system records. Everything is seeded:
the same options give the same files.

The sentences are written for this set (everyday requests, numbers, dates, names, places), so it
carries no licence of someone else's. espeak-ng is formant synthesis: far from human speech, but
real acoustics of real words that real models must hear, which random-weight tests cannot give.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 16000
PHONE_RATE = 8000

SENTENCES = [
    "Please call me back tomorrow morning after nine o'clock.",
    "I would like to book a table for four people on Friday evening.",
    "The train to Boston leaves from platform seven at half past three.",
    "Can you tell me the balance of my checking account?",
    "My order number is four five two eight nine one.",
    "The meeting has been moved to Thursday at two in the afternoon.",
    "Turn off the lights in the kitchen and lock the front door.",
    "What is the weather going to be like this weekend?",
    "I need to reschedule my appointment with Doctor Miller.",
    "Our new office is on the third floor of the building on Main Street.",
    "Please send the invoice to the accounting department by Monday.",
    "The package was delivered to the wrong address yesterday.",
    "How long does it take to drive from Chicago to Denver?",
    "Set a timer for twenty minutes and remind me to check the oven.",
    "I forgot my password and cannot log in to the website.",
    "The children are playing football in the park near the river.",
    "We sold more than three hundred tickets for the concert.",
    "Could you spell your last name for me, please?",
    "The flight from London was delayed by almost two hours.",
    "Add milk, eggs, bread and coffee to my shopping list.",
    "My phone number is five five five, one two three, four five six seven.",
    "The library closes early on Sundays during the summer.",
    "She has been working at the hospital for eleven years.",
    "Please transfer me to someone who can help with my bill.",
    "The temperature will drop below freezing tonight.",
    "I would like to cancel my subscription at the end of the month.",
    "The hotel room has a view of the mountains and the lake.",
    "He bought a used car with sixty thousand miles on it.",
    "Remind me to water the plants every other day.",
    "The store is open from eight in the morning until ten at night.",
    "We are going to visit my grandparents over the holidays.",
    "Is there a pharmacy near the train station?",
    "The package weighs about four and a half pounds.",
    "Please read the last message from my sister again.",
    "The museum has a new exhibition about ancient Egypt.",
    "I would like a large coffee with milk and no sugar.",
    "The bus was crowded, so I decided to walk home.",
    "Your appointment is confirmed for the twelfth of March.",
    "Play some quiet music in the living room.",
    "The repair will cost around two hundred and fifty dollars.",
    "Our team finished the project two weeks ahead of schedule.",
    "Where can I find the nearest gas station?",
    "The printer on the second floor is out of paper again.",
    "I have a question about the warranty on my washing machine.",
    "The restaurant serves breakfast until eleven thirty.",
    "Please speak slowly, the connection is not very good.",
    "The bridge will be closed for repairs until next spring.",
    "I paid the electricity bill online last night.",
    "Tell me a short story about a dragon and a knight.",
    "The school bus picks up the kids at seven fifteen.",
    "We need two more chairs for the meeting room.",
    "My credit card was charged twice for the same purchase.",
    "The garden looks beautiful after all the rain.",
    "Call the plumber, the kitchen sink is leaking again.",
    "The conference starts on the first of October in Berlin.",
    "Could you recommend a good book about history?",
    "The elevator is out of order, please use the stairs.",
    "I will be working from home for the rest of the week.",
    "The dog barked at the mail carrier every single morning.",
    "Please confirm that you received my email about the contract.",
]
# espeak-ng English voices and variants; speaking rates in words per minute.
VOICES = ["en-us", "en-gb", "en-us+f2", "en-gb-x-rp", "en-us+m3", "en-gb-scotland", "en-us+f4", "en-029"]
RATES = [150, 165, 175, 185]


@dataclass
class SetItem:
    name: str
    text: str
    voice: str
    rate: int


def plan(n: int, seed: int = 0) -> list[SetItem]:
    """Which sentence, voice and rate each of `n` utterances gets (sentences repeat after all are used,
    in another voice)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(SENTENCES))
    out = []
    for i in range(n):
        sentence = SENTENCES[order[i % len(SENTENCES)]]
        out.append(SetItem(f"utt-{i + 1:04d}", sentence, VOICES[int(rng.integers(len(VOICES)))],
                           RATES[int(rng.integers(len(RATES)))]))
    return out


def speak(text: str, voice: str, rate: int) -> np.ndarray:
    """espeak-ng's reading of `text` as 16 kHz float32 with 0.3 s of silence before and after (as a
    voice-activity detector would cut it)."""
    from voiced.audio.wavfile import load_16k

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "x.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-w", str(wav), text], check=True,
                       capture_output=True)
        audio = load_16k(wav)
    loud = np.nonzero(np.abs(audio) > 0.01)[0]
    if len(loud):
        audio = audio[loud[0]: loud[-1] + 1]
    pad = np.zeros(3 * RATE // 10, np.float32)
    return np.concatenate([pad, audio, pad]).astype(np.float32)


def pink_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """Noise with a 1/f power spectrum (what rooms, fans and traffic sound like), unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / RATE)
    spectrum[1:] /= np.sqrt(f[1:])
    spectrum[0] = 0
    x = np.fft.irfft(spectrum, n)
    return x / (np.sqrt(np.mean(x**2)) + 1e-12)


def add_noise(audio: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    rms = np.sqrt(np.mean(audio**2)) + 1e-12
    noise = pink_noise(len(audio), rng) * rms / 10 ** (snr_db / 20)
    out = audio + noise
    peak = np.max(np.abs(out))
    return (out / peak * 0.9 if peak > 0.99 else out).astype(np.float32)


def phone_line(audio: np.ndarray) -> bytes:
    """16 kHz float32 -> what a telephone line carries: 8 kHz, 300-3400 Hz, G.711 mu-law bytes."""
    from voiced_client.wavio import float_to_int16, resample

    from voiced.audio.ingest import encode_pcm

    narrow = resample(audio.astype(np.float32), RATE, PHONE_RATE)
    spectrum = np.fft.rfft(narrow)
    f = np.fft.rfftfreq(len(narrow), 1 / PHONE_RATE)
    spectrum[(f < 300) | (f > 3400)] = 0
    narrow = np.fft.irfft(spectrum, len(narrow)).astype(np.float32)
    return encode_pcm(float_to_int16(np.clip(narrow, -1, 1)), "MULAW")


def make_set(directory: str | Path, n: int = 50, *, noise: bool = False, snr_db: float = 15.0, phone: bool = False,
             seed: int = 0, progress: bool = True) -> Path:
    """Write the set into `directory` (created); returns the manifest's path."""
    from tqdm import tqdm
    from voiced_client.wavio import write_g711_wav, write_wav

    if n < 1:
        raise ValueError(f"--n must be at least 1, not {n}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    lines = []
    for item in tqdm(plan(n, seed), desc="espeak-ng", unit="utt", disable=not progress):
        audio = speak(item.text, item.voice, item.rate)
        if noise:
            audio = add_noise(audio, snr_db, rng)
        wav = out / f"{item.name}.wav"
        if phone:
            write_g711_wav(wav, phone_line(audio), PHONE_RATE, "MULAW")
        else:
            write_wav(wav, audio, RATE)
        (out / f"{item.name}.txt").write_text(item.text + "\n")
        lines.append(json.dumps({"audio": wav.name, "text": item.text, "voice": item.voice, "rate": item.rate}))
    manifest = out / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest
