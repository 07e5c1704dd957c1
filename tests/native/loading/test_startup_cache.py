"""The startup cache: file keys, atomic entries, damaged entries, and the cached GGUF metadata,
tokenizer and packed weights giving exactly what a fresh load gives."""

from __future__ import annotations

import getpass
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from backends.machine.cache_dir import cache_root, point_inductor_cache
from backends.native.loading.loader import load_checkpoint
from backends.native.loading.startup_cache import (
    StartupCache,
    file_key,
    open_cache,
    reader_version,
)
from backends.native.loading.tokenizer_loading import load_tokenizer
from backends.quantized.int4_linear import Int4Linear
from backends.quantized.linear import DenseLinear, ShardedLinear
from tests.quantized.gguf_files import T, write_tiny_gguf
from tests.quantized.helpers import make_engine, native_greedy

PROMPT = [{"role": "user", "content": "Name three rivers of Europe, briefly."}]
TEXTS = ["Hello world", "  two  spaces\tand\n\nlines", "émoji 🤖 中文",
         "<|im_start|>user<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, default_gguf_path: str) -> Path:
    """Q4_K linears with a Q5_1 v_proj and an F16 o_proj (like llama.cpp's Q4_K_M mix): every
    kind of built module (Int4Linear, ShardedLinear, DenseLinear) goes through the cache."""
    mixed = {"attn_v": T.Q5_1, "attn_output": T.F16}
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf"
    return write_tiny_gguf(path, default_gguf_path, lambda stem: mixed.get(stem, T.Q4_K))


def _copy(src: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(src, folder / src.name))


def test_file_key_changes_with_the_file_and_only_then(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 20_000)  # 5 MB: head, middle and tail differ
    key = file_key(str(path))
    assert file_key(str(path)) == key
    stat = path.stat()
    with open(path, "r+b") as f:  # same size, one byte of the tail changed
        f.seek(stat.st_size - 10)
        f.write(b"\xff")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    assert file_key(str(path)) != key
    changed = file_key(str(path))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched
    assert file_key(str(path)) != changed


def test_json_entries_round_trip_and_damaged_ones_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    cache = StartupCache(tmp_path, "k")
    assert cache.read_json("meta.json") is None
    cache.write_json("meta.json", {"a": [1, 2], "b": "x"})
    assert cache.read_json("meta.json") == {"a": [1, 2], "b": "x"}
    assert [p.name for p in cache.dir.iterdir()] == ["meta.json"]  # no temporaries left
    cache.path("meta.json").write_text('{"a": [1, ')  # a torn write
    with caplog.at_level(logging.WARNING):
        assert cache.read_json("meta.json") is None
    assert "ignoring unreadable entry" in caplog.text
    assert not cache.path("meta.json").exists()


def test_an_unwritable_cache_warns_and_does_not_fail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = StartupCache(blocker, "k")  # its folder cannot be created
    with caplog.at_level(logging.WARNING):
        cache.write_json("meta.json", {"a": 1})
        cache.publish("dir", lambda folder: (folder / "x").write_text("y"))
    assert caplog.text.count("cannot write") == 2
    assert cache.read_json("meta.json") is None


def test_cache_setting_none_turns_it_off(tmp_path: Path, tiny_gguf: Path) -> None:
    assert cache_root(None) is None and cache_root("none") is None and cache_root("") is None
    assert cache_root("~/x") == Path.home() / "x"
    assert open_cache(None, str(tiny_gguf)) is None
    assert open_cache(tmp_path, str(tmp_path)) is None  # folders load fast: not cached


def test_gguf_metadata_hit_miss_and_invalidation(tmp_path: Path, tiny_gguf: Path) -> None:
    path = _copy(tiny_gguf, tmp_path / "model")
    fresh = load_checkpoint(str(path))
    cold = load_checkpoint(str(path), open_cache(tmp_path / "cache", str(path)))
    warm = load_checkpoint(str(path), open_cache(tmp_path / "cache", str(path)))
    assert not cold.metadata_cached and warm.metadata_cached
    assert warm.config.to_dict() == fresh.config.to_dict()
    assert type(warm.config) is type(fresh.config)
    assert warm.metadata == fresh.metadata
    assert warm.generation_eos_token_ids == fresh.generation_eos_token_ids
    assert warm.quantized_lm_head == fresh.quantized_lm_head
    # the cached checkpoint still streams the file's tensors when asked (parsed lazily)
    assert [n for n, _ in warm.tensors()] == [n for n, _ in fresh.tensors()]
    with open(path, "ab") as f:  # the file changes: a new key, a miss
        f.write(b"\0" * 32)
    assert not load_checkpoint(str(path), open_cache(tmp_path / "cache", str(path))
                               ).metadata_cached


def test_cached_tokenizer_gives_the_converted_ids(tmp_path: Path, default_gguf_path: str) -> None:
    checkpoint = load_checkpoint(default_gguf_path)
    fresh = load_tokenizer(checkpoint)
    cache = StartupCache(tmp_path, file_key(default_gguf_path))
    cold = load_tokenizer(checkpoint, cache)
    warm = load_tokenizer(checkpoint, cache)
    assert not cold.from_cache and warm.from_cache
    for text in TEXTS:
        assert warm.encode(text) == fresh.encode(text)
    assert warm.encode_chat(PROMPT) == fresh.encode_chat(PROMPT)
    ids = fresh.encode_chat(PROMPT)
    assert warm.decode(ids, skip_special_tokens=False) == fresh.decode(ids, False)
    assert warm.eos_token_ids == fresh.eos_token_ids
    assert warm.bos_token_id == fresh.bos_token_id
    assert warm.chat_template == fresh.chat_template
    assert all(warm.is_special(i) == fresh.is_special(i) for i in range(fresh.vocab_size))
    (cache.path(f"tokenizer-{reader_version()}") / "tokenizer.json").write_text("{broken")
    again = load_tokenizer(checkpoint, cache)  # damaged: converted again
    assert not again.from_cache and again.encode_chat(PROMPT) == fresh.encode_chat(PROMPT)
    assert load_tokenizer(checkpoint, cache).from_cache  # and re-saved


def test_cached_weights_give_identical_logits(tmp_path: Path, tiny_gguf: Path) -> None:
    cache_dir = str(tmp_path / "cache")
    prompt = torch.randint(3, 49152, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    cold = make_engine(tiny_gguf, dtype="float32", cache_dir=cache_dir)  # built from the file
    want_tokens, want_logits = native_greedy(cold, prompt)
    warm = make_engine(tiny_gguf, dtype="float32", cache_dir=cache_dir)
    tokens, logits = native_greedy(warm, prompt)
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)  # the same packed bytes: bit-identical
    restored = [t for t in warm.loaded.model.state_dict().values() if t.numel()]
    assert all(t.data_ptr() % 64 == 0 for t in restored)  # else GEMVs sum in another order
    attn = warm.loaded.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, ShardedLinear)  # Q4_K q/k beside a Q5_1 v
    assert isinstance(attn.qkv_proj.parts[0], Int4Linear)
    assert isinstance(attn.o_proj, DenseLinear)
    assert warm.loaded.weight_bytes == cold.loaded.weight_bytes
    assert warm.loaded.quantization == cold.loaded.quantization


