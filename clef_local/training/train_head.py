"""``clef-local train-head``: the command line of head training. By default the shipped head's recipe
(:mod:`.state_path_train`, every :class:`~.config.TrainConfig` field a flag); ``--adapters r=16[,alpha=32,layers=10]``
trains LoRA adapters with a whole-record head instead (:mod:`.adapter_train`). A flag the chosen recipe does not use
is refused before any work.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from clef_local.data.datasets import Example, Twin
from clef_local.training.adapter_train import AdapterConfig
from clef_local.training.config import HeadShape, TrainConfig

# TrainConfig's settings of --data demo
DEMO_DATA = ("banking77", "nlupp", "twins", "max_options", "hard_negatives", "canonical")
FROM_SPEC = ("rank", "alpha", "adapter_layers")  # AdapterConfig fields that --adapters SPEC sets
ADAPTER_ONLY_FLAGS = ("init", "max_steps")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _default(f: Field) -> Any:
    return f.default if f.default is not MISSING else None


def _settings() -> dict[str, tuple[Field | None, Field | None]]:
    """Every settings flag: its :class:`TrainConfig` field and its :class:`AdapterConfig` field (None: not one)."""
    train = {f.name: f for f in fields(TrainConfig)}
    adapters = {f.name: f for f in fields(AdapterConfig) if f.name not in FROM_SPEC}
    return {name: (train.get(name), adapters.get(name)) for name in [*train, *(n for n in adapters if n not in train)]}


def _help(train: Field | None, adapters: Field | None) -> str:
    field_ = train or adapters
    assert field_ is not None
    if isinstance(_default(field_), bool):
        return f"turn off what is on by default: {field_.metadata['why']}"
    if train is None:
        return f"--adapters only: {field_.metadata['why']} (default {_default(field_)})"
    text = f"{train.metadata['why']} (default {_default(train)}"
    if adapters is not None and _default(adapters) != _default(train):
        text += f"; --adapters: {_default(adapters)}"
    return text + ")"


# What a setting must be: a value outside is refused with one line before any work.
POSITIVE = {"epochs", "batch_records", "width", "heads", "feedforward", "records", "checkpoint_steps", "lr",
            "head_lr"}
SHARES = {"hard_negatives": (0.0, 1.0, True), "label_smoothing": (0.0, 1.0, False), "validation": (0.0, 1.0, False)}


def _check(parser: argparse.ArgumentParser, values: dict[str, Any]) -> None:
    for name, value in values.items():
        flag = _flag(name)
        if name in SHARES:
            low, high, closed = SHARES[name]
            if not (low <= value <= high if closed else low <= value < high):
                parser.error(f"{flag} is a share in [{low:g}, {high:g}{']' if closed else ')'}, got {value:g}")
        elif name in POSITIVE and not value > 0:
            parser.error(f"{flag} must be positive, got {value}")
        elif isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            parser.error(f"{flag} must be ≥ 0, got {value}")
        if name == "max_options" and value < 2:
            parser.error(f"--max-options must be at least 2 (a choice has a gold and a distractor), got {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-local train-head",
        description="Train a joint schema head on a backbone the way the demo model's head was trained "
                    "(clef_local/demo/head/MODEL_CARD.md): a state-path head on the frozen backbone "
                    "(clef_local/training/state_path.py), whose choices read the state's tokens and their options, "
                    "and whose nouls and scores read their question span. The defaults are that recipe. The "
                    "backbone's outputs are cached under --work and a checkpoint is kept after every epoch, so an "
                    "interrupted run resumes where it stopped. --adapters trains LoRA adapters on the backbone "
                    "together with a whole-record head instead (clef_local/training/adapter_train.py; a GPU's job). "
                    "See docs/demo-model.md.")
    parser.add_argument("--backbone", required=True, type=Path, help="backbone directory (config, weights, tokenizer)")
    parser.add_argument("--out", required=True, type=Path,
                        help="where to write joint_head.safetensors, joint_head_config.json and training_log.json "
                             "(with --adapters also backbone_adapter.safetensors)")
    parser.add_argument("--work", type=Path, help="caches and checkpoints (default: OUT.work); resumable")
    parser.add_argument("--data", default="demo",
                        help="'demo' (BANKING77 + NLU++ folds 0-15, clef_local/training/demo_data.py) or a JSONL "
                             "file of labelled requests, as clef-local data convert writes them")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (caching and training)")
    parser.add_argument("--cache-only", action="store_true",
                        help="compute the caches under --work and stop (e.g. on a GPU machine)")
    parser.add_argument("--adapters", metavar="SPEC",
                        help="train LoRA adapters on the backbone with a whole-record head instead, e.g. r=16 or "
                             "r=16,alpha=32,layers=10 (layers: the top N decoder layers; 0 = all)")
    parser.add_argument("--init", type=Path, metavar="HEAD_DIR",
                        help="--adapters only: start from the head in HEAD_DIR (joint_head.*, e.g. "
                             "clef_local/demo/head) instead of a fresh one")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="--adapters only: stop at step N (checkpointed; the same run without it goes on), then "
                             "validate and write the head and adapter")
    settings = parser.add_argument_group("settings (one flag per field of TrainConfig in "
                                         "clef_local/training/config.py and AdapterConfig in "
                                         "clef_local/training/adapter_train.py)")
    for name, (train, adapters) in _settings().items():
        field_ = train or adapters
        assert field_ is not None
        default = _default(field_)
        if isinstance(default, bool):  # True by default: the flag turns it off
            settings.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                                  default=argparse.SUPPRESS, help=_help(train, adapters))
        else:
            settings.add_argument(_flag(name), type=type(default), default=argparse.SUPPRESS,
                                  metavar="N" if isinstance(default, int) else "X", help=_help(train, adapters))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in _settings() if hasattr(args, name)}
    _check(parser, given)
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be positive, got {args.max_steps}")
    if args.data != "demo" and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file (use 'demo' or a JSONL file)")
    work = args.work or args.out.with_name(args.out.name + ".work")
    if args.adapters is not None:
        return _adapters(parser, args, given, work)
    refused = [_flag(n) for n in given if _settings()[n][0] is None]
    refused += [_flag(n) for n in ADAPTER_ONLY_FLAGS if getattr(args, n) is not None]
    if refused:
        parser.error(f"{', '.join(refused)}: only with --adapters")
    demo_flags = [_flag(n) for n in DEMO_DATA if n in given]
    if args.data != "demo" and demo_flags:
        parser.error(f"{', '.join(demo_flags)}: settings of the demo data; --data {args.data} brings its own records")
    config = TrainConfig(**given)
    from clef_local.data.jsonl import DataFormatError

    try:
        examples, twins, universe, canonical = _training_data(args.data, config)
    except DataFormatError as exc:  # a line of --data that is not a labelled request, named with its line
        parser.error(f"--data: {exc}")
    from clef_local.training.state_path_train import prepare, train

    if args.cache_only:
        data = prepare(args.backbone, examples, work, config, twins, args.device, universe, canonical)
        print(f"cached the states, distractors and span means of {data.records} records under {work}")
        return 0
    result = train(args.backbone, examples, args.out, work=work, config=config, twins=twins, device=args.device,
                   universe=universe, canonical=canonical)
    print(json.dumps(result["history"][-1] | {"calibration": result["calibration"]}, indent=2))
    return 0


def _training_data(data: str, config: TrainConfig
                   ) -> tuple[list[Example], list[Twin], tuple[str, ...], list[Example]]:
    """(examples, twins, option universe of the full views, canonical records) of ``--data``."""
    if data != "demo":
        from clef_local.data.jsonl import read_jsonl

        return read_jsonl(Path(data)), [], (), []
    from clef_local.training.demo_data import demo_universe, training_examples, twin_records

    examples = training_examples(config.banking77, config.nlupp, config.seed, hard=config.hard_negatives,
                                 max_options=config.max_options)
    return (examples, twin_records(config.twins, seed=config.seed), *demo_universe(config.canonical))


def _adapters(parser: argparse.ArgumentParser, args: argparse.Namespace, given: dict[str, Any], work: Path) -> int:
    """``train-head --adapters SPEC``: decision data (``--records``), resumable training, the head + adapter."""
    from clef_local.training.lora import AdapterSpec

    refused = [_flag(n) for n in given if _settings()[n][1] is None]
    refused += ["--cache-only"] if args.cache_only else []
    if refused:
        parser.error(f"{', '.join(refused)}: not used by --adapters")
    shape = [_flag(f.name) for f in fields(HeadShape) if f.name in given]
    if args.init is not None and shape:
        parser.error(f"{', '.join(shape)}: the head in --init {args.init} has its own shape")
    if args.data != "demo":
        parser.error("--adapters trains on the decision data (clef_local/training/decision_data.py): drop --data")
    try:
        spec = AdapterSpec.parse(args.adapters)
    except ValueError as exc:
        parser.error(str(exc))
    from clef_local.training.adapter_train import train_adapters
    from clef_local.training.decision_data import decision_data

    config = AdapterConfig(rank=spec.rank, alpha=spec.alpha, adapter_layers=spec.layers, **given)
    examples, twins = decision_data(config.records, seed=config.seed)
    result = train_adapters(args.backbone, examples, twins, args.out, work=work, config=config, device=args.device,
                            init=args.init, max_steps=args.max_steps)
    print(json.dumps(result["validation"] | {"calibration": result["calibration"]}, indent=2))
    return 0
