"""The `elastic-train` command line: train, prepare, export, sample, report.

    elastic-train train [--config FILE.yaml] [--verbose] [dotted.key=value ...]
    elastic-train prepare INPUT... --output DIR [--max-seq-len N] [--eval-fraction F]
                          [--engine auto|ray|local]
    elastic-train export RUN_FOLDER --output DIR [--checkpoint NAME] [--merge]
    elastic-train sample RUN_FOLDER|EXPORT_FOLDER --prompt TEXT [--max-new-tokens N]
    elastic-train report RUN_FOLDER [--output DIR]

RUN_FOLDER may be a pyarrow.fs URI (`s3://bucket/runs/name`) as `run.storage_path` allows.

Exit status 0 on success; on bad input, non-zero with one line `error: ...` naming the culprit.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from elastic_train.config import redact


def _train(args: argparse.Namespace) -> int:
    from elastic_train.config import load_config

    cfg = load_config(args.config, args.overrides)
    from elastic_train.api import train
    from elastic_train.observe.progress import Progress

    progress = Progress(cfg.train.max_steps, cfg.log.progress, cfg.log.print_every_steps)
    result = train(cfg, progress=progress, verbose=args.verbose)
    if result.note:  # nothing was trained: train() said why
        return 0
    s = result.summary
    ended = {"train.max_steps": f" (train.max_steps={cfg.train.max_steps} reached)",
             "train.epochs": f" (train.epochs={cfg.train.epochs} done)"}.get(s.get("ended_by"), "")
    evaluated = (f", eval {s['final_eval_loss']:.4f} at step {s['eval_steps'][-1]} (best "
                 f"{s['best_eval_loss']:.4f} @{s['best_step']})" if s.get("eval_steps") else "")
    print(f"finished: {s['steps']} steps{ended}, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
          f"{evaluated}, "
          f"padding efficiency {s['padding_efficiency']:.3f}, {s['tokens_per_s']:.0f} tokens/s, "
          f"restarts {s['restarts']}, {s.get('precision')} on {s.get('device')} with micro-batches of "
          f"{s.get('micro_batch_tokens')} tokens, run folder {result.run_dir}")
    return 0


# prepare's defaults on the command line (a re-chunk of a prepared data set takes none of them).
CLI_PREPARE_DEFAULTS = {"max_seq_len": 512, "seed": 0, "eval_fraction": 0.03}


def _check_prepare_args(args: argparse.Namespace) -> None:
    """Bad numbers refused by the flags the user typed, before any input is read (prepare()
    names its keyword arguments: max_seq_len, rows_per_block)."""
    from elastic_train.data.heldout import check_fraction

    for flag, value, least in (("--max-seq-len", args.max_seq_len, 1),
                               ("--rows-per-block", args.rows_per_block, 1), ("--seed", args.seed, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if args.eval_fraction is not None:
        check_fraction(args.eval_fraction)  # names --eval-fraction


def _prepare(args: argparse.Namespace) -> int:
    import time

    from elastic_train.cluster.prepare_ray import choose_engine, prepare_ray, summary_line
    from elastic_train.data.prepare import prepare
    from elastic_train.data.rechunk import is_token_dataset

    _check_prepare_args(args)
    started = time.perf_counter()
    engine = choose_engine(args.engine, args.inputs, args.text_field)
    run = prepare_ray if engine == "ray" else prepare  # the same shards either way
    given = {"max_seq_len": args.max_seq_len, "seed": args.seed,
             "eval_fraction": args.eval_fraction}
    if not is_token_dataset(args.inputs, args.text_field):  # a re-chunk takes only what is given
        given = {key: CLI_PREPARE_DEFAULTS[key] if value is None else value
                 for key, value in given.items()}
    stats = run(args.inputs, args.output, **given, rows_per_block=args.rows_per_block,
                tokenizer=args.tokenizer, text_field=args.text_field,
                prompt_field=args.prompt_field, response_field=args.response_field)
    if engine == "local":  # prepare_ray prints its own final line
        print(summary_line(stats, time.perf_counter() - started), file=sys.stderr)
    print(json.dumps(stats))
    return 0


def _export(args: argparse.Namespace) -> int:
    from elastic_train.export import export

    print(f"exported to {export(args.run_folder, args.output, args.checkpoint, merge=args.merge)}")
    return 0


def _check_sample_args(args: argparse.Namespace) -> None:
    """Bad numbers refused before the model loads (ValueError: one `error:` line)."""
    import math

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")


def _sample(args: argparse.Namespace) -> int:
    from elastic_train.export import generate, load_trained

    _check_sample_args(args)
    trained = load_trained(args.run_folder, args.checkpoint)
    text = generate(trained, args.prompt, args.max_new_tokens, args.temperature, args.seed)
    print(args.prompt + text)
    return 0


def _report(args: argparse.Namespace) -> int:
    from elastic_train.observe.report import run_report

    return run_report(args.run_folder, args.output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train (or resume) a run")
    p.add_argument("--config", default=None, help="YAML config (default: the embedded one)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's INFO logging on the console too (it always goes to the run "
                        "folder's ray.log)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_train)
    p = sub.add_parser("prepare", help="text, JSONL or Parquet files, or folders -> Parquet shards")
    p.add_argument("inputs", nargs="+", help="text, .jsonl or .parquet files, or folders of them")
    p.add_argument("--output", required=True, help="folder for the shards (must hold none yet)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest row, in tokens (default 512)")
    p.add_argument("--seed", type=int, default=None, help="seed of the row shuffle (default 0)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="share of documents held out, all their rows, into OUTPUT/eval/ (a data "
                        "set of its own), which eval.fraction > 0 evaluates on (default 0.03; "
                        "0: none; below 0.5)")
    p.add_argument("--rows-per-block", type=int, default=None,
                   help="rows per Parquet row group, the unit a training rank reads alone "
                        "(default: 128, fewer for a small data set so it has 64 row groups)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json, or a folder a transformers tokenizer loads "
                        "(default: UTF-8 bytes)")
    p.add_argument("--text-field", default="text",
                   help="the text field of JSONL records and column of Parquet files")
    p.add_argument("--prompt-field", default="prompt",
                   help="with --response-field: records holding both are fine-tuning examples, "
                        "trained on the response only (a loss_mask column); records with a "
                        "'messages' list are rendered with the tokenizer's chat template")
    p.add_argument("--response-field", default="response", help="see --prompt-field")
    p.add_argument("--engine", choices=("auto", "ray", "local"), default="auto",
                   help="ray: a Ray Data pipeline on every CPU of the cluster (RAY_ADDRESS's, else a "
                        "local one); local: one process; auto: ray when RAY_ADDRESS is set or the "
                        "inputs hold 64 MiB or more. The shards are the same")
    p.set_defaults(func=_prepare)
    p = sub.add_parser("export", help="the trained model -> a folder transformers or safetensors loads")
    p.add_argument("run_folder", help="a run folder, local or a URI (s3://, gs://, ...)")
    p.add_argument("--output", required=True, help="new (or empty) folder to write")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder name (default: the best kept, else the newest)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: the adapters merged into the base, a folder from_pretrained "
                        "loads alone (default for model.name=hf: the adapters, for "
                        "PeftModel.from_pretrained; other models always export merged)")
    p.set_defaults(func=_export)
    p = sub.add_parser("sample", help="print a continuation of a prompt by the trained model")
    p.add_argument("run_folder", help="a run folder (local or a URI), or a folder export wrote")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder name (default: the best kept, else the newest)")
    p.set_defaults(func=_sample)
    p = sub.add_parser("report", help="a run's figures as a table, plus loss.png, throughput.png "
                                      "and ranks.png")
    p.add_argument("run_folder", help="a run folder, local or a URI (s3://, gs://, ...)")
    p.add_argument("--output", default=None,
                   help="folder for the PNGs (default: the run folder; for a remote one "
                        "./<run name>-report)")
    p.set_defaults(func=_report)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as a Namespace, options and positionals in any order: overrides on both
    sides of `--config` (`train run.name=x --config f.yaml optim.lr=1e-3`), `prepare`'s inputs on
    both sides of `--output`. argparse's parse_intermixed_args does that but refuses a parser with
    subcommands, so the top level only picks the subcommand, whose own parser reads the rest."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    command = parser.parse_known_args(argv)[0].command  # exits on -h or an unknown subcommand
    sub = parser._subparsers._group_actions[0].choices[command]
    return sub.parse_intermixed_args(argv[argv.index(command) + 1:],
                                     argparse.Namespace(command=command))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `elastic-train` console script."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from elastic_train.cluster.console import quiet_library_notices

    quiet_library_notices()
    from elastic_train.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(redact.shown(f"error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run (its checks, a lease's watch, prepare)
        print(f"stopped: stopped by SIGINT during {args.command}", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run: summary.json has the details
        from elastic_train.api import TrainingFailed, TrainingStopped, UploadFailed

        if isinstance(exc, TrainingStopped):  # summary.json says "stopped"
            import signal

            print(redact.shown(f"stopped: {exc}"), file=sys.stderr)
            return 128 + getattr(signal, exc.signal_name)
        if isinstance(exc, TrainingFailed):
            print(redact.shown(f"error: run failed: {exc}"), file=sys.stderr)
            return 1
        if isinstance(exc, UploadFailed):  # the run ended; its folder's last upload did not
            print(redact.shown(f"error: the run {exc.summary.get('status', 'ended')}, but {exc}"),
                  file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
