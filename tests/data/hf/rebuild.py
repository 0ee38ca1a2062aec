"""Rebuild the ``config.json`` fixtures from the model cards shipped in ``kvgeom/model/presets/``.

Each fixture is the card's recorded ``fields`` (raw Hugging Face config names and values, as the card's
``source`` list says where they were read) plus ``_name_or_path`` = the card's Hugging Face id. Cards
whose fields do not carry the layer pattern (Granite-4.0-H: the card lists the pattern in ``layers``, for
h-small inferred, see the card's notes) get ``layer_types`` written from the card's ``layers``; the
card-only summary key ``layer_types_attention_indices`` is dropped. Run from the repository root:

    python tests/data/hf/rebuild.py
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent
_GRANITE_TYPES = {"mamba2": "mamba", "attention": "attention"}


def fixture(card: dict) -> dict:
    config = copy.deepcopy(card["fields"])
    config.pop("layer_types_attention_indices", None)
    if config.get("model_type") == "granitemoehybrid" and "layer_types" not in config:
        config["layer_types"] = [_GRANITE_TYPES[k] for k in card["layers"]]
    return {"_name_or_path": card["name"], **config}


def main() -> None:
    for path in sorted((ROOT / "kvgeom" / "model" / "presets").glob("*.json")):
        out = OUT / path.stem / "config.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(fixture(json.loads(path.read_text())), indent=2) + "\n")


if __name__ == "__main__":
    main()
