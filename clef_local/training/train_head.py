"""Train a joint schema head on a frozen backbone: ``clef-local train-head --backbone DIR --out DIR``.

Two resumable stages under a work directory:

1. **Cache** the backbone's final hidden states of every training request (BF16, chunks of similar-length
   requests written atomically), so epochs cost only the head. An interrupted run skips finished chunks.
2. **Train** a :class:`~clef_local.heads.torch_head.JointSchemaHead`
   with label-smoothed cross-entropy (0.05) + Brier per
   question, as Clef was trained; a checkpoint after every epoch lets a run resume where it stopped.

The output is the head part of a release: ``joint_head.safetensors`` (float32), ``joint_head_config.json`` and
``training_log.json``. Works with any backbone directory that ``transformers`` loads and that has tokenizer files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from clef_local.data.datasets import Example, Twin
from clef_local.formats.release import read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.layout import HeadLayout, build_layout
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import (
    HeadShape,
    encode_records,
    flush_denormals,
    gold_index,
    load_checkpoint,
    load_init_head,
    max_length,
    optimizer_step,
    output_embedding,
    parameter_groups,
    print_last_epoch,
    save_checkpoint,
    save_head,
    settings_from_args,
    training_records,
    twin_rows,
    units_to_batches,
    warmup_cosine,
)
from clef_local.training.demo_data import FULL_CHOICE
from clef_local.training.head_losses import StateAttention, question_loss, state_mask, twin_loss
from clef_local.training.hidden_cache import cache_hidden_states
from clef_local.training.splicing import EpochHidden, Splicer, cache_state_bank

log = logging.getLogger(__name__)

AUTOCAST = ("auto", "bf16", "off")


@dataclass(frozen=True)
class TrainConfig(HeadShape):
    """Settings of :func:`train` (the full method)."""

    epochs: int = 8  # the cached hidden states make epochs cheap; more overfits BANKING77's 10k rows
    lr: float = 1e-3  # AdamW on a small, freshly initialised head
    weight_decay: float = 0.01
    batch_records: int = 16
    label_smoothing: float = 0.05  # as Clef was trained
    brier_weight: float = 1.0  # Brier term keeps the probabilities calibrated, not just the argmax
    consistency_weight: float = 1.0  # symmetric KL between twins: ids, order and company must not move answers
    # A cosine scorer needs a temperature to say anything with confidence (CLIP starts at 1/0.07); from the
    # module's 0 (scale 1, logits within ±1) the trained scale stayed at ~1.03 and only the residual MLP scored.
    joint_scale_init: float = 0.0
    spliced: int = 0  # spliced records per epoch (export/splicing.py): new state/schema pairs for a state-only pass
    # The evidence is in the state, ~1% of a 77-option prompt's tokens; left alone, trained heads put 0.5-1.5% of
    # their cross-attention there. This weight x -log(attention mass on the state) speeds finding it (training only).
    state_attention_weight: float = 0.0
    # bf16 matmuls on accelerators ("auto"); "bf16" forces them (an AMX CPU: 1.2x per epoch here, same validation
    # loss, held-out top-1 0.396 vs 0.435 in one seed: not a CPU default), "off" never. Weights, Adam's moments,
    # the span means and the losses stay float32 either way.
    autocast: str = "auto"
    seed: int = 0


# The settings a flag left unset takes with --method full (question_path_train.CLI_DEFAULTS and
# state_path_train.CLI_DEFAULTS for the others).
CLI_DEFAULTS: dict[str, Any] = {"epochs": TrainConfig.epochs, "lr": TrainConfig.lr, "banking77": 2000, "nlupp": 1660,
                                "twins": 0, "max_options": None, "joint_scale_init": TrainConfig.joint_scale_init,
                                "consistency_weight": TrainConfig.consistency_weight,
                                "label_smoothing": TrainConfig.label_smoothing,
                                "state_attention_weight": TrainConfig.state_attention_weight}


def record_batch(items: Sequence[int], encoded, hidden, gold, embedding: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadLayout, torch.Tensor]:
    """The full method's batch of records ``items``: their hidden states right-padded ``[B, T, hidden]``, the
    attention mask, the options' output-embedding rows, the :class:`HeadLayout` and the gold indices (on the
    device of ``embedding``)."""
    device = embedding.device
    records = [encoded[i] for i in items]
    length = max(len(r.input_ids) for r in records)
    states = torch.zeros(len(items), length, hidden[items[0]].shape[-1])
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for row, i in enumerate(items):
        states[row, : hidden[i].shape[0]] = hidden[i].float()
        mask[row, : hidden[i].shape[0]] = 1
    layout = build_layout(records, length).map(lambda a: torch.from_numpy(a).to(device))
    lexical = embedding.index_select(0, layout.option_token_ids)
    target = torch.tensor([g for i in items for g in gold[i]], device=device)
    return states.to(device), mask.to(device), lexical, layout, target


def _splicer(backbone_dir: Path, tokenizer: ReleaseTokenizer, examples: Sequence[Example], encoded, hidden,
             states: Mapping[str, Sequence[tuple[str, Any]]] | None, val: Sequence[tuple[int, ...]], cache: Path,
             device: str, config: TrainConfig) -> Splicer | None:
    """The epoch's source of spliced records: donors are the training (not validation) records with label rules;
    the rows of validation records are taken out of ``states``, so no validation state is trained on."""
    if not config.spliced:
        return None
    if not states:
        raise ValueError(f"spliced={config.spliced} needs the rows to draw states from (states={{source: rows}})")
    held_out = {i for unit in val for i in unit}
    held_texts = {examples[i].request["state"] for i in held_out if i < len(examples)}
    bank = cache_state_bank(backbone_dir, tokenizer, states, cache, device)  # all rows: one cache for every split
    keep = {source: [n for n, row in enumerate(rows) if row[0] not in held_texts] for source, rows in states.items()}
    pools = {source: [states[source][n] for n in kept] for source, kept in keep.items()}
    bank = {source: [bank[source][n] for n in kept] for source, kept in keep.items()}
    donors = [(i, e) for i, e in enumerate(examples) if i not in held_out and getattr(e, "rules", None)]
    return Splicer(tokenizer, max_length(backbone_dir), donors, encoded, hidden, pools, bank, gold_index)


def autocast_dtype(setting: str, device: str) -> torch.dtype | None:
    """The autocast dtype of training (``TrainConfig.autocast``) on ``device``; None runs float32 throughout."""
    if setting not in AUTOCAST:
        raise ValueError(f"autocast must be one of {', '.join(AUTOCAST)}, got {setting!r}")
    if setting == "off":
        return None
    if setting == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if torch.device(device).type != "cpu" else None


def train(backbone_dir: Path, examples: Sequence[Example], out: Path, *, work: Path,
          config: TrainConfig = TrainConfig(), validation: float = 0.05, device: str = "cpu",
          twins: Sequence[Twin] = (), cache: Path | None = None, init: Path | None = None,
          states: Mapping[str, Sequence[tuple[str, Any]]] | None = None) -> dict:
    """Cache hidden states, train the head, write it to ``out``; returns the training log.

    ``init`` fine-tunes an existing head (a directory with ``joint_head.*``, e.g. the packaged demo head): its
    architecture replaces ``config``'s width and layer counts, its weights are the starting point.

    The hidden-state cache lives in ``cache`` (default ``work/hidden``; several runs may share one).

    ``twins`` add a consistency term (``config.consistency_weight`` × symmetric KL between twin questions) on top
    of the supervised loss of their labelled questions.

    With ``config.spliced``, every epoch also draws that many spliced records (:mod:`.splicing`): the questions of
    an exact record that carries label rules, asked of the state of another row of its source in ``states``
    (``{source: [(text, gold), ...]}``; the rows of validation records are left out).
    """
    amp = autocast_dtype(config.autocast, device)  # a bad setting fails before minutes of caching, not after
    torch.manual_seed(config.seed)
    tokenizer = ReleaseTokenizer(backbone_dir)
    backbone_config = read_json(backbone_dir / "config.json")
    text_config = backbone_config.get("text_config") or backbone_config
    encoded, gold = encode_records(tokenizer, training_records(examples, twins), backbone_dir)
    cache = cache or work / "hidden"
    hidden = cache_hidden_states(backbone_dir, encoded, cache, device=device)
    embedding = output_embedding(backbone_dir, backbone_config, device)
    twins_of = {len(examples) + 2 * t: (len(examples) + 2 * t + 1, twin.same) for t, twin in enumerate(twins)}

    if init is not None:
        head, head_config = load_init_head(init, backbone_dir, int(text_config["hidden_size"]), device)
    else:
        head_config = config.head_config(int(text_config["hidden_size"]))
        head = JointSchemaHead(head_config).to(device)
        with torch.no_grad():
            head.joint_logit_scale.fill_(config.joint_scale_init)
    optimizer = torch.optim.AdamW(parameter_groups(head, config.weight_decay), lr=config.lr)
    rng = random.Random(config.seed)
    units: list[tuple[int, ...]] = [(i,) for i in range(len(examples))] + [(i, j) for i, (j, _) in twins_of.items()]
    rng.shuffle(units)
    n_val = int(len(units) * validation)
    val, fit = units[:n_val], units[n_val:]
    lengths = [len(e.input_ids) for e in encoded]
    splicer = _splicer(backbone_dir, tokenizer, examples, encoded, hidden, states, val, cache, device, config)
    steps_per_epoch = (len(units_to_batches(fit, config.batch_records, lengths))
                       + math.ceil(config.spliced / config.batch_records))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.epochs * steps_per_epoch))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint.pt"
    history: list[dict] = []
    first_epoch = 0
    if checkpoint.is_file():
        first_epoch, history = load_checkpoint(checkpoint, head, optimizer, scheduler, device, asdict(config))
    evidence = StateAttention(head) if config.state_attention_weight > 0 else None
    log.info("training in %s", f"{amp} autocast (float32 weights and losses)" if amp else "float32")
    device_type = torch.device(device).type
    with flush_denormals():  # trained heads and Adam's moments hold denormals: 1.1-2.9x slower steps
        for epoch in range(first_epoch, config.epochs):
            head.train()
            spliced = splicer.draw(config.spliced, random.Random(config.seed * 1000 + epoch + 1)) if splicer else None
            epoch_encoded = [*encoded, *(spliced.encoded if spliced else ())]
            epoch_gold = [*gold, *(spliced.gold if spliced else ())]
            epoch_hidden = EpochHidden(hidden, splicer, spliced)
            order = fit + [(i,) for i in range(len(encoded), len(epoch_encoded))]
            random.Random(config.seed * 1000 + epoch).shuffle(order)
            total = 0.0
            batches = units_to_batches(order, config.batch_records, [len(e.input_ids) for e in epoch_encoded])
            for items in tqdm(batches, desc=f"epoch {epoch + 1}/{config.epochs}"):
                hidden_states, mask, lexical, layout, target = record_batch(items, epoch_encoded, epoch_hidden,
                                                                            epoch_gold, embedding)
                if evidence is not None:
                    evidence.state_mask = state_mask([epoch_encoded[i] for i in items],
                                                     hidden_states.shape[1]).to(device)
                with torch.autocast(device_type, dtype=amp) if amp else contextlib.nullcontext():
                    logits = head(hidden_states, mask, lexical, layout).float()
                loss = question_loss(logits, target, config.label_smoothing, config.brier_weight)
                if evidence is not None:
                    loss = loss + config.state_attention_weight * evidence.loss()
                if twins_of:
                    pairs = twin_rows(items, epoch_encoded, twins_of)  # spliced records have no twins
                    loss = loss + config.consistency_weight * twin_loss(logits, pairs)
                total += optimizer_step(loss, optimizer, scheduler, head.parameters())
            metrics = {"epoch": epoch + 1, "train_loss": total / len(batches),
                       **evaluate(head, val, encoded, hidden, gold, embedding, config, twins_of)}
            history.append(metrics)
            log.info("epoch %d: %s", epoch + 1, metrics)
            save_checkpoint(checkpoint, head, optimizer, scheduler, history, asdict(config))
    if evidence is not None:
        evidence.remove()
    log_dict = {"config": asdict(config), "init": str(init) if init else None, "examples": len(examples),
                "twins": len(twins), "validation": len(val), "history": history}
    save_head(head, head_config, out, log_dict)
    return log_dict


@torch.no_grad()
def evaluate(head: JointSchemaHead, units: Sequence[tuple[int, ...]], encoded, hidden, gold, embedding,
             config: TrainConfig, twins_of: dict[int, tuple[int, dict[str, str]]] | None = None) -> dict:
    """Validation loss and accuracy (argmax = gold) over the labelled questions of ``units``; for twins, the mean
    and max |Δp| between twin questions (the robustness a conformance suite checks)."""
    head.eval()
    losses, correct, questions, moved = [], 0, 0, []
    for items in units_to_batches(units, config.batch_records):
        states, mask, lexical, layout, target = record_batch(items, encoded, hidden, gold, embedding)
        logits = head(states, mask, lexical, layout)
        labelled = target >= 0
        if bool(labelled.any()):
            losses.append(float(question_loss(logits, target, config.label_smoothing, config.brier_weight)))
            correct += int((logits.argmax(-1) == target)[labelled].sum())
            questions += int(labelled.sum())
        if rows := twin_rows(items, encoded, twins_of or {}):
            probs = torch.softmax(logits, -1).nan_to_num(0.0)
            moved += (probs[[a for a, _ in rows]] - probs[[b for _, b in rows]]).abs().amax(-1).tolist()
    metrics = {"val_loss": float(np.mean(losses)) if losses else float("nan"),
               "val_accuracy": correct / max(questions, 1)}
    if moved:
        metrics |= {"val_twin_mean_dp": float(np.mean(moved)), "val_twin_max_dp": float(np.max(moved))}
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="clef-local train-head",
        description="Train a joint schema head on a frozen backbone. Backbone hidden states are cached under --work "
                    "and a checkpoint is kept after every epoch, so an interrupted run resumes where it stopped.")
    parser.add_argument("--backbone", required=True, type=Path, help="backbone directory (config, weights, tokenizer)")
    parser.add_argument("--data", default="demo", help="'demo' (BANKING77 + NLU++ folds 0-15) or a JSONL file of "
                                                      '{"request": ..., "labels": {qid: answer}} lines')
    parser.add_argument("--out", required=True, type=Path, help="where to write joint_head.safetensors + config")
    parser.add_argument("--work", type=Path, help="cache and checkpoints (default: OUT.work); resumable")
    parser.add_argument("--method", choices=("full", "question-path", "state-path"), default="full",
                        help="full: every branch on cached whole-prompt hidden states; question-path: the head's "
                             "question and option-lexical path on question-span means only (export/question_path.py: "
                             "~5x fewer backbone tokens, every BANKING77 row on a CPU); state-path: choices answered "
                             "from the state's tokens and the options, nouls and scores from their question span "
                             "(export/state_path.py: answers that renamed ids, reordered or added questions cannot "
                             "move through the state)")
    parser.add_argument("--epochs", type=int,
                        help="passes over the training data (default: 8 full, 12 question-path, 8 state-path)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (caching and training)")
    parser.add_argument("--cache-only", action="store_true",
                        help="compute the hidden-state cache under --work and stop (e.g. on a GPU machine)")
    for name in (*(f.name for f in fields(HeadShape)), "batch_records"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(TrainConfig, name),
                            help=f"head/training setting (default {getattr(TrainConfig, name)})")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: 1e-3 full, 2e-3 question-path)")
    parser.add_argument("--consistency-weight", type=float,
                        help="weight of the twin consistency term (default 1)")
    parser.add_argument("--banking77", type=int, help="BANKING77 training records (demo data; default: 2000 full, "
                                                      "10003 question-path)")
    parser.add_argument("--nlupp", type=int, help="NLU++ training records (demo data; default: 1660, 3316)")
    parser.add_argument("--twins", type=int, help="twin requests for the consistency term (demo data; default: 0, "
                                                  "1500)")
    parser.add_argument("--max-options", type=int, metavar="N",
                        help="cap a choice's options (demo data; default: none full, 12 question-path, whose "
                             "choices are also asked over all 77 intents for free)")
    # 0.5: at 1,024 records, 77-way top-1 0.136 -> 0.195 and ECE 0.186 -> 0.082 (benchmarks/head_recipe.py, README)
    parser.add_argument("--hard-negatives", type=float, default=0.5, metavar="SHARE",
                        help="share of BANKING77 choice questions whose distractors are the gold intent's nearest "
                             "intents (demo data; default 0.5; 0 = random subsets, as the shipped head was trained)")
    parser.add_argument("--spliced", type=int, default=TrainConfig.spliced, metavar="N",
                        help="spliced records per epoch: a training record's questions asked of another row's state, "
                             "for the cost of a state-only pass (demo data; default %(default)s)")
    parser.add_argument("--joint-scale-init", type=float,
                        help="a fresh head's log cosine temperature (default: 0 full, 2.3 = x10 question-path; see "
                             "TrainConfig)")
    parser.add_argument("--state-attention-weight", type=float,
                        help="weight of -log(cross-attention mass on the state's tokens) (default: 0 full, "
                             "0.1 state-path)")
    parser.add_argument("--full-choice", type=float, default=FULL_CHOICE, metavar="SHARE",
                        help="share of BANKING77 choice questions over all 77 intents, the evaluation's question "
                             f"(demo data; default {FULL_CHOICE})")
    parser.add_argument("--autocast", choices=AUTOCAST, default=TrainConfig.autocast,
                        help="bf16 matmuls while training: auto (on accelerators), bf16 (also on a CPU) or off "
                             "(default %(default)s)")
    parser.add_argument("--label-smoothing", type=float, metavar="EPS",
                        help="label smoothing of the cross-entropy (default 0.05, as Clef was trained; 0 for a "
                             "calibration fine-tune, see clef_local/demo_model/MODEL_CARD.md)")
    parser.add_argument("--canonical-weight", type=float, metavar="W",
                        help="question path: loss weight of the records asked as the evaluation asks them (the demo "
                             "data's 77-way BANKING77 prompt; default 1)")
    parser.add_argument("--share", type=float, metavar="SHARE",
                        help="question path: share of the other training units to train on (default 1; with "
                             "--init, a fine-tune needs only their span means)")
    parser.add_argument("--init", type=Path, metavar="HEAD_DIR",
                        help="fine-tune this head (joint_head.* in HEAD_DIR, e.g. clef_local/demo_model) instead of "
                             "a fresh one; its architecture overrides --width and the layer counts")
    parser.add_argument("--adapters", metavar="SPEC",
                        help="train LoRA adapters on the backbone together with a question-path head "
                             "(clef_local/training/adapter_train.py), e.g. r=16 or r=16,alpha=32,layers=10")
    parser.add_argument("--records", type=int, default=6000,
                        help="--adapters: labelled decision records to draw (twins add their partners; default "
                             "%(default)s)")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="--adapters: stop at step N (a budget cut; resuming the same run without it goes on), "
                             "then validate and write the head and adapter")
    args = parser.parse_args(argv)
    if args.adapters is not None:
        if args.method not in ("full", "question-path"):
            parser.error(f"--adapters trains a question-path head; --method {args.method} cannot be combined")
        from clef_local.training.adapter_train import run_from_cli as run_adapters

        return run_adapters(parser, args, args.work or args.out.with_name(args.out.name + ".work"))
    defaults = CLI_DEFAULTS
    if args.method == "state-path":
        from clef_local.training import state_path_train

        state_path_train.refuse_options(parser, args)
        defaults = state_path_train.CLI_DEFAULTS
    elif args.method == "question-path":
        from clef_local.training import question_path_train

        question_path_train.refuse_full_options(parser, args)
        defaults = question_path_train.CLI_DEFAULTS
        if args.share is not None and not 0 < args.share <= 1:
            parser.error(f"--share is a share in (0, 1], got {args.share}")
        if args.canonical_weight is not None and not args.canonical_weight > 0:
            parser.error(f"--canonical-weight must be positive, got {args.canonical_weight}")
    elif args.canonical_weight is not None or args.share is not None:
        parser.error("--canonical-weight and --share belong to --method question-path")
    if args.state_attention_weight is not None and args.state_attention_weight < 0:
        parser.error(f"--state-attention-weight must be ≥ 0, got {args.state_attention_weight}")
    if args.label_smoothing is not None and not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing is in [0, 1), got {args.label_smoothing}")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    twins: list[Twin] = []
    states = None
    if args.data == "demo":
        from clef_local.training.demo_data import splice_states, training_examples, twin_records

        for flag, share in (("--hard-negatives", args.hard_negatives), ("--full-choice", args.full_choice)):
            if not 0 <= share <= 1:
                parser.error(f"{flag} is a share between 0 and 1, got {share}")
        examples: list[Example] = list(training_examples(args.banking77, args.nlupp, hard=args.hard_negatives,
                                                         max_options=args.max_options, full_share=args.full_choice))
        twins = twin_records(args.twins)
        states = splice_states() if args.spliced else None
    else:
        if args.spliced:
            parser.error("--spliced needs the demo data (--data demo): a JSONL file carries no label rules")
        examples = [Example(str(n), row["request"], row["labels"]) for n, row in
                    enumerate(json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip())]
    work = args.work or args.out.with_name(args.out.name + ".work")
    if args.method == "question-path":
        from clef_local.training.question_path_train import run_from_cli

        return run_from_cli(parser, args, examples, twins, work)
    if args.method == "state-path":
        from clef_local.training.state_path_train import run_from_cli as run_state_path

        return run_state_path(parser, args, examples, twins, work)
    config = settings_from_args(TrainConfig, args)
    if args.cache_only:
        tokenizer = ReleaseTokenizer(args.backbone)
        encoded, _ = encode_records(tokenizer, training_records(examples, twins), args.backbone)
        cache_hidden_states(args.backbone, encoded, work / "hidden", device=args.device)
        if states:
            cache_state_bank(args.backbone, tokenizer, states, work / "hidden", args.device)
        print(f"cached {len(encoded)} records under {work / 'hidden'}")
        return 0
    return print_last_epoch(train(args.backbone, examples, args.out, work=work, config=config, device=args.device,
                                  twins=twins, init=args.init, states=states))
