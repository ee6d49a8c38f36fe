"""``clef-local train-head``: a state-path head (:mod:`.state_path`) trained on a frozen backbone's cached outputs.

Two resumable stages under a work directory: :func:`prepare` encodes the records, cuts the validation split and
computes the caches (:mod:`.hidden_cache`; ``--cache-only`` stops there); :func:`train` trains the head on them,
checkpointed every epoch, then folds the temperature and the choice dominance into the weights it writes.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from clef_local.data.datasets import Example, Twin
from clef_local.formats.release import read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.encoding import render
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.config import TrainConfig
from clef_local.training.head_losses import logit_temperature, question_loss, state_mass_loss, twin_loss
from clef_local.training.hidden_cache import question_means
from clef_local.training.loop import (
    flush_denormals,
    load_checkpoint,
    optimizer_step,
    parameter_groups,
    save_checkpoint,
    save_head,
    warmup_cosine,
)
from clef_local.training.questions import Questions, Split, build_questions, split_units
from clef_local.training.records import (
    LexicalTable,
    encode_records,
    output_embedding,
    partner_pairs,
    training_records,
    units_to_batches,
)
from clef_local.training.state_path import (
    Distractors,
    Memories,
    StateBatch,
    distractor_bank,
    fold_choice_dominance,
    make_batch,
    state_bank,
    state_logits,
    state_path_head,
)
from clef_local.training.validation import ValidationTally, fold_temperature

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass
class Prepared:
    """Everything a run trains on, with its caches computed."""

    examples: int
    records: int
    questions: Questions
    split: Split
    memories: Memories
    distractors: Distractors
    lexical: torch.Tensor
    hidden_size: int


def prepare(backbone_dir: Path, examples: Sequence[Example], work: Path, config: TrainConfig,
            twins: Sequence[Twin] = (), device: str = "cpu", universe: Sequence[str] = (),
            canonical: Sequence[Example] = ()) -> Prepared:
    """Encode the records (``examples``, the twins' pairs, then ``canonical``: records asked exactly as an
    evaluation asks them), cut the validation split, and compute (or read) the three caches under ``work``."""
    tokenizer = ReleaseTokenizer(backbone_dir)
    backbone_config = read_json(backbone_dir / "config.json")
    hidden_size = int((backbone_config.get("text_config") or backbone_config)["hidden_size"])
    records = training_records(examples, twins, canonical)
    encoded, gold = encode_records(tokenizer, records, backbone_dir)
    table = LexicalTable(output_embedding(backbone_dir, backbone_config, "cpu"))
    split = split_units(tokenizer, encoded, gold, table, universe, len(examples), twins, random.Random(config.seed),
                        config.validation)

    state_text = [render(r.request["state"]) for r in records]
    texts = sorted(set(state_text))
    text_index = {t: n for n, t in enumerate(texts)}
    states = state_bank(backbone_dir, tokenizer, texts, work / "states", device=device)
    pick = random.Random(config.seed + 2)
    first_canonical = len(records) - len(canonical)
    bank_records = sorted(pick.sample(range(first_canonical), min(config.distractor_records, first_canonical))
                          + pick.sample(range(first_canonical, len(records)),
                                        min(config.canonical_distractors, len(canonical))))
    distractors = Distractors(distractor_bank(backbone_dir, [encoded[i] for i in bank_records],
                                              work / "distractors", device=device))
    needed = [i for i, r in enumerate(encoded) if any(q.question_type != TYPE_IDS["choice"] for q in r.questions)]
    found = dict(zip(needed, question_means(backbone_dir, [encoded[i] for i in needed], work / "question-means",
                                            device=device), strict=True))
    means = [found.get(i, np.zeros((len(r.questions), hidden_size), dtype=np.float32))
             for i, r in enumerate(encoded)]
    questions, _ = build_questions(tokenizer, encoded, gold, means, table, universe)
    log.info("%d records (%d states, %d distractor records, %d with span means), %d questions (%d full views), "
             "%d units, %d for validation", len(records), len(texts), len(bank_records), len(needed),
             len(questions.gold), int(questions.full_view.sum()), split.units, len(split.val))
    memories = Memories(states, [text_index[t] for t in state_text])
    return Prepared(len(examples), len(records), questions, split, memories, distractors, table.tensor().to(device),
                    hidden_size)


def train(backbone_dir: Path, examples: Sequence[Example], out: Path, *, work: Path,
          config: TrainConfig | None = None, twins: Sequence[Twin] = (), device: str = "cpu",
          universe: Sequence[str] = (), canonical: Sequence[Example] = ()) -> dict:
    """The caches of :func:`prepare`, then a state-path head trained on them, written to ``out`` (a release head:
    strict load, the choice dominance and the temperature folded in); returns the training log. ``config``
    defaults to :class:`TrainConfig`'s, the shipped head's recipe."""
    config = config or TrainConfig()
    torch.manual_seed(config.seed)
    data = prepare(backbone_dir, examples, work, config, twins, device, universe, canonical)
    questions, split, memories, distractors, lexical = (data.questions, data.split, data.memories, data.distractors,
                                                        data.lexical)
    partner = dict(split.twin_pairs)
    head_config = config.head_config(data.hidden_size)
    head = JointSchemaHead(head_config).to(device)
    trainable = state_path_head(head, config.joint_scale_init)
    optimizer = torch.optim.AdamW(parameter_groups(head, config.weight_decay), lr=config.lr)
    fit = list(split.fit)
    steps = config.epochs * len(units_to_batches(fit, config.batch_records))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, settings = work / CHECKPOINT, asdict(config)
    history: list[dict] = []
    if checkpoint.is_file():
        state = load_checkpoint(checkpoint, settings, device)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history = state["history"]
        log.info("resuming after epoch %d (%s)", len(history), checkpoint)
    with flush_denormals():
        for epoch in range(len(history), config.epochs):
            head.train()
            rng = random.Random(config.seed * 1000 + epoch)  # per epoch: a resumed run draws what it would have
            order = list(fit)
            rng.shuffle(order)
            total, batches = 0.0, units_to_batches(order, config.batch_records)
            for rows in tqdm(batches, desc=f"epoch {epoch + 1}/{config.epochs}"):
                batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
                total += optimizer_step(loss(head, batch, target, rows, partner, config), optimizer, scheduler,
                                        trainable)
            metrics = {"epoch": epoch + 1, "train_loss": total / len(batches),
                       **evaluate(head, questions, split, memories, lexical, distractors, partner, config)}
            history.append(metrics)
            log.info("epoch %d: %s", epoch + 1, metrics)
            save_checkpoint(checkpoint, {"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                                         "scheduler": scheduler.state_dict(), "history": history,
                                         "settings": settings})
    calibration: dict = {}
    if config.calibrate and split.val:
        logits, target = validation_logits(head, questions, split, memories, lexical, distractors)
        calibration = fold_temperature(head, logit_temperature(logits[target >= 0], target[target >= 0]),
                                       lambda: evaluate(head, questions, split, memories, lexical, distractors,
                                                        partner, config))
    fold_choice_dominance(head)
    log_dict = {"config": settings, "examples": len(examples), "twins": len(twins), "canonical": len(canonical),
                "states": len(memories.states), "questions": len(questions.gold), "units": split.units,
                "validation_units": len(split.val), "history": history, "calibration": calibration}
    save_head(head, head_config, out, log_dict)
    return log_dict


def loss(head: JointSchemaHead, batch: StateBatch, target: torch.Tensor, rows: Sequence[int],
         partner: dict[int, int], config: TrainConfig) -> torch.Tensor:
    """Label-smoothed cross-entropy + Brier per labelled question, the twins' symmetric KL and the routing layers'
    ``-log`` attention mass on prefix + state."""
    logits, mass = state_logits(head, batch)
    value = question_loss(logits, target, config.label_smoothing, config.brier_weight)
    if pairs := partner_pairs(sorted(rows), partner):
        value = value + config.consistency_weight * twin_loss(logits, pairs)
    return value + config.state_attention_weight * state_mass_loss(mass)


def _validation_batches(split: Split) -> list[list[int]]:
    return units_to_batches(split.val, 64)


@torch.no_grad()
def validation_logits(head: JointSchemaHead, questions: Questions, split: Split, memories: Memories,
                      lexical: torch.Tensor, distractors: Distractors) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[rows, K]`` of every validation row (the same distractors every call) and their gold."""
    head.eval()
    rng = random.Random(12345)
    width = questions.options.shape[1]
    chunks, golds = [], []
    for rows in _validation_batches(split):
        batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
        logits, _ = state_logits(head, batch)
        chunks.append(torch.nn.functional.pad(logits, (0, width - logits.shape[1]), value=float("-inf")))
        golds.append(target)
    return torch.cat(chunks), torch.cat(golds)


@torch.no_grad()
def evaluate(head: JointSchemaHead, questions: Questions, split: Split, memories: Memories, lexical: torch.Tensor,
             distractors: Distractors, partner: dict[int, int], config: TrainConfig) -> dict:
    """Validation loss, accuracy (all labelled rows; the full views alone), NLL, ECE (15 bins), twin |Δp| and the
    routing layers' mean attention mass on prefix + state."""
    head.eval()
    rng = random.Random(12345)
    tally, masses = ValidationTally(config.label_smoothing, config.brier_weight), []
    for rows in _validation_batches(split):
        rows = sorted(rows)
        batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
        logits, mass = state_logits(head, batch)
        masses.append(float(mass.mean()))
        tally.add(logits, target, questions.full_view[torch.tensor(rows)].to(logits.device),
                  partner_pairs(rows, partner))
    return tally.metrics(val_state_mass=float(np.mean(masses))) if tally.hits else {}
