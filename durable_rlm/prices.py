"""The price table: what a model's tokens cost, so every call and episode has a cost.

A shipped table of common models (prices.json beside this module) under a user's file
(DRLM_PRICES_FILE, or prices.json in the data directory). The client looks a model up when
it makes a request and puts the price in the model's settings, so workers and the workflow
compute the same cost from history alone. A model the table lacks costs null: no guess.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from durable_rlm.settings import ConfigurationError, Settings
from durable_rlm.workflows.models import ModelPrice, ModelSettings

SHIPPED = Path(__file__).with_name("prices.json")


class PriceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    about: str = ""
    models: dict[str, ModelPrice]


class PriceTable:
    def __init__(self, models: dict[str, ModelPrice], sources: list[Path]) -> None:
        self.models = models
        self.sources = sources

    @classmethod
    def load(cls, settings: Settings) -> PriceTable:
        models = read_price_file(SHIPPED)
        sources = [SHIPPED]
        user = settings.prices_file or settings.data_dir / "prices.json"
        if settings.prices_file is not None or user.is_file():
            models |= read_price_file(user)
            sources.append(user)
        return cls(models, sources)

    def price_of(self, model: ModelSettings) -> ModelPrice | None:
        return self.models.get(f"{model.provider}:{model.model}") or self.models.get(model.model)

    def priced(self, model: ModelSettings) -> ModelSettings:
        """The settings with the table's price (the caller's own price, if set, stays)."""
        if model.price is not None:
            return model
        return model.model_copy(update={"price": self.price_of(model)})


def read_price_file(path: Path) -> dict[str, ModelPrice]:
    try:
        return PriceFile.model_validate(json.loads(path.read_text())).models
    except FileNotFoundError:
        raise ConfigurationError(f"price file {path} not found (DRLM_PRICES_FILE)") from None
    except (OSError, ValueError) as exc:
        problem: Exception | str = exc
        if isinstance(exc, ValidationError):
            problem = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
            )
        raise ConfigurationError(
            f'price file {path}: {problem} (expected {{"models": {{"NAME": '
            f'{{"input_usd_per_mtok": N, "output_usd_per_mtok": N}}}}}})'
        ) from None
