"""GPU prices by model and capacity type, shared by cost tracking and the cost guard.

Prices are USD per GPU-hour. The defaults are illustrative list prices (late 2026, one GPU of an
8-GPU instance); set your own with ``PriceTable(usd_per_gpu_hour={...})`` or a YAML mapping of the
same shape, merged into these (a price given replaces that price; the other rows stay).
Reserved is 60 % below on-demand, the rate the purchase-mix advice
(:mod:`stoker.tracking.purchase_mix`) prices a reserved GPU-hour at. That 60 % is an assumption,
not a quoted price: the only published figure behind it is AWS's ceiling for a 1- or 3-year
commitment (EC2 Instance Savings Plans and Reserved Instances: "up to 72 %" off on-demand,
aws.amazon.com/savingsplans); what a GPU commitment costs depends on the provider, term and
negotiation, so set the ``reserved`` prices you were quoted. A GPU model matches the
first table key contained in its NVML name (``"NVIDIA H200"`` matches ``"H200"``); anything else
uses ``"default"``.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

CapacityType = Literal["on_demand", "spot", "reserved"]


def _builtin_rows() -> dict[str, dict[str, float]]:
    """The built-in table (USD per GPU-hour; sources in the module docstring)."""
    return {
        "H200": {"on_demand": 5.00, "spot": 2.10, "reserved": 2.00},
        "H100": {"on_demand": 4.00, "spot": 1.70, "reserved": 1.60},
        "A100": {"on_demand": 2.50, "spot": 1.00, "reserved": 1.00},
        "L4": {"on_demand": 0.80, "spot": 0.30, "reserved": 0.32},
        "cpu": {"on_demand": 0.0, "spot": 0.0, "reserved": 0.0},
        "default": {"on_demand": 2.00, "spot": 0.80, "reserved": 0.80},
    }


class PriceTable(BaseModel):
    """USD per GPU-hour, by GPU model name fragment and capacity type."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usd_per_gpu_hour: dict[str, dict[CapacityType, float]] = Field(
        default_factory=lambda: _builtin_rows(),
        description="GPU model fragment -> capacity type -> USD per GPU-hour; merged into the "
        "built-in table (a row or a price you give replaces that one, the rest stay).",
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_into_the_builtin_table(cls, data: object) -> object:
        """A table given (a YAML file, ``cost.prices.usd_per_gpu_hour.cpu.on_demand=36``) is
        merged into the built-in one, price by price: pricing one row no longer drops the
        others and their ``default`` (a new-user trial). New rows come first: a more specific
        fragment (``H100 NVL``) wins over a built-in one it contains (``H100``)."""
        if not isinstance(data, dict) or not isinstance(data.get("usd_per_gpu_hour"), dict):
            return data
        given, builtin = data["usd_per_gpu_hour"], _builtin_rows()
        merged = {k: v for k, v in given.items() if k not in builtin}
        for fragment, row in builtin.items():
            mine = given.get(fragment, {})
            merged[fragment] = {**row, **mine} if isinstance(mine, dict) else mine
        return {**data, "usd_per_gpu_hour": merged}

    @model_validator(mode="after")
    def _check(self) -> PriceTable:
        for model, prices in self.usd_per_gpu_hour.items():
            if missing := [c for c in get_args(CapacityType) if c not in prices]:
                raise ValueError(f"usd_per_gpu_hour.{model} needs a price for "
                                 f"{', '.join(missing)} (USD per GPU-hour)")
            for capacity, price in prices.items():
                if price < 0:
                    raise ValueError(f"usd_per_gpu_hour.{model}.{capacity} must be >= 0, "
                                     f"got {price}")
        return self

    def price(self, gpu_model: str | None, capacity: CapacityType) -> float:
        """USD per GPU-hour for ``gpu_model`` (an NVML name, "cpu", or None) and ``capacity``.

        Raises:
            KeyError: the matching entry has no price for ``capacity``.
        """
        name = (gpu_model or "default").lower()
        for fragment, prices in self.usd_per_gpu_hour.items():
            if fragment != "default" and fragment.lower() in name:
                return prices[capacity]
        return self.usd_per_gpu_hour["default"][capacity]
