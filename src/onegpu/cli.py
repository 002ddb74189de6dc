"""The ``onegpu`` command. Heavy libraries are imported only inside the chosen command, so ``--help``
and validation errors come back at once."""
from __future__ import annotations

import argparse
import sys

from onegpu.tradeoffs.knobs import KNOBS, parse_knobs  # the standard library only: --help stays instant

STAGES = ("inputs", "prepare", "reference", "train", "evaluate")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="onegpu",
        description="Fine-tune Hugging Face models on one GPU through DVC, with every run's memory, "
                    "speed and loss in MLflow.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_stage_commands, _compare_and_ui, _estimate_and_sync, _tradeoffs, _summary):
        add(sub)
    return p


PARAMS_HELP = "params file (default: params.yaml)"


def _params(p, help: str = PARAMS_HELP) -> None:
    p.add_argument("--params", default="params.yaml", help=help)


def _out(p) -> None:
    p.add_argument("--out", default="reports", metavar="DIR", help="output folder (default: reports/)")


def _stage_commands(sub) -> None:
    """The DVC stages' commands."""
    for name, text in (("inputs", "link the data source and the model that params.yaml names as "
                                  "data/inputs/*, the paths DVC hashes for prepare and train (DVC stage)"),
                       ("prepare", "read, de-duplicate, split and tokenize the data (DVC stage)"),
                       ("reference", "DPO with train.dpo.precompute_ref_log_probs: score every pair once with "
                                     "the reference model (DVC stage; otherwise it writes a note and loads nothing)"),
                       ("train", "fine-tune the model with the params' micro-batch, accumulation and "
                                 "checkpointing (DVC stage)"),
                       ("evaluate", "evaluate the trained model on the test split (DVC stage)")):
        s = sub.add_parser(name, help=text, description=text)
        _params(s)
        if name == "train":  # the other machines of a launch: `onegpu train -S train.machine_rank=1`
            s.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a param as `dvc exp run -S` does, e.g. -S train.machine_rank=1 on the "
                                "second machine of train.num_machines (repeatable)")


def _compare_and_ui(sub) -> None:
    ui = sub.add_parser("ui", help="serve the MLflow UI on the project's store (127.0.0.1)",
                        description="Serve the MLflow UI on the project's store and print the address "
                                    "of the experiment's runs table.")
    _params(ui, "params file, for tracking.experiment_name")
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1, this machine only)")
    ui.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    cmp = sub.add_parser("compare", help="equivalence and trade-off report over the training runs in MLflow",
                         description="Group the training runs by equivalence_key, compare each with its "
                                     "group's reference per optimizer step (loss, grad_norm, eval metrics) "
                                     "and on cost (peak memory, throughput); write OUT/compare.md and two "
                                     "PNG plots, and log them to an MLflow comparison run.")
    _params(cmp, "params file, for tracking.experiment_name")
    cmp.add_argument("--key", metavar="KEY", help="only this equivalence_key (or a unique prefix of it)")
    cmp.add_argument("--runs", nargs="+", metavar="ID", help="only these MLflow run ids")
    cmp.add_argument("--exp", nargs="+", metavar="NAME", help="only these DVC experiment names")
    _out(cmp)
    cmp.add_argument("--experiment", metavar="NAME",
                     help="MLflow experiment (default: tracking.experiment_name from the params file)")


def _estimate_and_sync(sub) -> None:
    syn = sub.add_parser("sync", help="write MLflow records spooled while the tracking store was unreachable",
                         description="Replay <project root>/.onegpu/spool/*.jsonl (per-step metrics, params, "
                                     "tags, run status that training wrote while the store was down) into "
                                     "the store, in order.")
    _params(syn)
    est = sub.add_parser("estimate", help="predict memory per micro-batch for the current params, without training",
                         description="Predict params, grads, optimizer states and activations (with and "
                                     "without checkpointing) for a list of micro-batch sizes from one probe "
                                     "forward pass, and the largest micro-batch that fits a budget.")
    _params(est)
    est.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a param as `dvc exp run -S` does, e.g. -S data.max_length=128 (repeatable)")
    est.add_argument("--micro-batches", type=int, nargs="+", metavar="N",
                     help="sizes to predict (default: 1 2 4 8 16 32 64)")
    est.add_argument("--budget-gib", type=float, metavar="GIB",
                     help="memory budget (default: train.memory_budget_gib)")


