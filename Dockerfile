# voiced on NVIDIA's TensorRT-LLM container: engines are built on first start (engines/entrypoint.sh)
# into the /data volume and reused while their manifest matches.
#
# The tag pins the TensorRT-LLM release: 1.0.0 still has the TensorRT engine path (trtllm-build,
# ModelRunnerCpp / the C++ executor) that our runners use. TensorRT engines only load in the
# release that built them, so changing the tag rebuilds the engines (the manifest records the version).
FROM nvcr.io/nvidia/tensorrt-llm/release:1.0.0

WORKDIR /opt/voiced

# The container's own torch (CUDA build), transformers and tensorrt_llm satisfy the extra and stay; pip
# adds only what voiced needs. The extra is the Makefile's RUN_EXTRA (tests/test_dependencies.py checks).
COPY pyproject.toml README.m[d] ./
COPY voiced ./voiced
COPY client ./client
COPY proto ./proto
RUN pip install --no-cache-dir ".[torch]"

COPY engines/entrypoint.sh engines/README.md ./engines/

ENV VOICED_ENGINES_DIR=/data/engines \
    VOICED_CACHE=/data/cache \
    TRTLLM_EXAMPLES_DIR=/app/tensorrt_llm/examples \
    PYTHONUNBUFFERED=1

VOLUME ["/data"]
EXPOSE 50051
ENTRYPOINT ["/opt/voiced/engines/entrypoint.sh"]
