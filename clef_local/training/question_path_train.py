"""The training loop of the question-path method (:mod:`.question_path`): questions, not records, are the unit.

A question-path head treats every question on its own (its field layers are zero), so a batch is a set of
questions, and twins (the same question renamed, reordered or in other company) are kept in the same batch for the
consistency term. Because a question's span precedes its own options, one cached span mean answers any option set:
``views`` re-asks the choice questions whose gold is in a given option universe over all of it (the demo data: every
BANKING77 choice also as the full 77-way question the evaluation asks), for no backbone cost.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from clef_local.data.datasets import Example, Twin
from clef_local.errors import ReleaseError
from clef_local.formats.release import read_json
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.encoding import option_semantics
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import (
    HeadShape,
    ValidationTally,
    demo_universe,
    encode_records,
    fold_temperature,
    load_init_head,
    optimizer_step,
    output_embedding,
    partner_pairs,
    print_last_epoch,
    save_head,
    settings_from_args,
    trainable_groups,
    training_records,
    units_to_batches,
    warmup_cosine,
)
from clef_local.training.head_losses import logit_temperature, question_loss, twin_loss
from clef_local.training.question_path import (
    PRIOR_OFF,
    LexicalTable,
    QuestionBatch,
    means_cached,
    question_means,
    question_path_head,
    question_path_logits,
    zeroed_parameters,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PathConfig(HeadShape):
    """Settings of :func:`train_question_path`; the head's routing and field layers are zero in this path, but
    present so that ``--init`` can train them later."""

    epochs: int = 12  # ~30 s each here (questions, not records); the validation loss flattens by epoch 10
    lr: float = 2e-3
    weight_decay: float = 0.01
    # Steps, not epochs, bound this path: 3,000 rows reached 0.858 77-way top-1 in 940 steps of 64, 0.825 in 235
    # of 256 at 3x the rate.
    batch_questions: int = 128
    label_smoothing: float = 0.05  # as Clef was trained
    brier_weight: float = 1.0
    consistency_weight: float = 1.0  # 5: twin |dp| 0.095 -> 0.077, 77-way ECE 0.083 -> 0.057, NLU++ F1 0.32 -> 0.16
    joint_scale_init: float = 2.3  # cosine temperature x10 from the start (the full method's finding)
    # One temperature fitted on the validation questions (NLL) and folded into the head's weights: label smoothing
    # and questions asked in varied company leave the head underconfident on a plain prompt (ECE 0.10 -> 0.02).
    calibrate: bool = True
    # Loss weight of the canonical records (the evaluation's own prompt): the head shares one confidence scale across
    # wordings, and was left underconfident on that prompt (held-out logit multiplier 1.25; other 77-way wordings 1.00)
    canonical_weight: float = 1.0
    # Share of the other training units a run trains on (canonical ones always): a fine-tune (``init``) of an existing
    # head needs the span means of that share only; 1 for a head trained from scratch
    share: float = 1.0
    seed: int = 0


# The settings a flag left unset takes with --method question-path. It reads ~90 tokens per 77-way question instead
# of 1,670, so it can afford every BANKING77 row, twice the NLU++ rows and twins (~6.5 M tokens, ~50 min here).
CLI_DEFAULTS: dict[str, object] = {"epochs": PathConfig.epochs, "lr": PathConfig.lr, "banking77": 10003, "nlupp": 3316,
                                   "twins": 1500, "max_options": 12, "joint_scale_init": PathConfig.joint_scale_init,
                                   "consistency_weight": PathConfig.consistency_weight,
                                   "canonical_weight": PathConfig.canonical_weight, "share": PathConfig.share,
                                   "label_smoothing": PathConfig.label_smoothing}


@dataclass
class Questions:
    """Every training question (and view) as arrays: span mean, type, gold, padded lexical-option ids."""

    means: torch.Tensor  # [N, hidden]
    types: torch.Tensor  # [N]
    gold: torch.Tensor  # [N], -1 without a label
    options: torch.Tensor  # [N, K] ids into the lexical table, -1 padding
    full_view: torch.Tensor  # [N] bool: a view over the whole universe

    def batch(self, rows: torch.Tensor, lexical: torch.Tensor) -> tuple[QuestionBatch, torch.Tensor]:
        options = self.options[rows]
        width = int((options >= 0).sum(-1).max())
        options = options[:, :width]
        question, slot = (options >= 0).nonzero(as_tuple=True)
        used, index = options[question, slot].unique(return_inverse=True)
        batch = QuestionBatch(self.means[rows], self.types[rows], question, slot, lexical[used], index, width)
        return batch, self.gold[rows]


def build_questions(tokenizer: ReleaseTokenizer, encoded, gold, means, table: LexicalTable,
                    universe: Sequence[str] = ()) -> tuple[Questions, list[list[int]]]:
    """The question table and, per record, the rows of its questions (views are extra rows, not listed)."""
    universe_ids = [table.row(ids) for ids in tokenizer.encode_pieces([option_semantics(u, None)
                                                                       for u in sorted(universe)])] if universe else []
    order = sorted(universe)
    rows_of: list[list[int]] = []
    vecs: list[np.ndarray] = []
    types, golds, options, views = [], [], [], []
    for record, labels, record_means in zip(encoded, gold, means, strict=True):
        rows_of.append([])
        for j, question in enumerate(record.questions):
            rows_of[-1].append(len(vecs))
            vecs.append(record_means[j])
            types.append(question.question_type)
            golds.append(labels[j])
            options.append(table.lookup(record, j))
            views.append(False)
            gold_id = question.option_ids[labels[j]] if labels[j] >= 0 else None
            if (universe and question.question_type == TYPE_IDS["choice"] and gold_id in universe
                    and set(question.option_ids) <= set(universe) and len(question.option_ids) < len(universe)):
                vecs.append(record_means[j])
                types.append(question.question_type)
                assert gold_id is not None  # it is in the universe
                golds.append(order.index(gold_id))
                options.append(universe_ids)
                views.append(True)
    width = max(len(o) for o in options)
    padded = torch.full((len(options), width), -1, dtype=torch.long)
    for n, o in enumerate(options):
        padded[n, : len(o)] = torch.tensor(o)
    return Questions(torch.from_numpy(np.stack(vecs)), torch.tensor(types), torch.tensor(golds), padded,
                     torch.tensor(views)), rows_of


def _units(rows_of: list[list[int]], n_examples: int, encoded, twins: Sequence[Twin], total_rows: int
           ) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Units of rows that train together (a record's questions and views; a twin's two records) and the twin row
    pairs; the records are ``n_examples`` examples, then the twins' two records each, then any others."""
    starts = [rows[0] for rows in rows_of] + [total_rows]  # a record's rows (questions, views) are contiguous
    units = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    pairs: list[tuple[int, int]] = []
    merged: list[list[int]] = units[:n_examples]
    for t, twin in enumerate(twins):
        i, j = n_examples + 2 * t, n_examples + 2 * t + 1
        where = {q.question_id: k for k, q in enumerate(encoded[j].questions)}
        pairs += [(rows_of[i][k], rows_of[j][where[twin.same[q.question_id]]])
                  for k, q in enumerate(encoded[i].questions) if q.question_id in twin.same]
        merged.append(units[i] + units[j])
    return merged + units[n_examples + 2 * len(twins):], pairs  # records after the twins train on their own


