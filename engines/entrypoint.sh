#!/usr/bin/env bash
# Container entrypoint: build the TensorRT-LLM engines on first start, then serve.
#
# Builds are skipped when engines/<name>/manifest.json matches (model, checkpoint sha256, TensorRT-LLM
# version, options), so restarts go straight to serving. Settings come from the environment:
#   VOICED_ASR_MODEL        Whisper model to build and serve (default large-v3)
#   VOICED_TTS_MODEL        Spark-TTS model (default Spark-TTS-0.5B)
#   VOICED_NO_TTS=1         transcription only: skip the TTS engine
#   VOICED_WHISPER_BUILD_ARGS / VOICED_TTS_BUILD_ARGS   extra `voiced engines build` flags
#                           (e.g. "--weight-only int8 --max-batch-size 16")
#   VOICED_LISTEN           address inside the container (default 0.0.0.0:50051)
# Any arguments are passed to `voiced serve`.
set -euo pipefail

asr_model="${VOICED_ASR_MODEL:-large-v3}"
tts_model="${VOICED_TTS_MODEL:-Spark-TTS-0.5B}"

echo "voiced: checking the Whisper engine (${asr_model})"
# shellcheck disable=SC2086
voiced engines build whisper --model "${asr_model}" ${VOICED_WHISPER_BUILD_ARGS:-}

serve_args=(--backend trtllm --asr-model "${asr_model}" --listen "${VOICED_LISTEN:-0.0.0.0:50051}")
if [[ "${VOICED_NO_TTS:-0}" == "1" ]]; then
    serve_args+=(--no-tts)
else
    echo "voiced: checking the Spark-TTS engine (${tts_model})"
    # shellcheck disable=SC2086
    voiced engines build spark-tts --model "${tts_model}" ${VOICED_TTS_BUILD_ARGS:-}
    serve_args+=(--tts-model "${tts_model}")
fi

exec voiced serve "${serve_args[@]}" "$@"
