"""Train low-rank adapters on the backbone together with a question-path head: ``clef-local train-head --adapters
r=16``.

A frozen backbone left the demo head no way to make a question's span ignore what surrounds it (renamed ids, other
questions, their order): its hidden states are what they are. Clef was trained with adapters on the backbone, the
head and the backbone learning together on synthetic permutations; this is that recipe at demo scale:

- the head is a **question-path** head (:mod:`.question_path`): it reads each question's span mean and the options'
  output-embedding rows only, so the backbone runs only up to the last question span, in training as at inference
  (``clef_local.runtime.head_reach``: a 77-way question costs ~90 positions, not ~1,670);
- LoRA adapters (:mod:`.lora`) on the attention and MLP projections of the top decoder layers learn with it, by
  backpropagation through the backbone (the layers below carry no gradient, so the pass below them is inference);
- the data is :mod:`.decision_data` (BANKING77, NLU++, VADER, severity ladders; negations, paraphrases and twins);
- the loss is label-smoothed cross-entropy + Brier per labelled question, the twins' symmetric KL, and the mean
  squared distance between twin questions' span means (the representation itself must not move, not only the
  answers of the questions trained on).

One pass over the records (their number sets the budget), checkpointed every ``checkpoint_steps`` steps (adapters,
head, optimiser, schedule; atomically), so a killed run resumes at its last checkpoint. The output directory gets
the head files, ``backbone_adapter.safetensors`` (:mod:`clef_local.demo.adapter`, which merges it into a backbone)
and ``training_log.json``; a temperature fitted on the validation questions is folded into the head.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clef_local.data.datasets import Example, Twin
from clef_local.demo.adapter import ADAPTER_FILE, save_adapter
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.encoding import EncodedRecord
from clef_local.runtime.head_reach import question_reach
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import (
    HeadShape,
    ValidationTally,
    encode_records,
    flush_denormals,
    load_init_head,
    parameter_groups,
    save_head,
    training_records,
    twin_rows,
    units_to_batches,
    warmup_cosine,
)
from clef_local.training.head_losses import logit_temperature, question_loss, twin_loss
from clef_local.training.lora import AdapterSpec, LoraLinear, adapter_factors, add_adapters
from clef_local.training.question_path import (
    LexicalTable,
    QuestionBatch,
    apply_temperature,
    freeze_branches,
    question_path_logits,
    zeroed_parameters,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterConfig(HeadShape):
    """Settings of :func:`train_adapters`."""

    records: int = 6000  # labelled records drawn from decision_data (twins add their partners)
    rank: int = 16
    alpha: float = 32.0
    adapter_layers: int = 10  # the top third of SmolLM2-135M's 30: backward through 10 layers, not 30
    batch_records: int = 16
    lr: float = 5e-4  # the adapters'
    head_lr: float = 2e-4  # a head started from a trained one (--init) needs small steps
    weight_decay: float = 0.01  # the head's matrices; adapters are not decayed
    label_smoothing: float = 0.05  # as Clef was trained
    brier_weight: float = 1.0
    consistency_weight: float = 2.0  # symmetric KL between twin questions' answers
    span_weight: float = 1.0  # mean squared distance between twin questions' span means (unit-variance features)
    joint_scale_init: float = 2.3  # a fresh head's cosine temperature (x10); a head from --init keeps its own
    validation: float = 0.03
    checkpoint_steps: int = 10
    seed: int = 0

    @property
    def spec(self) -> AdapterSpec:
        return AdapterSpec(rank=self.rank, alpha=self.alpha, layers=self.adapter_layers)


def _span_means(hidden: torch.Tensor, records: Sequence[EncodedRecord]) -> torch.Tensor:
    """``[Q, hidden]`` means of the un-affine layer norm of ``hidden`` (``[B, T, h]``) over every question span of
    ``records`` (record then question order), differentiable."""
    normed = F.layer_norm(hidden.float(), hidden.shape[-1:])
    length = hidden.shape[1]
    flat: list[int] = []
    segments: list[int] = []
    counts: list[int] = []
    for row, record in enumerate(records):
        for question in record.questions:
            start, end = question.question_span
            flat.extend(range(row * length + start, row * length + end))
            segments.extend([len(counts)] * (end - start))
            counts.append(end - start)
    device = hidden.device
    index = torch.tensor(flat, device=device)
    sums = torch.zeros(len(counts), normed.shape[-1], device=device).index_add(
        0, torch.tensor(segments, device=device), normed.reshape(-1, normed.shape[-1])[index])
    return sums / torch.tensor(counts, device=device, dtype=sums.dtype)[:, None]


def _question_batch(means: torch.Tensor, records: Sequence[EncodedRecord], table: LexicalTable
                    ) -> QuestionBatch:
    types, option_question, option_slot, rows = [], [], [], []
    q = 0
    for record in records:
        for k, question in enumerate(record.questions):
            types.append(question.question_type)
            looked = table.lookup(record, k)
            option_question += [q] * len(looked)
            option_slot += list(range(len(looked)))
            rows += looked
            q += 1
    device = means.device
    used, index = torch.tensor(rows).unique(return_inverse=True)
    lexical = torch.stack([table.rows[int(u)] for u in used]).to(device)
    return QuestionBatch(means, torch.tensor(types, device=device), torch.tensor(option_question, device=device),
                         torch.tensor(option_slot, device=device), lexical, index.to(device),
                         max(option_slot) + 1)


class AdapterModel:
    """The backbone with adapters and the head, and the batch forward of training: span means → logits."""

    def __init__(self, backbone_dir: Path, config: AdapterConfig, device: str, init: Path | None) -> None:
        from transformers import AutoModelForCausalLM

        from clef_local.training.hidden_cache import cache_dtype

        self.device = torch.device(device)
        self.dtype = cache_dtype(device)
        self.model = AutoModelForCausalLM.from_pretrained(backbone_dir, dtype=self.dtype, local_files_only=True)
        self.model.config.use_cache = False
        self.model.to(self.device)
        self.adapted: dict[str, LoraLinear] = add_adapters(self.model, config.spec, seed=config.seed)
        self.text_model = self.model.model
        hidden_size = int(self.model.config.hidden_size)
        if init is not None:
            self.head, self.head_config = load_init_head(init, backbone_dir, hidden_size, device)
            scale = float(self.head.joint_logit_scale.detach())
        else:
            self.head_config = config.head_config(hidden_size)
            self.head = JointSchemaHead(self.head_config).to(device)
            scale = config.joint_scale_init
        freeze_branches(self.head, zeroed_parameters(self.head), scale)
        embedding = self.model.get_output_embeddings().weight.detach().float()
        self.table = LexicalTable(embedding)
        tokenizer = ReleaseTokenizer(backbone_dir)
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0

    def adapter_parameters(self) -> list[torch.nn.Parameter]:
        return [p for module in self.adapted.values() for p in (module.lora_A, module.lora_B)]

    def forward(self, records: Sequence[EncodedRecord]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits ``[Q, K]``, span means ``[Q, hidden]``) of ``records``, record then question order. The backbone
        runs over each record up to its last question span only (all the head reads); the options' lexical rows
        come from the whole record's token ids."""
        reach = [question_reach(r) for r in records]
        ids = torch.full((len(records), max(reach)), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(records), max(reach), dtype=torch.long)
        for row, (record, cut) in enumerate(zip(records, reach, strict=True)):
            ids[row, :cut] = torch.tensor(record.input_ids[:cut])
            mask[row, :cut] = 1
        out = self.text_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        means = _span_means(out.last_hidden_state, records)
        batch = _question_batch(means, records, self.table)
        return question_path_logits(self.head, batch), means

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        self.head.train(mode)


