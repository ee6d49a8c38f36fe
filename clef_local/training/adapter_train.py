"""``clef-local train-head --adapters r=16``: LoRA adapters on the backbone's top layers trained together with a
whole-record joint schema head, Clef's own recipe, for a machine with a GPU.

A frozen backbone leaves a head no way to make a question's span ignore what surrounds it; adapters let the backbone
learn that too. The recipe (data, loss, checkpoints, output): docs/demo-model.md ("Adapters on the backbone").
"""

from __future__ import annotations

import logging
import math
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
from clef_local.formats.release import read_json
from clef_local.heads.torch_head import JointSchemaHead
from clef_local.runtime.encoding import EncodedRecord
from clef_local.runtime.layout import HeadLayout, build_layout
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.config import HeadShape, setting
from clef_local.training.head_losses import logit_temperature, question_loss, twin_loss
from clef_local.training.hidden_cache import cache_dtype
from clef_local.training.loop import (
    flush_denormals,
    load_checkpoint,
    load_init_head,
    parameter_groups,
    save_checkpoint,
    save_head,
    warmup_cosine,
)
from clef_local.training.lora import AdapterSpec, LoraLinear, adapter_factors, add_adapters
from clef_local.training.records import encode_records, training_records, twin_rows, units_to_batches
from clef_local.training.validation import ValidationTally, apply_temperature

log = logging.getLogger(__name__)

CHECKPOINT = "adapter_checkpoint.pt"


@dataclass(frozen=True)
class AdapterConfig(HeadShape):
    """``clef-local train-head --adapters SPEC``; ``rank``, ``alpha`` and ``adapter_layers`` come from SPEC."""

    records: int = setting(6000, "labelled decision records drawn (twins add their partners): one pass over them")
    rank: int = setting(16, "LoRA rank")
    alpha: float = setting(32.0, "LoRA scale alpha / rank = 2")
    adapter_layers: int = setting(10, "the top third of SmolLM2-135M's 30 layers: backward through 10, not 30")
    batch_records: int = setting(16, "records per step")
    lr: float = setting(5e-4, "the adapters' peak learning rate")
    head_lr: float = setting(2e-4, "the head's: small steps, its inputs move with the adapters (not measured for "
                                   "a whole-record head)")
    weight_decay: float = setting(0.01, "the head's matrices; adapters are not decayed")
    label_smoothing: float = setting(0.05, "as Clef was trained")
    brier_weight: float = setting(1.0, "the Brier term keeps the probabilities calibrated, not only the argmax")
    consistency_weight: float = setting(2.0, "x symmetric KL between twin questions' answers")
    span_weight: float = setting(1.0, "x mean squared distance between twin questions' span means (unit-variance "
                                      "features): the representation must not move")
    joint_scale_init: float = setting(2.3, "a fresh head's log cosine temperature (x10); a head from --init keeps "
                                           "its own")
    validation: float = setting(0.03, "share of units held out for the metrics and the temperature fit")
    checkpoint_steps: int = setting(10, "steps between checkpoints")
    seed: int = setting(0, "data draws, split, adapters' and head's initialisation")

    @property
    def spec(self) -> AdapterSpec:
        return AdapterSpec(rank=self.rank, alpha=self.alpha, layers=self.adapter_layers)


def question_span_means(hidden: torch.Tensor, layout: HeadLayout) -> torch.Tensor:
    """``[Q, hidden]`` means of the un-affine layer norm of ``hidden`` (``[B, T, h]``) over every question span of
    ``layout``, differentiable."""
    normed = F.layer_norm(hidden.float(), hidden.shape[-1:]).reshape(-1, hidden.shape[-1])
    lengths = layout.question_token_offsets.diff()
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    sums = normed.new_zeros(len(lengths), normed.shape[-1]).index_add(0, segment,
                                                                      normed[layout.question_token_index])
    return sums / lengths[:, None].to(sums.dtype)


