"""The training loop of the state-path method (:mod:`.state_path`): records are the unit, each with its state's
cached hidden states as memory, followed by a random stretch of another record's schema (a distractor).

The question table, views and validation split are the question path's (:mod:`.question_path_train`): a choice whose
gold is a BANKING77 intent is also asked over all 77, and every BANKING77 training row is asked once as the
evaluation asks it ("canonical" records). Choices need no backbone pass at all (they read the state and their
options), so the canonical records cost only their state; nouls and scores read their question-span means, computed
for the records that hold one.
"""

from __future__ import annotations

import json
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
from clef_local.training.common import (
    HeadShape,
    ValidationTally,
    demo_universe,
    encode_records,
    flush_denormals,
    fold_temperature,
    load_checkpoint,
    optimizer_step,
    output_embedding,
    partner_pairs,
    print_last_epoch,
    save_checkpoint,
    save_head,
    settings_from_args,
    trainable_groups,
    training_records,
    units_to_batches,
    warmup_cosine,
)
from clef_local.training.head_losses import logit_temperature, question_loss, twin_loss
from clef_local.training.question_path import LexicalTable, question_means
from clef_local.training.question_path_train import Questions, Split, build_questions, split_units
from clef_local.training.state_path import (
    StateBatch,
    distractor_bank,
    fold_dominance,
    fold_whitening,
    state_bank,
    state_mass_loss,
    state_path_head,
    state_path_logits,
    twin_whitening,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatePathConfig(HeadShape):
    """Settings of :func:`train_state_path`; the routing layer is the one that reads the state, the field layers'
    outputs are zero (present for the release format)."""

    epochs: int = 8  # a state-only prototype's 77-way top-1 was still rising at epoch 8
    lr: float = 3e-4  # the full method's 1e-3 leaves the routing layer stuck at the uniform loss
    weight_decay: float = 0.01
    batch_records: int = 32
    label_smoothing: float = 0.05  # as Clef was trained
    brier_weight: float = 1.0
    consistency_weight: float = 1.0
    state_attention_weight: float = 0.1  # x -log(attention mass on prefix + state): else choices read the schema
    joint_scale_init: float = 2.3  # cosine temperature x10 from the start (the full method's finding)
    distractor_records: int = 256  # records whose schema hidden states are the distractor bank (one full pass each)
    canonical_distractors: int = 32  # of them, canonical records: a 77-option schema is 1,600 tokens
    calibrate: bool = True  # one temperature fitted on the validation questions and folded into the weights
    whitening: float = 0.0  # > 0: strength of state_path.twin_whitening of the nouls' and scores' span means; off
    seed: int = 0


# The settings a flag left unset takes with --method state-path. Choices cost only their state (every BANKING77
# row is a canonical record); the backbone passes go to the nouls' and scores' span means.
CLI_DEFAULTS: dict[str, object] = {"epochs": StatePathConfig.epochs, "lr": StatePathConfig.lr, "banking77": 4000,
                                   "nlupp": 3316, "twins": 1000, "max_options": 12,
                                   "joint_scale_init": StatePathConfig.joint_scale_init,
                                   "state_attention_weight": StatePathConfig.state_attention_weight,
                                   "consistency_weight": StatePathConfig.consistency_weight,
                                   "label_smoothing": StatePathConfig.label_smoothing}


class Distractors:
    """Random stretches of other records' schema hidden states, appended to a memory after the state."""

    def __init__(self, bank: Sequence[torch.Tensor], min_tokens: int = 16) -> None:
        if not bank:
            raise ValueError("the distractor bank is empty")
        self.bank, self.min_tokens = bank, min_tokens

    @property
    def longest(self) -> int:
        return max(len(source) for source in self.bank)

    def draw(self, rng: random.Random, cap: int | None = None) -> torch.Tensor:
        """A stretch of one bank record, ``min_tokens`` to ``cap`` tokens long (as long as that record allows)."""
        source = self.bank[rng.randrange(len(self.bank))]
        longest = len(source) if cap is None else max(1, min(cap, len(source)))
        size = rng.randint(min(self.min_tokens, longest), longest)
        start = rng.randint(0, len(source) - size)
        return source[start : start + size]


@dataclass
class Memories:
    """Per record, the index of its state's hidden states in ``states`` (prefix + state)."""

    states: Sequence[torch.Tensor]
    state_of: list[int]


def make_batch(rows: Sequence[int], questions: Questions, split: Split, memories: Memories, lexical: torch.Tensor,
               distractors: Distractors | None, rng: random.Random) -> tuple[StateBatch, torch.Tensor]:
    """The :class:`StateBatch` of question ``rows`` (whole records, as units give them) and their gold indices."""
    rows = sorted(rows)
    records = sorted({split.record_of(r) for r in rows})
    position = {record: n for n, record in enumerate(records)}
    parts, state_len = [], []
    # one length cap per batch: a batch pads to its longest memory, so mixing 20- and 1,600-token distractors in
    # every batch would cost the longest every step
    cap = rng.randint(distractors.min_tokens, distractors.longest) if distractors is not None else None
    for record in records:
        state = memories.states[memories.state_of[record]].float()
        tail = [distractors.draw(rng, cap).float()] if distractors is not None else []
        parts.append(torch.cat([state, *tail]))
        state_len.append(len(state))
    width = max(len(p) for p in parts)
    memory = torch.zeros(len(parts), width, parts[0].shape[-1])
    pad = torch.ones(len(parts), width, dtype=torch.bool)
    state_mask = torch.zeros(len(parts), width, dtype=torch.bool)
    for n, part in enumerate(parts):
        memory[n, : len(part)] = part
        pad[n, : len(part)] = False
        state_mask[n, : state_len[n]] = True
    index = torch.tensor(rows)
    options = questions.options[index]
    question, slot = (options >= 0).nonzero(as_tuple=True)
    used, option_lexical = options[question, slot].unique(return_inverse=True)
    question_record = torch.tensor([position[split.record_of(r)] for r in rows])
    option_record = question_record[question]
    record_slot = torch.zeros_like(option_record)
    counts = [0] * len(records)
    for n, record in enumerate(option_record.tolist()):  # options in row then slot order: a running count
        record_slot[n] = counts[record]
        counts[record] += 1
    device = lexical.device
    batch = StateBatch(memory.to(device), pad.to(device), state_mask.to(device), questions.means[index].to(device),
                       questions.types[index].to(device), question_record.to(device), question.to(device),
                       slot.to(device), option_record.to(device), record_slot.to(device), lexical[used],
                       option_lexical.to(device), int((options >= 0).sum(-1).max()), max(counts))
    return batch, questions.gold[index].to(device)


def _needs_means(record) -> bool:
    return any(q.question_type != TYPE_IDS["choice"] for q in record.questions)


@dataclass
class Prepared:
    """Everything a state-path run trains on, with its caches computed."""

    examples: int
    records: int
    questions: Questions
    split: Split
    memories: Memories
    distractors: Distractors
    lexical: torch.Tensor
    hidden_size: int


def prepare(backbone_dir: Path, examples: Sequence[Example], work: Path, config: StatePathConfig,
            twins: Sequence[Twin] = (), device: str = "cpu", universe: Sequence[str] = (),
            canonical: Sequence[Example] = (), validation: float = 0.05) -> Prepared:
    """Encode the records, cut the validation split, and compute (or read) the three caches under ``work``: the
    prefix + state hidden states of every distinct state, the distractor records' schema hidden states, and the
    span means of the records that hold a noul or a score."""
    tokenizer = ReleaseTokenizer(backbone_dir)
    backbone_config = read_json(backbone_dir / "config.json")
    hidden_size = int((backbone_config.get("text_config") or backbone_config)["hidden_size"])
    records = training_records(examples, twins, canonical)
    encoded, gold = encode_records(tokenizer, records, backbone_dir)
    table = LexicalTable(output_embedding(backbone_dir, backbone_config, "cpu"))
    split = split_units(tokenizer, encoded, gold, table, universe, len(examples), twins, random.Random(config.seed),
                        validation)

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
    needed = [i for i, r in enumerate(encoded) if _needs_means(r)]
    found = dict(zip(needed, question_means(backbone_dir, [encoded[i] for i in needed], work / "question-means",
                                            device=device), strict=True))
    means = [found.get(i, np.zeros((len(r.questions), hidden_size), dtype=np.float32))
             for i, r in enumerate(encoded)]
    questions, _ = build_questions(tokenizer, encoded, gold, means, table, universe)
    log.info("state path: %d records (%d states, %d distractor records, %d with span means), %d questions "
             "(%d full views), %d units, %d for validation", len(records), len(texts), len(bank_records), len(needed),
             len(questions.gold), int(questions.full_view.sum()), split.units, len(split.val))
    memories = Memories(states, [text_index[t] for t in state_text])
    return Prepared(len(examples), len(records), questions, split, memories, distractors, table.tensor().to(device),
                    hidden_size)


def train_state_path(backbone_dir: Path, examples: Sequence[Example], out: Path, *, work: Path,
                     config: StatePathConfig = StatePathConfig(), twins: Sequence[Twin] = (), device: str = "cpu",
                     universe: Sequence[str] = (), canonical: Sequence[Example] = (),
                     validation: float = 0.05) -> dict:
    """The caches of :func:`prepare`, then a state-path head trained on them, written to ``out`` (a release head:
    strict load, the choice row of the type embedding folded in)."""
    torch.manual_seed(config.seed)
    data = prepare(backbone_dir, examples, work, config, twins, device, universe, canonical, validation)
    questions, split, memories, distractors, lexical = (data.questions, data.split, data.memories, data.distractors,
                                                        data.lexical)
    partner = dict(split.twin_pairs)
    transform = None
    if config.whitening > 0:
        read_span = [(a, b) for a, b in split.twin_pairs if int(questions.types[a]) != TYPE_IDS["choice"]]
        transform = twin_whitening(questions.means, read_span, config.whitening)
        questions.means = questions.means @ transform
        log.info("whitening the span means by %d twin pairs (strength %g)", len(read_span), config.whitening)

    head_config = config.head_config(data.hidden_size)
    head = JointSchemaHead(head_config).to(device)
    state_path_head(head, config.joint_scale_init)
    optimizer = torch.optim.AdamW(trainable_groups(head, config.weight_decay), lr=config.lr)
    fit = list(split.fit)
    steps = config.epochs * len(units_to_batches(fit, config.batch_records))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    checkpoint = work / "state-path-checkpoint.pt"
    history: list[dict] = []
    first_epoch = 0
    if checkpoint.is_file():
        first_epoch, history = load_checkpoint(checkpoint, head, optimizer, scheduler, device, asdict(config))
    with flush_denormals():
        for epoch in range(first_epoch, config.epochs):
            head.train()
            rng = random.Random(config.seed * 1000 + epoch)  # per epoch: a resumed run draws what it would have
            order = list(fit)
            rng.shuffle(order)
            total, batches = 0.0, units_to_batches(order, config.batch_records)
            for rows in tqdm(batches, desc=f"epoch {epoch + 1}/{config.epochs}"):
                batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
                total += optimizer_step(_loss(head, batch, target, rows, partner, config), optimizer, scheduler,
                                        [p for p in head.parameters() if p.requires_grad])
            metrics = {"epoch": epoch + 1, "train_loss": total / len(batches),
                       **evaluate(head, questions, split, memories, lexical, distractors, partner, config)}
            history.append(metrics)
            log.info("epoch %d: %s", epoch + 1, metrics)
            save_checkpoint(checkpoint, head, optimizer, scheduler, history, asdict(config))
    calibration: dict = {}
    if config.calibrate and split.val:
        logits, target = _validation_logits(head, questions, split, memories, lexical, distractors)
        calibration = fold_temperature(head, logit_temperature(logits[target >= 0], target[target >= 0]),
                                       lambda: evaluate(head, questions, split, memories, lexical, distractors,
                                                        partner, config))
    fold_dominance(head)
    if transform is not None:
        fold_whitening(head, transform)
    log_dict = {"method": "state-path", "config": asdict(config), "examples": len(examples), "twins": len(twins),
                "canonical": len(canonical), "states": len(memories.states), "questions": len(questions.gold),
                "units": split.units, "validation_units": len(split.val), "history": history,
                "calibration": calibration}
    save_head(head, head_config, out, log_dict)
    (work / "state-path-log.json").write_text(json.dumps(log_dict, indent=2) + "\n")
    return log_dict


def _loss(head, batch: StateBatch, target: torch.Tensor, rows: Sequence[int], partner: dict[int, int],
          config: StatePathConfig) -> torch.Tensor:
    logits, mass = state_path_logits(head, batch)
    loss = question_loss(logits, target, config.label_smoothing, config.brier_weight)
    if pairs := partner_pairs(sorted(rows), partner):
        loss = loss + config.consistency_weight * twin_loss(logits, pairs)
    return loss + config.state_attention_weight * state_mass_loss(mass)


def _validation_batches(split: Split) -> list[list[int]]:
    return units_to_batches(split.val, 64)


@torch.no_grad()
def _validation_logits(head, questions: Questions, split: Split, memories: Memories, lexical, distractors
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[rows, K]`` of every validation row (the same distractors every call) and their gold."""
    head.eval()
    rng = random.Random(12345)
    width = questions.options.shape[1]
    chunks, golds = [], []
    for rows in _validation_batches(split):
        batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
        logits, _ = state_path_logits(head, batch)
        chunks.append(torch.nn.functional.pad(logits, (0, width - logits.shape[1]), value=float("-inf")))
        golds.append(target)
    return torch.cat(chunks), torch.cat(golds)


@torch.no_grad()
def evaluate(head, questions: Questions, split: Split, memories: Memories, lexical, distractors,
             partner: dict[int, int], config: StatePathConfig) -> dict:
    """Validation loss, accuracy (all labelled rows; the full views alone), NLL, ECE (15 bins), twin |Δp| and the
    routing layers' mean attention mass on prefix + state."""
    head.eval()
    rng = random.Random(12345)
    tally, masses = ValidationTally(config.label_smoothing, config.brier_weight), []
    for rows in _validation_batches(split):
        rows = sorted(rows)
        batch, target = make_batch(rows, questions, split, memories, lexical, distractors, rng)
        logits, mass = state_path_logits(head, batch)
        masses.append(float(mass.mean()))
        tally.add(logits, target, questions.full_view[torch.tensor(rows)].to(logits.device),
                  partner_pairs(rows, partner))
    return tally.metrics(val_state_mass=float(np.mean(masses))) if tally.hits else {}


def refuse_options(parser, args) -> None:
    """Fail before any work on options the state path would silently ignore."""
    refused = [flag for flag, unset in (("--spliced", args.spliced == 0), ("--autocast", args.autocast == "auto"),
                                         ("--init", args.init is None),
                                         ("--canonical-weight", args.canonical_weight is None),
                                         ("--share", args.share is None)) if not unset]
    if refused:
        parser.error(f"{', '.join(refused)}: not used by --method state-path; drop them")


def run_from_cli(parser, args, examples: Sequence[Example], twins: Sequence[Twin], work: Path) -> int:
    """``clef-local train-head --method state-path``."""
    universe, canonical = demo_universe(args.data)  # the canonical records cost only their states here
    config = settings_from_args(StatePathConfig, args)
    if args.cache_only:
        data = prepare(args.backbone, examples, work, config, twins, args.device, universe, canonical)
        print(f"cached the states, distractors and span means of {data.records} records under {work}")
        return 0
    return print_last_epoch(train_state_path(args.backbone, examples, args.out, work=work, config=config,
                                             twins=twins, device=args.device, universe=universe,
                                             canonical=canonical))