def _tradeoffs(sub) -> None:
    tr = sub.add_parser("tradeoffs", help="measure the single-GPU guide's knobs on your params: one DVC "
                                          "experiment per knob, a table, the fastest same-training configuration",
                        description=f"Run the baseline (your params) and one DVC experiment per knob "
                                    f"({', '.join(KNOBS)}) one at a time, each "
                                    "for a probe window of --steps optimizer steps (or --full), in interleaved "
                                    "rounds (--repeats), and report samples/s (median, min-max) and memory "
                                    "against the baseline, whether each keeps the same training, and the "
                                    "fastest configuration that does, clear of the repeats' spread and "
                                    "confirmed as a whole: OUT/tradeoffs.md, OUT/tradeoffs.png and an MLflow "
                                    "run (tag stage=tradeoffs). Ctrl-C stops the row running and reports what "
                                    "was measured.")
    _params(tr)
    tr.add_argument("--knobs", metavar="LIST", help=f"a comma-separated subset of the knobs {', '.join(KNOBS)} "
                                                    "(default: all that apply; on a CPU the rows whose step "
                                                    "compiles, torch.compile and torchao's AdamW, only when named)")
    tr.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a param for every experiment, the baseline too, as `dvc exp run -S` takes it "
                         "(repeatable), e.g. -S model.dropout=0 to see which knobs are exactly the same training")
    tr.add_argument("--queue-only", action="store_true",
                    help="queue the experiments and stop (run them with dvc queue start -j 1)")
    tr.add_argument("--report", action="store_true", help="only report on a batch already run")
    tr.add_argument("--batch", metavar="ID", help="with --report: the batch (default: the latest)")
    tr.add_argument("--no-combine", action="store_true",
                    help="do not run the combination of the faster knobs (report the parts only)")
    tr.add_argument("--steps", type=_positive, default=None, metavar="N",
                    help="the probe window: optimizer steps per row, the baseline too, whatever the job's length "
                         "(default: 6); rows stop after train (no evaluate)")
    tr.add_argument("--full", action="store_true",
                    help="train the whole job in every row and evaluate it (time to the baseline's eval loss)")
    tr.add_argument("--repeats", type=_positive, default=None, metavar="R",
                    help="runs of every row, in interleaved rounds; a knob is recommended only when its gain "
                         "is clear of the spread of its repeats and the baseline's (default: up to 3, each row "
                         "again only while its next window could change the recommendation)")
    _out(tr)


def _positive(text: str) -> int:
    """An argparse type: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _summary(sub) -> None:
    sm = sub.add_parser("summary", help="the last run's headline metrics and the commands to go on with",
                        description="Print the headline figures of metrics/*.json (make run calls this after "
                                    "dvc repro) and the next commands: the UI, a sweep, compare.")
    _params(sm)


def entry() -> int:
    """The ``onegpu`` console script and ``python -m onegpu``: :func:`main` in a process of its own, with
    :mod:`onegpu.interpreter`'s garbage-collector settings (``main`` alone leaves a caller's interpreter,
    e.g. a test's, as it is)."""
    from onegpu import interpreter
    interpreter.start()
    return main()


def _run_stage(args, cfg) -> None:
    """A DVC stage, or ``estimate``: the model offline first when it is local, then the stage module's ``run``."""
    from onegpu.models import loader
    if loader.is_local(cfg.model.name_or_path):
        loader.go_offline()  # before transformers/datasets are imported
    import importlib
    stage = importlib.import_module(f"onegpu.stages.{args.command}")
    if args.command == "estimate":
        _measured_by("estimate", cfg)
        stage.run(cfg, args.micro_batches, args.budget_gib)
    else:
        stage.run(cfg)


