"""The chapter's published figures, in one place, each with its source section.

These are shown *beside* moebench's measurements, never written as measurements.
Source: ../shared/README.md and ../shared/seeds/004_* (the chapter's "code verification" notes).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedFigure:
    key: str
    """Key of the matching measured value (see each variant's summary)."""
    label: str
    value: float
    unit: str
    section: str
    """Where the chapter states it."""


FASTMOE: tuple[PublishedFigure, ...] = (
    PublishedFigure(
        key="params.total", label="parameters, total", value=273e6, unit="params", section="6.4.3-6.4.4 (≈ 2.73 亿)"
    ),
    PublishedFigure(
        key="params.by_category.moe",
        label="parameters, MoE layer",
        value=268e6,
        unit="params",
        section="6.4.3-6.4.4 (≈ 2.68 亿)",
    ),
    PublishedFigure(
        key="params.by_category.attention",
        label="parameters, attention",
        value=5.24e6,
        unit="params",
        section="6.4.3-6.4.4 (≈ 5.24M)",
    ),
    PublishedFigure(
        key="params.by_category.norm",
        label="parameters, normalisation",
        value=0.2e6,
        unit="params",
        section="6.4.3-6.4.4 (≈ 0.2M)",
    ),
    PublishedFigure(key="loss.first", label="training loss, start", value=2.04, unit="MSE", section="6.4.3-6.4.4"),
    PublishedFigure(key="loss.last", label="training loss, end", value=1.11, unit="MSE", section="6.4.3-6.4.4"),
    PublishedFigure(key="loss.drop_pct", label="training loss drop", value=45.0, unit="%", section="6.4.3-6.4.4"),
)

DEEPSPEED: tuple[PublishedFigure, ...] = (
    PublishedFigure(
        key="epoch_loss.1",
        label="average loss, epoch 1",
        value=1.784354,
        unit="MSE",
        section="6.4.3-6.4.4 (DeepSpeed)",
    ),
    PublishedFigure(
        key="epoch_loss.5",
        label="average loss, epoch 5",
        value=1.000710,
        unit="MSE",
        section="6.4.3-6.4.4 (DeepSpeed)",
    ),
)