def _checkpoint_state(model: AdapterModel, optimizer, scheduler, step: int, settings: dict,
                      history: list[dict]) -> dict:
    adapters = {name: {"A": m.lora_A.detach().cpu(), "B": m.lora_B.detach().cpu()}
                for name, m in model.adapted.items()}
    return {"adapters": adapters, "head": model.head.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "step": step, "settings": settings, "history": history}


def _restore(path: Path, model: AdapterModel, optimizer, scheduler, settings: dict) -> tuple[int, list[dict]]:
    state = torch.load(path, weights_only=False, map_location=model.device)
    if state.get("settings") != settings:
        changed = sorted(k for k in {*state.get("settings", {}), *settings}
                         if state.get("settings", {}).get(k) != settings.get(k))
        raise ValueError(f"{path} is the checkpoint of a run with other settings ({', '.join(changed)}); delete it "
                         "to start over, or pass another --work")
    with torch.no_grad():
        for name, module in model.adapted.items():
            module.lora_A.copy_(state["adapters"][name]["A"])
            module.lora_B.copy_(state["adapters"][name]["B"])
    model.head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    log.info("resuming at step %d of %s", state["step"], path)
    return int(state["step"]), list(state.get("history", []))


def _save(path: Path, state: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _pairs(items: Sequence[int], encoded, twins_of) -> list[tuple[int, int]]:
    return twin_rows(items, encoded, twins_of)


def train_adapters(backbone_dir: Path, examples: Sequence[Example], twins: Sequence[Twin], out: Path, *,
                   work: Path, config: AdapterConfig = AdapterConfig(), device: str = "cpu",
                   init: Path | None = None, max_steps: int | None = None) -> dict:
    """Train adapters and a question-path head on ``examples`` and ``twins``; write the head files and the adapter
    to ``out``; returns the training log.

    ``max_steps`` cuts the run short at that step (a budget): the schedule stays the full run's, so a run cut at its
    last checkpoint and resumed with the same settings and no cut would go on exactly where it stopped."""
    torch.manual_seed(config.seed)
    tokenizer = ReleaseTokenizer(backbone_dir)
    encoded, gold = encode_records(tokenizer, training_records(examples, twins), backbone_dir)
    twins_of = {len(examples) + 2 * t: (len(examples) + 2 * t + 1, twin.same) for t, twin in enumerate(twins)}
    units: list[tuple[int, ...]] = [(i,) for i in range(len(examples))] + [(i, j) for i, (j, _) in twins_of.items()]
    random.Random(config.seed).shuffle(units)
    n_val = max(1, int(len(units) * config.validation)) if len(units) > 1 else 0
    val, fit = units[:n_val], units[n_val:]
    lengths = [question_reach(r) for r in encoded]
    batches = units_to_batches(fit, config.batch_records, lengths)
    log.info("%d records (%d twins), %d training batches, %d validation units; %d tokens to train on",
             len(encoded), len(twins), len(batches), len(val), sum(lengths[i] for u in fit for i in u))

    model = AdapterModel(backbone_dir, config, device, init)
    head_groups = [{**g, "lr": config.head_lr, "params": [p for p in g["params"] if p.requires_grad]}
                   for g in parameter_groups(model.head, config.weight_decay)]
    optimizer = torch.optim.AdamW([{"params": model.adapter_parameters(), "lr": config.lr, "weight_decay": 0.0},
                                   *head_groups])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(len(batches)))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "adapter_checkpoint.pt"
    settings = asdict(config) | {"init": str(init) if init else None, "records_encoded": len(encoded)}
    first, history = (_restore(checkpoint, model, optimizer, scheduler, settings) if checkpoint.is_file()
                      else (0, []))
    started, tokens, window = time.perf_counter(), 0, []
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    stop = len(batches) if max_steps is None else min(len(batches), max_steps)
    model.train()
    with flush_denormals():
        for step in range(first, stop):
            items = batches[step]
            records = [encoded[i] for i in items]
            logits, means = model.forward(records)
            target = torch.tensor([g for i in items for g in gold[i]], device=model.device)
            loss = question_loss(logits, target, config.label_smoothing, config.brier_weight)
            pairs = _pairs(items, encoded, twins_of)
            if pairs:
                loss = loss + config.consistency_weight * twin_loss(logits, pairs)
                a, b = [p for p, _ in pairs], [q for _, q in pairs]
                loss = loss + config.span_weight * (means[a] - means[b]).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            tokens += sum(lengths[i] for i in items)
            window.append(float(loss.detach()))
            if (step + 1) % 10 == 0 or step + 1 == stop:
                elapsed = time.perf_counter() - started
                log.info("step %d/%d loss %.4f (last 10) %.2f ms/token", step + 1, len(batches),
                         float(np.mean(window)), 1e3 * elapsed / max(tokens, 1))
                history.append({"step": step + 1, "loss": float(np.mean(window))})
                window = []
            if (step + 1) % config.checkpoint_steps == 0 or step + 1 == stop:
                _save(checkpoint, _checkpoint_state(model, optimizer, scheduler, step + 1, settings, history))
    model.train(False)
    metrics, logits, target = _validate(model, val, encoded, gold, twins_of, config)
    calibration = {}
    if bool((target >= 0).any()):
        temperature = logit_temperature(logits[target >= 0], target[target >= 0])
        apply_temperature(model.head, temperature)
        after, _, _ = _validate(model, val, encoded, gold, twins_of, config)
        calibration = {"temperature": temperature, "val_nll_before": metrics["val_nll"], "val_nll": after["val_nll"],
                       "val_ece_before": metrics["val_ece"], "val_ece": after["val_ece"]}
        log.info("validation %s; temperature %.3f folded in: NLL %.4f -> %.4f", metrics, temperature,
                 metrics["val_nll"], after["val_nll"])
    log_dict = {"method": "adapters", "config": asdict(config), "init": str(init) if init else None,
                "steps": max(first, stop),
                "planned_steps": len(batches),
                "examples": len(examples), "twins": len(twins), "validation_units": len(val),
                "history": history, "validation": metrics, "calibration": calibration}
    save_head(model.head, model.head_config, out, log_dict)
    save_adapter(out / ADAPTER_FILE, adapter_factors(model.adapted), rank=config.rank, scale=config.spec.scale)
    return log_dict


