"""The settings of ``clef-local train-head``: the head's shape and the shipped demo head's recipe in one dataclass,
every default with the reason it has that value. Each field is also a flag (``batch_records`` → ``--batch-records``)
whose help is that reason; the measurements behind them are in docs/benchmarks.md#head-training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clef_local.heads.torch_head import HeadConfig


def setting(default: Any, why: str) -> Any:
    """A settings field: its default and the one-line reason for it (the flag's help)."""
    return field(default=default, metadata={"why": why})


@dataclass(frozen=True)
class HeadShape:
    """The head's architecture (docs/format.md §4)."""

    width: int = setting(256, "small enough that the demo head ships inside the repository")
    routing_layers: int = setting(1, "one evidence-routing pass reads a single message's state")
    layers: int = setting(2, "field layers (zero in a state-path head, present for the release format)")
    heads: int = setting(4, "64-dimensional attention heads at width 256")
    feedforward: int = setting(512, "2x width keeps the head small; the backbone carries the language")

    def head_config(self, hidden_size: int) -> HeadConfig:
        """The :class:`HeadConfig` of a fresh head of this shape on a backbone of ``hidden_size``."""
        return HeadConfig(hidden_size=hidden_size, width=self.width, routing_layers=self.routing_layers,
                          layers=self.layers, heads=self.heads, feedforward=self.feedforward)


@dataclass(frozen=True)
class TrainConfig(HeadShape):
    """``clef-local train-head``: a state-path head (:mod:`.state_path`) on a frozen backbone. The defaults are the
    shipped head's recipe; the demo data's counts apply to ``--data demo`` only."""

    # the demo data (clef_local/training/demo_data.py)
    banking77: int = setting(1500, "BANKING77 train records (choices over 2-12 intents, nouls): the shipped head's")
    nlupp: int = setting(3316, "NLU++ records (nouls, a count score), every banking row of folds 0-15 once")
    twins: int = setting(500, "renamed / reordered / added-question twins for the consistency term: the shipped "
                              "head's")
    max_options: int = setting(12, "largest BANKING77 choice; every training row is also asked over all 77 intents "
                                    "(a choice costs only its state's pass)")
    hard_negatives: float = setting(0.5, "share of choices whose distractors are the gold's nearest intents: better "
                                         "77-way top-1 and ECE than random subsets (docs/benchmarks.md)")
    canonical: int = setting(10003, "BANKING77 training rows also asked as the evaluation asks them, over all 77 "
                                    "intents: every row, as for the shipped head (a choice costs only its state)")
    # the optimisation
    epochs: int = setting(4, "the shipped head's; a state-only prototype kept improving past one epoch "
                             "(docs/benchmarks.md#head-training)")
    lr: float = setting(3e-4, "a larger rate left the routing layer at the uniform loss on 77-way records "
                              "(docs/benchmarks.md#head-training)")
    batch_records: int = setting(16, "records per step: the shipped head's")
    weight_decay: float = setting(0.01, "AdamW's decoupled decay, on matrices only")
    label_smoothing: float = setting(0.05, "as Clef was trained")
    brier_weight: float = setting(1.0, "the Brier term keeps the probabilities calibrated, not only the argmax")
    consistency_weight: float = setting(1.0, "x symmetric KL between twin questions' answers")
    state_attention_weight: float = setting(0.1, "x -log(routing attention on prefix + state): without it a "
                                                 "prototype's choices lost accuracy once the record's own schema "
                                                 "joined the memory (docs/benchmarks.md)")
    joint_scale_init: float = setting(2.3, "log cosine temperature (x10): started at 0 the scale barely moves and "
                                           "only the residual scorer scores (docs/benchmarks.md)")
    distractor_records: int = setting(256, "records whose schema hidden states are appended after the states as "
                                           "distractors (one full pass each)")
    canonical_distractors: int = setting(32, "of them, 77-way records: their long schemas are the hardest "
                                             "distractors")
    validation: float = setting(0.05, "share of units never trained on: metrics and the temperature fit")
    calibrate: bool = setting(True, "fold one logit temperature fitted on the validation questions into the "
                                    "weights, as for the shipped head")
    seed: int = setting(0, "data draws, validation split, initialisation, distractors")
