"""How an embedding model pools its token states into one vector: read from the model folder's
sentence-transformers config, as sentence-transformers itself would build the model.

`modules.json` lists the modules after the transformer; a `Pooling` module's folder holds its
`config.json`, either `pooling_mode` ("cls", "mean", "lasttoken"; sentence-transformers 6) or
the older booleans (`pooling_mode_cls_token`, `pooling_mode_mean_tokens`,
`pooling_mode_lasttoken`). A `Normalize` module makes the vectors unit length. Without
`modules.json` the backend's default applies (decoders: last token, normalised, as
Qwen3-Embedding; encoders: CLS, normalised). A config that asks for what no backend here
computes (max or weighted-mean pooling, Dense layers, ...) is refused at load, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PoolingMode = Literal["cls", "mean", "last"]
_MODES: dict[str, PoolingMode] = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
# Modules that change nothing a backend computes (the transformer itself, or a no-op here).
_PASSIVE = ("Transformer", "Dropout")


class PoolingConfigError(ValueError):
    """The folder's sentence-transformers config asks for pooling this server cannot do."""


@dataclass(frozen=True)
class Pooling:
    mode: PoolingMode
    normalize: bool
    source: str = "default"  # where it came from: "modules.json" or "default"

    def report(self) -> dict[str, Any]:
        return {"mode": self.mode, "normalize": self.normalize, "source": self.source}


DECODER_DEFAULT = Pooling("last", True)
ENCODER_DEFAULT = Pooling("cls", True)


def read_pooling(folder: str | Path | None, default: Pooling) -> Pooling:
    """The pooling `folder`'s sentence-transformers config declares, else `default` (also for
    a `.gguf` file or no folder)."""
    if folder is None or not Path(folder).is_dir():
        return default
    modules_file = Path(folder) / "modules.json"
    if not modules_file.is_file():
        return default
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{modules_file} is not a list of modules")
    mode: PoolingMode | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        if kind == "Pooling":
            mode = _mode(Path(folder) / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind not in _PASSIVE:
            raise PoolingConfigError(
                f"{modules_file} lists a {kind or 'nameless'} module; only Transformer, "
                "Pooling and Normalize are supported")
    if mode is None:
        raise PoolingConfigError(f"{modules_file} lists no Pooling module")
    return Pooling(mode, normalize, "modules.json")


def _mode(config_file: Path) -> PoolingMode:
    config = _json(config_file)
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{config_file} is not a JSON object")
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        names = [str(n) for n in (named if isinstance(named, list) else [named])]
        modes = [_MODES.get(name) for name in names]
    else:
        names = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
        modes = [_LEGACY.get(name) for name in names]
    found = modes[0] if len(modes) == 1 else None
    if found is None:
        raise PoolingConfigError(
            f"{config_file}: pooling {', '.join(names) or 'none'} is not supported; exactly "
            "one of cls, mean, lasttoken is")
    return found


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"cannot read {path}: {exc}") from None