@torch.no_grad()
def _validate(model: AdapterModel, units: Sequence[tuple[int, ...]], encoded, gold, twins_of,
              config: AdapterConfig) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Validation metrics (:class:`ValidationTally`), and every labelled question's logits and gold (padded to one
    width) for the temperature fit."""
    tally = ValidationTally(config.label_smoothing, config.brier_weight)
    all_logits, all_target = [], []
    for items in units_to_batches(units, config.batch_records):
        logits, _ = model.forward([encoded[i] for i in items])
        target = torch.tensor([g for i in items for g in gold[i]], device=model.device)
        tally.add(logits, target, torch.zeros_like(target, dtype=torch.bool), _pairs(items, encoded, twins_of))
        all_logits.append(logits.cpu())
        all_target.append(target.cpu())
    if not all_logits:
        raise ValueError("no validation units: raise --validation or the number of records")
    width = max(x.shape[1] for x in all_logits)
    logits = torch.cat([F.pad(x, (0, width - x.shape[1]), value=-math.inf) for x in all_logits])
    return tally.metrics(), logits, torch.cat(all_target)


def run_from_cli(parser: argparse.ArgumentParser, args: argparse.Namespace, work: Path) -> int:
    """``train-head --adapters SPEC``: decision data (``--records``), resumable training, the head + adapter."""
    from clef_local.training.common import print_last_epoch
    from clef_local.training.decision_data import decision_data

    if args.data != "demo":
        parser.error("--adapters trains on the decision data (--data demo)")
    try:
        spec = AdapterSpec.parse(args.adapters)
    except ValueError as exc:
        parser.error(str(exc))
    config = AdapterConfig(records=args.records, rank=spec.rank, alpha=spec.alpha, adapter_layers=spec.layers,
                           batch_records=args.batch_records, width=args.width, routing_layers=args.routing_layers,
                           layers=args.layers, heads=args.heads, feedforward=args.feedforward,
                           **({"lr": args.lr} if args.lr is not None else {}))
    examples, twins = decision_data(config.records, seed=config.seed)
    result = train_adapters(args.backbone, examples, twins, args.out, work=work, config=config, device=args.device,
                            init=args.init, max_steps=args.max_steps)
    return print_last_epoch({"history": [result["validation"] | {"calibration": result["calibration"]}]})
