"""What the three head-training methods share (:mod:`.train_head`, :mod:`.question_path_train`,
:mod:`.state_path_train`): the head's shape, encoding the training records, batching units, the optimiser and its
schedule, validation metrics and calibration, and the checkpoint and head files they write."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from clef_local.data.datasets import Example, Twin
from clef_local.errors import ReleaseError
from clef_local.formats.release import read_head_config, read_json
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.quality.metrics import ece
from clef_local.runtime.encoding import EncodedRecord, encode_request
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.head_losses import question_loss
from clef_local.training.question_path import apply_temperature

log = logging.getLogger(__name__)

Settings = TypeVar("Settings")


@dataclass(frozen=True)
class HeadShape:
    """The head's architecture, the same default for every method (each method's settings extend it)."""

    width: int = 256  # small: the demo head ships inside the repository (a few MB)
    routing_layers: int = 1  # one evidence-routing pass is enough for single-message states
    layers: int = 2  # field layers let questions of a record inform each other
    heads: int = 4  # 64-dim attention heads at width 256
    feedforward: int = 512  # 2x width keeps the head small; the backbone carries the language

    def head_config(self, hidden_size: int) -> HeadConfig:
        """The :class:`HeadConfig` of a fresh head of this shape on a backbone of ``hidden_size``."""
        return HeadConfig(hidden_size=hidden_size, width=self.width, routing_layers=self.routing_layers,
                          layers=self.layers, heads=self.heads, feedforward=self.feedforward)


def settings_from_args(settings: type[Settings], args: argparse.Namespace) -> Settings:
    """A method's settings dataclass from the ``train-head`` flags: every field that is also a flag takes the flag's
    value (the method's ``CLI_DEFAULTS`` have filled in the flags left unset), the others keep their defaults."""
    names = [f.name for f in dataclasses.fields(settings)]  # type: ignore[arg-type]
    return settings(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def gold_index(question_type: int, option_ids: Sequence[str], label: object) -> int:
    """The gold option's index; ``-1`` for a question without a label (it then only counts in twin consistency)."""
    if label is None:
        return -1
    if question_type == 0:
        return 0 if label else 1  # noul options are true, false
    return list(option_ids).index(str(label))


def encode_examples(tokenizer: ReleaseTokenizer, examples: Sequence[Example], max_length: int
                    ) -> list[tuple[EncodedRecord, list[int]]]:
    """Each example's encoding and the gold option index of each question (model order)."""
    out = []
    for example in examples:
        encoded = encode_request(tokenizer, validate_request(example.request), max_length=max_length)
        gold = [gold_index(q.question_type, q.option_ids, example.labels.get(q.question_id))
                for q in encoded.questions]
        out.append((encoded, gold))
    return out


def max_length(backbone_dir: Path) -> int:
    """The longest request (in tokens) the backbone in ``backbone_dir`` reads: its ``max_position_embeddings``."""
    config = read_json(backbone_dir / "config.json")
    return int((config.get("text_config") or config).get("max_position_embeddings", 16384))


def training_records(examples: Sequence[Example], twins: Sequence[Twin] = (),
                     canonical: Sequence[Example] = ()) -> list[Example]:
    """The records a run encodes, in the order its caches and units index them: ``examples``, each twin's two
    records, then ``canonical``."""
    return [*examples, *(e for twin in twins for e in (twin.first, twin.second)), *canonical]


def encode_records(tokenizer: ReleaseTokenizer, records: Sequence[Example], backbone_dir: Path
                   ) -> tuple[list[EncodedRecord], list[list[int]]]:
    """:func:`encode_examples` at ``backbone_dir``'s :func:`max_length`, as two lists: the encodings and each
    record's gold option indices."""
    pairs = encode_examples(tokenizer, records, max_length(backbone_dir))
    return [e for e, _ in pairs], [g for _, g in pairs]


def output_embedding(backbone_dir: Path, backbone_config: dict, device: str) -> torch.Tensor:
    """The backbone's output-embedding matrix (float32, no gradient): the rows the options' lexical vectors read."""
    from clef_local.backends.torch_backend import TorchBackbone

    return TorchBackbone(backbone_dir, backbone_config, device=device, dtype=torch.float32).output_embedding.detach()


def partner_pairs(rows: Sequence[int], partner: dict[int, int]) -> list[tuple[int, int]]:
    """Positions in ``rows`` of every twin pair (``partner``: question row -> its twin's row) whose both rows are
    there."""
    at = {r: n for n, r in enumerate(rows)}
    return [(at[a], at[b]) for a, b in partner.items() if a in at and b in at]


def twin_rows(items: Sequence[int], encoded, twins_of: dict[int, tuple[int, dict[str, str]]]
               ) -> list[tuple[int, int]]:
    """Row pairs (first, second) in the batch's logits for every twin question whose partner is in the batch."""
    offsets, row = {}, 0
    for i in items:
        offsets[i] = row
        row += len(encoded[i].questions)
    pairs = []
    for i in items:
        if i in twins_of and twins_of[i][0] in offsets:
            j, same = twins_of[i]
            where = {q.question_id: k for k, q in enumerate(encoded[j].questions)}
            pairs += [(offsets[i] + k, offsets[j] + where[same[q.question_id]])
                      for k, q in enumerate(encoded[i].questions) if q.question_id in same]
    return pairs


def units_to_batches(units: Sequence[Sequence[int]], batch_records: int,
                     lengths: Sequence[int] | None = None, pool: int = 50) -> list[list[int]]:
    """Units (a record, or a twin's two records) grouped into batches of about ``batch_records`` records.

    With ``lengths``, units are sorted by length within pools of ``pool`` batches (so a batch pads to a similar
    length, not to the longest record in the data: ~2x less work here) and the batches are shuffled back; the
    order stays random from epoch to epoch because ``units`` arrive shuffled.
    """
    if lengths is not None:
        size = pool * batch_records
        units = [u for start in range(0, len(units), size)
                 for u in sorted(units[start : start + size], key=lambda u: max(lengths[i] for i in u))]
    batches: list[list[int]] = [[]]
    for unit in units:
        if len(batches[-1]) + len(unit) > batch_records and batches[-1]:
            batches.append([])
        batches[-1].extend(unit)
    batches = [b for b in batches if b]
    if lengths is not None:
        random.Random(len(units) + sum(batches[0])).shuffle(batches)
    return batches


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Denormal floats flushed to zero while the block runs (CPU). Denormals are below 1.2e-38, so no result
    changes, but x86 handles them in microcode: a step of the packaged head took 3.9 s instead of 1.3 s."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def parameter_groups(head: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: decaying norms, biases and the logit scales pulls them towards 0 for no
    regularising gain (the scales at 0 mean logits within ±1)."""
    matrices = [p for p in head.parameters() if p.ndim >= 2]
    others = [p for p in head.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]


def trainable_groups(head: torch.nn.Module, weight_decay: float) -> list[dict]:
    """:func:`parameter_groups` of the parameters that require a gradient (a path head's frozen branches stay out
    of the optimiser)."""
    trainable = {id(p) for p in head.parameters() if p.requires_grad}
    return [{**g, "params": [p for p in g["params"] if id(p) in trainable]}
            for g in parameter_groups(head, weight_decay)]


def warmup_cosine(total: int, warmup_fraction: float = 0.05) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of steps, then cosine decay to zero."""
    warmup = max(1, int(total * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scheduler: Any,
                   parameters: Iterable[torch.nn.Parameter]) -> float:
    """One step of head training: gradients clipped to norm 1, the schedule advanced; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()


@dataclass
class ValidationTally:
    """Validation metrics of the question and state paths, gathered batch by batch: loss, accuracy (all labelled
    questions; the full views alone), NLL, ECE (15 bins) and the twins' |Δp|."""

    label_smoothing: float
    brier_weight: float
    losses: list[float] = field(default_factory=list)
    hits: list[bool] = field(default_factory=list)
    full_hits: list[bool] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    moved: list[float] = field(default_factory=list)

    def add(self, logits: torch.Tensor, target: torch.Tensor, full_view: torch.Tensor,
            pairs: Sequence[tuple[int, int]]) -> None:
        """One batch: ``logits`` ``[Q, K]``, ``target`` ``[Q]`` (-1 without a label), ``full_view`` ``[Q]`` (bool,
        on ``logits``' device), ``pairs`` the twin pairs' positions in the batch."""
        labelled = target >= 0
        if bool(labelled.any()):
            self.losses.append(float(question_loss(logits, target, self.label_smoothing, self.brier_weight)))
        right = (logits.argmax(-1) == target)[labelled]
        log_p = torch.log_softmax(logits[labelled], -1)
        self.nll += (-log_p.gather(1, target[labelled][:, None])[:, 0]).tolist()
        self.confidence += log_p.max(-1).values.exp().tolist()
        self.hits += right.tolist()
        self.full_hits += right[full_view[labelled]].tolist()
        probs = torch.softmax(logits, -1).nan_to_num(0.0)
        self.moved += [float((probs[a] - probs[b]).abs().max()) for a, b in pairs]

    def metrics(self, **extra: float) -> dict:
        """The metrics, ``extra`` after the NLL and ECE."""
        metrics = {"val_loss": float(np.mean(self.losses)), "val_accuracy": float(np.mean(self.hits)),
                   "val_nll": float(np.mean(self.nll)),
                   "val_ece": ece(np.array(self.confidence), np.array(self.hits)), **extra}
        if self.full_hits:
            metrics["val_accuracy_full_views"] = float(np.mean(self.full_hits))
        if self.moved:
            metrics |= {"val_twin_mean_dp": float(np.mean(self.moved)), "val_twin_max_dp": float(np.max(self.moved))}
        return metrics


def fold_temperature(head: JointSchemaHead, temperature: float, evaluate: Callable[[], dict]) -> dict:
    """Fold ``temperature`` into ``head``'s weights (:func:`.question_path.apply_temperature`); the validation NLL
    and ECE before and after (``evaluate`` gives :class:`ValidationTally` metrics), for the training log."""
    before = evaluate()
    apply_temperature(head, temperature)
    after = evaluate()
    log.info("temperature %.3f: validation NLL %.4f -> %.4f, ECE %.4f -> %.4f", temperature, before["val_nll"],
             after["val_nll"], before["val_ece"], after["val_ece"])
    return {"temperature": temperature, "val_nll_before": before["val_nll"], "val_nll": after["val_nll"],
            "val_ece_before": before["val_ece"], "val_ece": after["val_ece"]}


def demo_universe(data: str) -> tuple[Sequence[str], Sequence[Example]]:
    """For ``--data demo``, the option universe of the path methods' full views (the 77 BANKING77 intents) and
    their canonical records (the evaluation's 77-way prompt on every BANKING77 training row); none otherwise."""
    if data != "demo":
        return (), ()
    from clef_local.data.datasets import banking77_examples, banking77_intents

    return banking77_intents(), banking77_examples("train")


def print_last_epoch(result: dict) -> int:
    """``train-head``'s output: the last epoch's metrics as JSON; exit status 0."""
    print(json.dumps(result["history"][-1] if result["history"] else {}, indent=2))
    return 0


def load_init_head(init: Path, backbone_dir: Path, hidden_size: int, device: str
                   ) -> tuple[JointSchemaHead, HeadConfig]:
    """The head in ``init`` (``joint_head.*``) to fine-tune on ``backbone_dir``, whose hidden size it must read."""
    head_config = read_head_config(init / "joint_head_config.json")
    if head_config.hidden_size != hidden_size:
        raise ReleaseError(f"--init {init}: the head reads hidden size {head_config.hidden_size}, the backbone "
                           f"{backbone_dir} has {hidden_size}; fine-tune a head of this backbone")
    head = JointSchemaHead(head_config).to(device)
    head.load_state_dict(load_file(str(init / "joint_head.safetensors"), device=str(device)))
    return head, head_config


def save_checkpoint(path: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    history: list[dict], settings: dict) -> None:
    """The training state after ``len(history)`` epochs and the run's ``settings``, written atomically (a kill
    mid-write keeps the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "epoch": len(history), "history": history, "settings": settings}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    device: str, settings: dict) -> tuple[int, list[dict]]:
    """Restore a :func:`save_checkpoint` file into ``head``, ``optimizer`` and ``scheduler``; the epochs done and
    their history. A checkpoint of other ``settings`` (another learning rate, epoch count...) is refused: resuming
    it would silently finish a different run."""
    state = torch.load(path, weights_only=False, map_location=device)
    saved = state.get("settings", {})
    changed = sorted(k for k in {*saved, *settings} if saved.get(k) != settings.get(k))
    if changed:
        diff = ", ".join(f"{k}: {saved.get(k)!r} there, {settings.get(k)!r} now" for k in changed)
        raise ValueError(f"{path} is the checkpoint of a run with other settings ({diff}); delete it to start "
                         "over, or pass another --work")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    log.info("resuming at epoch %d (%s)", state["epoch"] + 1, path)
    return state["epoch"], state["history"]


def save_head(head: JointSchemaHead, head_config: HeadConfig, out: Path, log_dict: dict) -> None:
    """The head part of a release: ``joint_head.safetensors`` (float32), its config, ``training_log.json``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
              str(out / "joint_head.safetensors"))
    config_dict = {k: v for k, v in head_config.to_json_dict().items() if k != "dropout"}
    (out / "joint_head_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(log_dict, indent=2) + "\n")