class AdapterModel:
    """The backbone (:class:`~clef_local.backends.torch_backend.TorchBackbone`, as inference loads it) with LoRA
    adapters, and the head; :meth:`forward` is the training forward: whole records → logits."""

    def __init__(self, backbone_dir: Path, config: AdapterConfig, device: str, init: Path | None = None,
                 dtype: torch.dtype | None = None) -> None:
        from clef_local.backends.torch_backend import TorchBackbone

        self.device = torch.device(device)
        self.backbone = TorchBackbone(backbone_dir, read_json(backbone_dir / "config.json"), device=device,
                                      dtype=dtype or cache_dtype(device), host_embeddings=False)
        self.adapted: dict[str, LoraLinear] = add_adapters(self.backbone.model, config.spec, seed=config.seed)
        hidden_size = int(self.backbone.model.config.get_text_config().hidden_size)
        if init is not None:
            self.head, self.head_config = load_init_head(init, hidden_size, device)
        else:
            self.head_config = config.head_config(hidden_size)
            self.head = JointSchemaHead(self.head_config).to(device)
            with torch.no_grad():
                self.head.joint_logit_scale.fill_(config.joint_scale_init)
        tokenizer = ReleaseTokenizer(backbone_dir)
        self.pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0

    def adapter_parameters(self) -> list[torch.nn.Parameter]:
        return [p for module in self.adapted.values() for p in (module.lora_A, module.lora_B)]

    def forward(self, records: Sequence[EncodedRecord]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits ``[Q, K]``, question-span means ``[Q, hidden]`` of the un-affine layer norm) of ``records``,
        record then question order: the adapted text model over every token, then the head's own forward."""
        from clef_local.backends.torch_pass import collate

        ids, mask = collate(list(records), self.pad_id, self.device)
        hidden = self.backbone.text_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        layout = build_layout(records, ids.shape[1]).map(lambda a: torch.from_numpy(a).to(self.device))
        lexical = self.backbone.lexical_rows(layout.option_token_ids).detach()
        logits = self.head(hidden.float(), mask, lexical.float(), layout)
        return logits, question_span_means(hidden, layout)

    def train(self, mode: bool = True) -> None:
        self.backbone.model.train(mode)
        self.head.train(mode)


