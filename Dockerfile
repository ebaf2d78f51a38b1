# voiced on NVIDIA's TensorRT-LLM container: engines are built on first start (engines/entrypoint.sh)
# into the /data volume and reused while their manifest matches.
#
# The tag pins the TensorRT-LLM release: 1.0.0 still has the TensorRT engine path (trtllm-build,
# ModelRunnerCpp / the C++ executor) that our runners use. TensorRT engines only load in the
# release that built them, so changing the tag rebuilds the engines (the manifest records the version).
FROM nvcr.io/nvidia/tensorrt-llm/release:1.0.0

WORKDIR /opt/voiced

# Piper (the daemon's voice where no GPU is visible) reads text through the espeak-ng program.
RUN apt-get update && apt-get install -y --no-install-recommends espeak-ng && rm -rf /var/lib/apt/lists/*
# Scratch files of the install steps below (pins, pip check before and after); removed at the end.
ARG BUILD_STATE=/tmp/voiced-build

# pip check's complaints about the image itself, before anything is added: NVIDIA's own builds (torch
# 2.8.0a0+...nv25.6 and what pins it) may carry some. Only complaints that are new fail the build.
RUN mkdir -p $BUILD_STATE && { pip check > $BUILD_STATE/pip-check.image.txt || true; }

# The container's own torch (CUDA build), transformers and tensorrt_llm satisfy the extra and stay; pip
# adds only what voiced needs. The extra is the Makefile's RUN_EXTRA (tests/test_dependencies.py checks).
COPY pyproject.toml README.m[d] ./
COPY voiced ./voiced
COPY client ./client
COPY proto ./proto
COPY engines/image_pins.py engines/entrypoint.sh engines/README.md ./engines/

# Every version the image has of voiced's dependencies is held (gRPC aside): TensorRT-LLM and its
# dependencies were resolved against them (the torch extra's torch and transformers among them), and an
# unconstrained `pip install .` moved the image's
# protobuf (6.x) to 7.x.
RUN python3 engines/image_pins.py pyproject.toml torch safetensors pyyaml tokenizers transformers > $BUILD_STATE/image-pins.txt \
 && cat $BUILD_STATE/image-pins.txt

# The committed stubs carry the gencode version of the grpcio-tools that made them, and protobuf
# refuses gencode newer than its runtime: make them again with the newest grpcio-tools that takes the
# image's protobuf (1.80.x for protobuf 6), then drop it.
RUN pip install --no-cache-dir -c $BUILD_STATE/image-pins.txt grpcio-tools \
 && python3 proto/generate.py \
 && pip uninstall -y grpcio-tools

RUN pip install --no-cache-dir -c $BUILD_STATE/image-pins.txt ".[torch]"

RUN if ! pip check > $BUILD_STATE/pip-check.txt; then \
      new=$(grep -vxF -f $BUILD_STATE/pip-check.image.txt $BUILD_STATE/pip-check.txt || true); \
      if [ -n "$new" ]; then \
        echo "$new" >&2; echo "pip check: installing voiced broke the requirements above" >&2; exit 1; \
      fi; \
      echo "pip check: only the base image's own complaints remain:"; cat $BUILD_STATE/pip-check.txt; \
    fi \
 && rm -rf $BUILD_STATE

ENV VOICED_ENGINES_DIR=/data/engines \
    VOICED_CACHE=/data/cache \
    TRTLLM_EXAMPLES_DIR=/app/tensorrt_llm/examples \
    PYTHONUNBUFFERED=1

VOLUME ["/data"]
EXPOSE 50051
# NVIDIA's entrypoint first: it sets up the CUDA forward-compatibility libraries on hosts with older
# drivers (and prints the image's banner), then execs its arguments: ours.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "/opt/voiced/engines/entrypoint.sh"]