@dataclass(frozen=True)
class Split:
    """A run's units (lists of question rows that train together), cut into validation and fit."""

    rows_of: list[list[int]]  # per record, the rows of its questions (views are extra rows, not listed)
    val: list[list[int]]
    fit: list[list[int]]
    twin_pairs: list[tuple[int, int]]

    @property
    def units(self) -> int:
        return len(self.val) + len(self.fit)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [rows[0] for rows in self.rows_of]

    def record_of(self, row: int) -> int:
        """The record a row belongs to (a record's rows, its questions then their views, are contiguous)."""
        return bisect.bisect_right(self._starts, row) - 1


def split_units(tokenizer: ReleaseTokenizer, encoded, gold, table: LexicalTable, universe: Sequence[str],
                n_examples: int, twins: Sequence[Twin], rng: random.Random, validation: float) -> Split:
    """The units of :func:`train_question_path` and its validation split (``rng`` shuffles them, then keeps going
    for the epochs); it needs only each record's row count, so it runs before any span mean is computed."""
    placeholder = [np.zeros((len(r.questions), 1), dtype=np.float32) for r in encoded]
    laid_out, rows_of = build_questions(tokenizer, encoded, gold, placeholder, table, universe)
    units, twin_pairs = _units(rows_of, n_examples, encoded, twins, len(laid_out.gold))
    rng.shuffle(units)
    n_val = int(len(units) * validation)
    return Split(rows_of, units[:n_val], units[n_val:], twin_pairs)


