"""Whisper speech recognition in PyTorch (see engine.WhisperEngine)."""