def _measured_by(command: str, cfg) -> None:
    """Raises UserError (one line, exit 2, before any work) where ``onegpu <command>`` cannot measure the task's
    objective yet (:attr:`~onegpu.training.objectives.base.Objective.not_measured_yet`: GRPO's generations)."""
    from onegpu.errors import UserError
    from onegpu.training import objectives
    why = objectives.of(cfg).not_measured_yet
    if why:
        raise UserError(f"model.task {cfg.model.task} is not measured by onegpu {command} yet: {why}")


def _run_ui(args, cfg) -> int:
    from onegpu import ui
    return ui.serve(cfg.tracking.experiment_name, args.host, args.port)


def _run_sync(args, cfg) -> None:
    from onegpu import paths, tracking
    runs, records = tracking.sync()
    print(f"onegpu sync: {records} spooled record(s) of {runs} run(s) written to "
          f"{tracking.redact(paths.tracking_uri())}")


def _run_summary(args, cfg) -> None:
    from onegpu import summary
    print(summary.text(cfg))


def _run_tradeoffs(args, cfg) -> None:
    from onegpu.errors import UserError
    from onegpu.stages import tradeoffs
    from onegpu.tradeoffs.batch import PROBE_STEPS
    if args.full and args.steps:
        raise UserError("--steps and --full exclude each other: a probe window of N steps, or the whole job")
    _measured_by("tradeoffs", cfg)
    tradeoffs.run(tradeoffs.Request(
        cfg, args.params, parse_knobs(args.knobs), queue_only=args.queue_only, report_only=args.report,
        batch=args.batch, combine=not args.no_combine, out_dir=args.out, overrides=tuple(args.overrides),
        steps=None if args.full else (args.steps or PROBE_STEPS), repeats=args.repeats))


def _run_compare(args, cfg) -> None:
    from onegpu.stages import compare
    compare.run(args.experiment or cfg.tracking.experiment_name, key=args.key, run_ids=args.runs,
                exp_names=args.exp, out_dir=args.out)


# Each command's handler, ``(args, cfg) -> exit code or None (0)``; the parser's commands are its keys.
COMMANDS = {**dict.fromkeys((*STAGES, "estimate"), _run_stage), "ui": _run_ui, "sync": _run_sync,
            "summary": _run_summary, "tradeoffs": _run_tradeoffs, "compare": _run_compare}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from onegpu.errors import AlreadySaid, UserError
    try:
        from onegpu import config
        cfg = config.load(args.params, getattr(args, "overrides", None))
        if (code := COMMANDS[args.command](args, cfg)) is not None:
            return code
    except UserError as e:
        if isinstance(e, AlreadySaid):
            return 2
        # One line, whatever the message holds (a YAML parser's error spans several): scripts and
        # `dvc repro` logs show the whole problem on the line that names the stage.
        message = "; ".join(" ".join(part.split()) for part in str(e).splitlines() if part.strip())
        print(f"onegpu {args.command}: error: {message}{_params_note(args)}", file=sys.stderr)
        return 2
    except Exception:
        from onegpu.training.parallel import distributed  # the standard library only
        # A launch's process: its launcher's last line names the rank and says this once for the launch.
        if not distributed.launched() and (note := _params_note(args)):
            print(f"onegpu {args.command}: error (traceback below){note}", file=sys.stderr)
        raise
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (onegpu.interpreter.start)
        from onegpu.training.lifecycle import interrupt  # the standard library only
        from onegpu.training.parallel import distributed
        if distributed.is_main():  # one line per stop, not one per process of a launch
            print(f"onegpu {args.command}: {interrupt.describe(e)}", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    return 0


def _params_note(args) -> str:
    """For a failed stage: ``"; params.yaml differs from git's HEAD ..."`` when it does (what a failed
    ``dvc exp run -S`` leaves behind), else ``""``."""
    from onegpu import paths
    params = getattr(args, "params", None)
    if args.command not in STAGES or not params or not paths.params_differ_from_head(params):
        return ""
    return (f"; {params} differs from git's HEAD (`dvc exp run -S` writes its values there first and "
            f"keeps them when a stage fails): `git diff {params}` shows what, `git checkout {params}` "
            "restores the committed one")


if __name__ == "__main__":
    sys.exit(main())