def train_adapters(backbone_dir: Path, examples: Sequence[Example], twins: Sequence[Twin], out: Path, *,
                   work: Path, config: AdapterConfig = AdapterConfig(), device: str = "cpu",
                   init: Path | None = None, max_steps: int | None = None, dtype: torch.dtype | None = None) -> dict:
    """Train adapters and a head on ``examples`` and ``twins``; write the head files and the adapter to ``out``;
    returns the training log. ``dtype``: the backbone's compute dtype (default: the caches', BF16 on a GPU).

    ``max_steps`` cuts the run short at that step (a budget): the schedule stays the full run's, so a run cut at its
    last checkpoint and resumed with the same settings and no cut goes on exactly where it stopped."""
    torch.manual_seed(config.seed)
    tokenizer = ReleaseTokenizer(backbone_dir)
    encoded, gold = encode_records(tokenizer, training_records(examples, twins), backbone_dir)
    twins_of = {len(examples) + 2 * t: (len(examples) + 2 * t + 1, twin.same) for t, twin in enumerate(twins)}
    units: list[tuple[int, ...]] = [(i,) for i in range(len(examples))] + [(i, j) for i, (j, _) in twins_of.items()]
    random.Random(config.seed).shuffle(units)
    n_val = max(1, int(len(units) * config.validation)) if len(units) > 1 else 0
    val, fit = units[:n_val], units[n_val:]
    lengths = [len(r.input_ids) for r in encoded]
    batches = units_to_batches(fit, config.batch_records, lengths)
    log.info("%d records (%d twins), %d training batches, %d validation units; %d tokens to train on",
             len(encoded), len(twins), len(batches), len(val), sum(lengths[i] for u in fit for i in u))

    model = AdapterModel(backbone_dir, config, device, init, dtype)
    head_groups = [{**g, "lr": config.head_lr} for g in parameter_groups(model.head, config.weight_decay)]
    optimizer = torch.optim.AdamW([{"params": model.adapter_parameters(), "lr": config.lr, "weight_decay": 0.0},
                                   *head_groups])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(len(batches)))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / CHECKPOINT
    settings = asdict(config) | {"init": str(init) if init else None, "records_encoded": len(encoded)}
    first, history = 0, list[dict]()
    if checkpoint.is_file():
        first, history = _restore(load_checkpoint(checkpoint, settings, model.device), model, optimizer, scheduler)
        log.info("resuming at step %d of %s", first, checkpoint)
    started, tokens, window = time.perf_counter(), 0, []
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    stop = len(batches) if max_steps is None else min(len(batches), max_steps)
    model.train()
    with flush_denormals():
        for step in range(first, stop):
            items = batches[step]
            logits, means = model.forward([encoded[i] for i in items])
            target = torch.tensor([g for i in items for g in gold[i]], device=model.device)
            loss = question_loss(logits, target, config.label_smoothing, config.brier_weight)
            if pairs := twin_rows(items, encoded, twins_of):
                a, b = [p for p, _ in pairs], [q for _, q in pairs]
                loss = (loss + config.consistency_weight * twin_loss(logits, pairs)
                        + config.span_weight * (means[a] - means[b]).pow(2).mean())
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
                save_checkpoint(checkpoint, _checkpoint_state(model, optimizer, scheduler, step + 1, settings,
                                                              history))
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
                "steps": max(first, stop), "planned_steps": len(batches), "examples": len(examples),
                "twins": len(twins), "validation_units": len(val), "history": history, "validation": metrics,
                "calibration": calibration}
    save_head(model.head, model.head_config, out, log_dict)
    save_adapter(out / ADAPTER_FILE, adapter_factors(model.adapted), rank=config.rank, scale=config.spec.scale)
    return log_dict


def _checkpoint_state(model: AdapterModel, optimizer: torch.optim.Optimizer, scheduler, step: int, settings: dict,
                      history: list[dict]) -> dict:
    adapters = {name: {"A": m.lora_A.detach().cpu(), "B": m.lora_B.detach().cpu()}
                for name, m in model.adapted.items()}
    return {"adapters": adapters, "head": model.head.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "step": step, "settings": settings, "history": history}


def _restore(state: dict, model: AdapterModel, optimizer: torch.optim.Optimizer, scheduler
             ) -> tuple[int, list[dict]]:
    with torch.no_grad():
        for name, module in model.adapted.items():
            module.lora_A.copy_(state["adapters"][name]["A"])
            module.lora_B.copy_(state["adapters"][name]["B"])
    model.head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]), list(state.get("history", []))


@torch.no_grad()
def _validate(model: AdapterModel, units: Sequence[tuple[int, ...]], encoded: Sequence[EncodedRecord],
              gold: Sequence[Sequence[int]], twins_of: dict[int, tuple[int, dict[str, str]]], config: AdapterConfig
              ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Validation metrics (:class:`ValidationTally`), and every question's logits and gold (padded to one width)
    for the temperature fit."""
    tally = ValidationTally(config.label_smoothing, config.brier_weight)
    all_logits, all_target = [], []
    for items in units_to_batches(units, config.batch_records):
        logits, _ = model.forward([encoded[i] for i in items])
        target = torch.tensor([g for i in items for g in gold[i]], device=model.device)
        tally.add(logits, target, torch.zeros_like(target, dtype=torch.bool), twin_rows(items, encoded, twins_of))
        all_logits.append(logits.cpu())
        all_target.append(target.cpu())
    if not all_logits:
        raise ValueError("no validation units: raise the validation share or the number of records")
    width = max(x.shape[1] for x in all_logits)
    logits = torch.cat([F.pad(x, (0, width - x.shape[1]), value=-math.inf) for x in all_logits])
    return tally.metrics(), logits, torch.cat(all_target)