def _initial_head(init: Path | None, backbone_dir: Path, hidden_size: int, config: PathConfig, device: str
                  ) -> tuple[JointSchemaHead, HeadConfig]:
    """A fresh question-path head, or ``init``'s (which must be one), with only the path's parameters trainable."""
    if init is None:
        head_config = config.head_config(hidden_size)
        head = JointSchemaHead(head_config).to(device)
        question_path_head(head, config.joint_scale_init)
        return head, head_config
    head, head_config = load_init_head(init, backbone_dir, hidden_size, device)
    zeroed = zeroed_parameters(head)
    state = head.state_dict()
    live = [name for name in zeroed if bool(state[name].any())]
    if live or float(head.prior_logit_scale.detach()) > PRIOR_OFF / 2:
        raise ReleaseError(f"--init {init}: not a question-path head ({(live or ['prior_logit_scale'])[0]} is not "
                           "off); fine-tune it with --method full")
    frozen = {*zeroed, "prior_logit_scale"}
    for name, param in head.named_parameters():
        param.requires_grad_(name not in frozen)
    return head, head_config


def train_question_path(backbone_dir: Path, examples: Sequence[Example], out: Path, *, work: Path,
                        config: PathConfig = PathConfig(), twins: Sequence[Twin] = (), device: str = "cpu",
                        universe: Sequence[str] = (), canonical: Sequence[Example] = (),
                        validation: float = 0.05, init: Path | None = None) -> dict:
    """Question-span means (cached under ``work``), then a question-path head trained on them, written to ``out``.

    ``canonical``: records asked exactly as an evaluation asks them (the demo data: BANKING77's 77-way question
    with its fixed instruction, once per training row), so that the head is calibrated on that prompt and not only
    on the varied ones; they come after the twins, so the caches of runs without them are reused.
    ``init``: fine-tune this question-path head (a directory with ``joint_head.*``) instead of a fresh one; the
    validation split is the same as a fresh run's on the same records, so its temperature is fitted on questions
    the head never trained on.
    """
    torch.manual_seed(config.seed)
    tokenizer = ReleaseTokenizer(backbone_dir)
    backbone_config = read_json(backbone_dir / "config.json")
    text_config = backbone_config.get("text_config") or backbone_config
    records = training_records(examples, twins, canonical)
    encoded, gold = encode_records(tokenizer, records, backbone_dir)
    table = LexicalTable(output_embedding(backbone_dir, backbone_config, "cpu"))
    rng = random.Random(config.seed)
    split = split_units(tokenizer, encoded, gold, table, universe, len(examples), twins, rng, validation)
    val, fit, record_of = split.val, split.fit, split.record_of
    first_canonical = len(records) - len(canonical)
    if config.share < 1:
        share_rng = random.Random(config.seed + 1)
        fit = [u for u in fit if record_of(u[0]) >= first_canonical or share_rng.random() < config.share]
    cache = work / "question-means"
    if (config.share < 1 or init is not None) and not means_cached(encoded, cache, device=device):
        # only the means it trains on, in two calls (validation, fit: blocks are named by their records, so a rerun
        # of the same split reuses them); in the work directory of a full run it reads that run's cache instead
        needed = [sorted({record_of(r) for unit in part for r in unit}) for part in (val, fit)]
        found = {i: m for part in needed for i, m in zip(part, question_means(
            backbone_dir, [encoded[i] for i in part], cache, device=device), strict=True)}
        hidden = int(text_config["hidden_size"])
        means = [found.get(i, np.zeros((len(r.questions), hidden), dtype=np.float32)) for i, r in enumerate(encoded)]
    else:
        means = question_means(backbone_dir, encoded, cache, device=device)
    questions, _ = build_questions(tokenizer, encoded, gold, means, table, universe)
    lexical = table.tensor().to(device)
    partner = dict(split.twin_pairs)
    row_weight = torch.ones(len(questions.gold), device=device)
    if canonical and config.canonical_weight != 1:
        row_weight[split.rows_of[first_canonical][0]:] = config.canonical_weight  # canonical records' rows come last

    head, head_config = _initial_head(init, backbone_dir, int(text_config["hidden_size"]), config, device)
    optimizer = torch.optim.AdamW(trainable_groups(head, config.weight_decay), lr=config.lr)
    steps = config.epochs * math.ceil(sum(map(len, fit)) / config.batch_questions)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    questions = Questions(*(t.to(device) for t in (questions.means, questions.types, questions.gold,
                                                  questions.options, questions.full_view)))
    log.info("question path: %d questions (%d full views), %d units, %d for validation",
             len(questions.gold), int(questions.full_view.sum()), split.units, len(val))
    history: list[dict] = []
    for epoch in range(config.epochs):
        head.train()
        rng.shuffle(fit)
        total, batches = 0.0, units_to_batches(fit, config.batch_questions)
        for rows in tqdm(batches, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False):
            total += optimizer_step(_loss(head, questions, rows, lexical, partner, config, row_weight), optimizer,
                                    scheduler,
                                    [p for p in head.parameters() if p.requires_grad])
        metrics = {"epoch": epoch + 1, "train_loss": total / len(batches),
                   **evaluate(head, questions, val, lexical, partner, config)}
        history.append(metrics)
        log.info("epoch %d: %s", epoch + 1, metrics)
    calibration: dict = {}
    if config.calibrate and val:
        calibration = fold_temperature(head, fit_temperature(head, questions, val, lexical),
                                       lambda: evaluate(head, questions, val, lexical, partner, config))
    log_dict = {"method": "question-path", "config": asdict(config), "init": str(init) if init else None,
                "examples": len(examples),
                "twins": len(twins), "canonical": len(canonical), "questions": len(questions.gold),
                "units": split.units, "validation_units": len(val), "history": history, "calibration": calibration}
    save_head(head, head_config, out, log_dict)
    (work / "question-path-log.json").write_text(json.dumps(log_dict, indent=2) + "\n")
    return log_dict


