"""Run by test_install.py with a non-editable install's interpreter (`python -I`, outside the
repository): loads the default model from the installed package, greedy-decodes a few tokens
and prints, as JSON, where the package lives, which CPU kernels the load reports and the
installed code's cache fingerprints (both read the package's own .py files by path)."""

from __future__ import annotations

import json
import logging

import backends
from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from backends.native.loading.startup_cache import reader_version
from backends.native.loading.weight_cache import _code_fingerprint


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(EngineConfig(model="default", max_total_tokens=128,
                                    max_batch_total_tokens=512, compile=False))
    (seq,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0,
                                                          ignore_eos=True))
    print(json.dumps({
        "backends": backends.__file__, "cpu_kernels": engine.loaded.cpu_kernels,
        "tokens": seq.token_ids[seq.num_prompt_tokens:],
        "reader_version": reader_version(), "code_fingerprint": _code_fingerprint(),
    }))


if __name__ == "__main__":
    main()
