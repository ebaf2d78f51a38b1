"""voiced: a real-time voice agent daemon."""

__version__ = "0.1.0"
