"""The drafters by name: ``make_drafter(config, ...)`` builds the one a deployment names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.drafter import Drafter
    from tandem.engine.speculation import SpeculativeConfig


def make_drafter(config: SpeculativeConfig, **parts: Any) -> Drafter:
    """The configured drafter; ``parts`` are what a model drafter is built over (the model and
    the KV pool; DeepSeek-V4's model and runner), which a weightless drafter ignores. Each is
    imported only when chosen: the MTP drafters load torch."""
    if config.drafter == "ngram":
        from tandem.engine.ngram_drafter import NgramDrafter

        return NgramDrafter(config, **parts)
    if config.drafter == "mtp":
        if parts.get("runner") is not None:  # DeepSeek-V4's: its MTP state comes through the runner
            from tandem.engine.v4_mtp_drafter import V4MtpDrafter

            return V4MtpDrafter(config, **parts)
        from tandem.engine.mtp_drafter import MtpDrafter

        return MtpDrafter(config, **parts)
    raise ValueError(f"drafter: no drafter named {config.drafter!r} (known: ngram, mtp)")
