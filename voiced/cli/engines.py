"""`voiced engines build whisper|spark-tts ...` and `voiced engines list`."""

from __future__ import annotations

import argparse

from voiced.cli import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engines", help="build and list TensorRT-LLM engines",
                       description="Build TensorRT-LLM engines (see docs/TRTLLM.md) and list the built ones.")
    p.add_argument("--engines-dir", default=None,
                   help="home of built engines (default: the config's [engines] dir, ./engines; the daemon "
                        "looks there)")
    p.add_argument("--config", help="TOML config file (default: $VOICED_CONFIG)")
    esub = p.add_subparsers(dest="engines_command", metavar="ACTION")
    esub.required = True

    b = esub.add_parser("build", help="convert a checkpoint and run trtllm-build (skipped when up to date)")
    bsub = b.add_subparsers(dest="kind", metavar="MODEL")
    bsub.required = True
    for kind, helptext in (("whisper", "Whisper encoder + decoder engines"),
                           ("spark-tts", "the Spark-TTS-0.5B LM engine (the vocoder stays in PyTorch)")):
        k = bsub.add_parser(kind, help=helptext)
        k.add_argument("--model", default=None,
                       help="whisper: tiny ... large-v3, large-v3-turbo (default large-v3); "
                            "spark-tts: Spark-TTS-0.5B")
        k.add_argument("--checkpoint", default=None,
                       help="use this checkpoint instead of downloading (whisper: <model>.pt; "
                            "spark-tts: the Spark-TTS-0.5B folder or its LLM/ folder)")
        k.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                       help="inference precision (default: float16 for whisper, the only one TensorRT-LLM's "
                            "Whisper runtime takes; bfloat16 for spark-tts)")
        k.add_argument("--weight-only", default=None, choices=["int8", "int4"], help="weight-only quantization")
        k.add_argument("--max-batch-size", type=int, default=None, help="default: 8 (whisper), 16 (spark-tts)")
        if kind == "whisper":
            k.add_argument("--max-beam-width", type=int, default=None,
                           help="default: 1. Above 1, beam requests do not batch with greedy ones: TensorRT-LLM "
                                "runs one beam width at a time")
            k.add_argument("--max-prompt-tokens", type=int, default=None, help="decoder prompt budget (default 14)")
            k.add_argument("--max-new-tokens", type=int, default=None, help="decoder output budget (default 100)")
        else:
            k.add_argument("--max-input-len", type=int, default=None,
                           help="prompt budget (default 1024); a cloned voice's reference clip takes 50 tokens "
                                "a second of it, so 1024 fits clips up to about 18 s")
            k.add_argument("--max-seq-len", type=int, default=None, help="prompt + output (default 2560)")
        k.add_argument("--examples-dir", default=None,
                       help="TensorRT-LLM's examples/ folder (default: $TRTLLM_EXAMPLES_DIR, /app/tensorrt_llm/examples)")
        k.add_argument("--name", default=None,
                       help="engine folder name under the engines dir (default: whisper-<model> / <model>, "
                            "where the daemon looks)")
        k.add_argument("--force", action="store_true", help="rebuild even when the manifest matches")
        k.add_argument("--keep-checkpoint", action="store_true", help="keep the converted TensorRT-LLM checkpoint")
        k.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
        k.set_defaults(func=_build)

    ls = esub.add_parser("list", help="list built engines and their manifests")
    ls.set_defaults(func=_list)


def _root(args: argparse.Namespace) -> str:
    """--engines-dir, else `[engines] dir` as `voiced serve` reads it (the file, then its environment overlay)."""
    from voiced.config import ConfigError, load_config

    if args.engines_dir:
        return args.engines_dir
    try:
        return load_config(args.config).engines.dir
    except ConfigError as e:
        raise CliError(str(e)) from None


def _build(args: argparse.Namespace) -> int:
    from voiced.engines.trtllm import build as b

    root = _root(args)

    extra = {}
    for name in ("max_beam_width", "max_prompt_tokens", "max_new_tokens", "max_input_len", "max_seq_len"):
        if hasattr(args, name):
            extra[name] = getattr(args, name)
    try:
        opts = b.default_options(args.kind, args.model, dtype=args.dtype, weight_only=args.weight_only,
                                 max_batch_size=args.max_batch_size, **extra)
        if args.dry_run:
            out = b.engines_root(root) / (args.name or opts.name)
            ckpt = _dry_run_checkpoint(opts, args.checkpoint)
            script = _dry_run_script(opts, args.examples_dir)
            print(f"# engine folder: {out}")
            for step in b.plan_steps(opts, ckpt, out, script):
                print(step.shell())
            return 0
        result = b.build(opts, root=root, name=args.name, checkpoint=args.checkpoint, examples_dir=args.examples_dir,
                         force=args.force, keep_checkpoint=args.keep_checkpoint)
    except b.BuildError as e:
        raise CliError(str(e)) from None
    verb = "up to date" if result.skipped else "built"
    print(f"{opts.kind} engine {verb}: {result.engine_dir}")
    return 0


def _dry_run_checkpoint(opts, checkpoint):
    from pathlib import Path

    from voiced import hub

    if checkpoint:
        return Path(checkpoint)
    if opts.kind == "whisper":
        return hub.cache_dir() / "whisper" / f"{opts.model}.pt"
    return hub.cache_dir() / opts.model / "LLM"  # where voiced models pull puts Spark-TTS


def _dry_run_script(opts, examples_dir):
    from pathlib import Path

    from voiced.engines.trtllm import build as b

    try:
        return b.find_convert_script(opts.kind, examples_dir)
    except b.BuildError:
        rel = b._CONVERT_SCRIPTS[opts.kind][0]
        return Path(examples_dir or "$TRTLLM_EXAMPLES_DIR") / rel


def _list(args: argparse.Namespace) -> int:
    from voiced.engines.trtllm import build as b

    configured = _root(args)
    rows = b.list_engines(configured)
    root = b.engines_root(configured)
    if not rows:
        print(f"no engines under {root}; build one with `voiced engines build whisper --model large-v3`")
        return 0
    print(f"engines under {root}:")
    for path, m, complete in rows:
        if m is None:
            print(f"  {path.name:<34} incomplete (no manifest: the build did not finish)")
            continue
        o = m.options
        state = "ready" if complete else "incomplete"
        wo = f" weight-only {o.get('weight_only')}" if o.get("weight_only") else ""
        print(f"  {path.name:<34} {state:<10} {m.kind} {m.model} {o.get('dtype')}{wo} "
              f"batch {o.get('max_batch_size')} beam {o.get('max_beam_width')} "
              f"TensorRT-LLM {m.trtllm_version} {m.built_at}")
    return 0