def _loss(head, questions: Questions, rows: list[int], lexical, partner: dict[int, int], config: PathConfig,
          row_weight: torch.Tensor | None = None):
    index = torch.tensor(rows, device=lexical.device)
    batch, target = questions.batch(index, lexical)
    logits = question_path_logits(head, batch)
    weights = None if row_weight is None else row_weight[index]
    loss = question_loss(logits, target, config.label_smoothing, config.brier_weight, weights)
    if pairs := partner_pairs(rows, partner):
        loss = loss + config.consistency_weight * twin_loss(logits, pairs)
    return loss


@torch.no_grad()
def evaluate(head, questions: Questions, units: Sequence[list[int]], lexical, partner: dict[int, int],
             config: PathConfig) -> dict:
    """Validation loss, accuracy (all labelled rows; the full views alone), NLL, ECE (15 bins) and twin |Δp|."""
    head.eval()
    rows = [r for unit in units for r in unit]
    if not rows:
        return {}
    tally = ValidationTally(config.label_smoothing, config.brier_weight)
    for chunk in units_to_batches(units, 1024):
        index = torch.tensor(chunk, device=lexical.device)
        batch, target = questions.batch(index, lexical)
        tally.add(question_path_logits(head, batch), target, questions.full_view[index], partner_pairs(chunk, partner))
    return tally.metrics()


def refuse_full_options(parser, args) -> None:
    """Fail before any work on the full method's options, which a question-path run would silently ignore."""
    refused = [flag for flag, unset in (("--spliced", args.spliced == 0),
                                         ("--state-attention-weight", args.state_attention_weight is None),
                                         ("--autocast", args.autocast == "auto")) if not unset]
    if refused:
        parser.error(f"{', '.join(refused)}: not used by --method question-path (it trains on question-span means "
                     "only); drop them or use --method full")


def run_from_cli(parser, args, examples: Sequence[Example], twins: Sequence[Twin], work: Path) -> int:
    """``clef-local train-head --method question-path``."""
    universe, canonical = demo_universe(args.data)  # the canonical records cost ~1 M tokens here
    config = settings_from_args(PathConfig, args)
    if args.cache_only:
        encoded, _ = encode_records(ReleaseTokenizer(args.backbone), training_records(examples, twins), args.backbone)
        question_means(args.backbone, encoded, work / "question-means", device=args.device)
        print(f"cached the question-span means of {len(encoded)} records under {work / 'question-means'}")
        return 0
    return print_last_epoch(train_question_path(args.backbone, examples, args.out, work=work, config=config,
                                                twins=twins, device=args.device, universe=universe,
                                                canonical=canonical, init=args.init))


@torch.no_grad()
def fit_temperature(head, questions: Questions, units: Sequence[list[int]], lexical) -> float:
    """The logit temperature of least NLL on ``units``' labelled questions (:func:`.head_losses.logit_temperature`)."""
    head.eval()
    rows = torch.tensor([r for unit in units for r in unit if int(questions.gold[r]) >= 0], device=lexical.device)
    batch, target = questions.batch(rows, lexical)
    return logit_temperature(question_path_logits(head, batch), target)
