"""TensorRT-LLM backend: engine builds (build.py), the one-thread executor loop (executor.py), the
Whisper and Spark-TTS runners, and which releases each path supports (versions.py).

Nothing here imports `tensorrt_llm` at module import time; only the runners' `load_*` functions do,
so `import voiced` works where TensorRT-LLM cannot be installed (CI, laptops).
"""
