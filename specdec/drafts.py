"""The drafts specdec ships for real targets (specdec/assets/drafts/NAME/), found by the target's fingerprint
(models/feature_draft.py `fingerprint`: its config and a sample of its weights, never its file name)."""
from __future__ import annotations

import json
from pathlib import Path

from specdec.models.feature_draft import fingerprint

SHIPPED = Path(__file__).resolve().parent / "assets" / "drafts"


def shipped_draft(target) -> Path | None:
    """The directory of the shipped draft made for `target` (a loaded model), or None."""
    if not all(hasattr(target, a) for a in ("cfg", "embed_tokens", "layers")):
        return None  # a foreign model object: nothing to fingerprint
    configs = sorted(SHIPPED.glob("*/config.json"))
    if not configs:
        return None
    wanted = fingerprint(target)
    for config in configs:
        if json.loads(config.read_text(encoding="utf-8")).get("target_fingerprint") == wanted:
            return config.parent
    return None