def test_damaged_weights_entry_is_rebuilt(
    tmp_path: Path, tiny_gguf: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    cache_dir = tmp_path / "cache"
    prompt = [5, 17, 300, 2048, 7]
    want = native_greedy(make_engine(tiny_gguf, cache_dir=str(cache_dir)), prompt)[0]
    (entry,) = cache_dir.glob("models/*/weights-*")
    manifest = json.loads((entry / "manifest.json").read_text())
    name = next(iter(manifest["modules"]))
    manifest["modules"][name]["class"] = "os.system"  # never imported from a cache entry
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        engine = make_engine(tiny_gguf, cache_dir=str(cache_dir))
    assert "ignoring unreadable entry" in caplog.text and "os.system" in caplog.text
    assert native_greedy(engine, prompt)[0] == want
    (entry / "state.safetensors").write_bytes(b"\0" * 64)  # rebuilt above; now truncated
    assert native_greedy(make_engine(tiny_gguf, cache_dir=str(cache_dir)), prompt)[0] == want


def test_inductor_cache_is_kept_per_cpu_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiled kernels from one CPU kind reused under another decoded wrong tokens."""
    torch_default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    cases = [
        (None, tmp_path / "inductor" / "avx2-abc"),  # unset: beside our cache
        (str(torch_default), tmp_path / "inductor" / "avx2-abc"),  # torch wrote its default
        (str(tmp_path / "mine"), tmp_path / "mine" / "avx2-abc"),  # the user's choice, keyed
    ]
    for before, expected in cases:
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        point_inductor_cache(tmp_path, "avx2-abc")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(expected)
        point_inductor_cache(tmp_path, "avx2-abc")  # idempotent
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(expected)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    point_inductor_cache(None, "avx512-def")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(torch_default / "avx512-def")
