"""GGUF files as a model source: dequantised once into a float32 model directory, cached by content.

A model key (``model.policy``, ``model.reference``, ``model.critic``, a reward model's ``path``,
``klpo doctor --model/--reference``, ``klpo make-reward-model --init``) may name a ``.gguf`` file,
the format llama.cpp writes and package registries ship quantised models in. klpo never trains
on the quantised blocks: transformers dequantises the file
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package, the extra ``klpo[gguf]``) into
a float32 model, which is saved with the tokenizer, chat template and generation config the file
carries into a model directory of its own (:func:`resolve_gguf`). Every later run of the same file
reads that directory: the weights are a float image of the quantised file, not the model it was
quantised from, and the run's first lines say so (:meth:`GGUFImage.describe`).

The cache:

- root: ``$KLPO_CACHE``, else ``$XDG_CACHE_HOME/klpo``, else ``~/.cache/klpo`` (:func:`cache_root`);
- one directory per file content, ``<root>/gguf/<sha256 of the file>/`` (a copy or a rename of the
  file finds the same image; a changed file gets a new one), with ``klpo-gguf.json`` saying what it
  was made from; the digest of a file is remembered by its path, size and modification time, so a
  second resolve reads no more than the header; the image's record is compared with the file's
  header before it is used (:func:`image_mismatch`): a wrong remembered digest is read again, an
  image of another file refused;
- written atomically (built in a temporary directory and renamed, :func:`klpo._io.atomic_dir`) under
  a lock, so a second process converting the same file waits and then reuses the first's image,
  and a conversion that is interrupted leaves nothing behind; one killed outright (``kill -9``)
  leaves its temporary directory, which the next conversion removes (:func:`_sweep_stale`);
- a full disk is one message (the file, the space free, the room the image takes), like every
  klpo command's, not a traceback;
- the quantisation marker transformers leaves on the model (its ``quantization_config``) is dropped,
  so ``save_pretrained``, LoRA merging and ``klpo export`` treat the image as the plain model it is.

Errors (:class:`GGUFError`, one paragraph naming the file and the fix): a file that is not GGUF (its
first four bytes are not ``GGUF``), a truncated file (its tensor table points past its end), an
architecture transformers cannot dequantise (the ones it can are named, from transformers' own
tables), the ``gguf`` package missing (with the install line).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = [
    "INSTALL",
    "GGUFError",
    "GGUFHeader",
    "GGUFImage",
    "cache_root",
    "convert_gguf",
    "file_sha256",
    "find_image",
    "forget_resolved",
    "gguf_problem",
    "image_mismatch",
    "is_gguf_path",
    "read_header",
    "resolve_gguf",
    "supported_architectures",
]

INSTALL = "pip install 'klpo[gguf]'"
"""The install line of the extra that dequantises GGUF files (the ``gguf`` package)."""

MAGIC = b"GGUF"
IMAGE_FILE = "klpo-gguf.json"  # written last into an image: its presence marks it complete
_LEGACY_NOT_ARCHITECTURES = {"general", "tokenizer"}  # keys of transformers' table that are not


class GGUFError(ValueError):
    """A ``.gguf`` model source that cannot be used; the message names the file and the fix."""


def is_gguf_path(name: str | os.PathLike[str]) -> bool:
    """Whether a model key's value names a GGUF file (by its suffix, as llama.cpp names them)."""
    return str(name).lower().endswith(".gguf")


def cache_root() -> Path:
    """klpo's cache directory: ``$KLPO_CACHE``, else ``$XDG_CACHE_HOME/klpo``, else
    ``~/.cache/klpo`` (the XDG base-directory convention)."""
    if os.environ.get("KLPO_CACHE"):
        return Path(os.environ["KLPO_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "klpo"


def _images() -> Path:
    return cache_root() / "gguf"


# ---------------------------------------------------------------------------------------------
# The file: magic bytes, header, tensor table, architecture.


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header says (no tensor data read).

    Attributes:
        architecture: ``general.architecture`` (llama.cpp's name: ``llama``, ``gemma3``, ...).
        name: ``general.name``, if given.
        quantization: the quantisation type, as llama.cpp names it (``Q4_1``, ``Q4_K_M``), from
            ``general.file_type``; else the most common block type of its tensors; None for a
            file of plain floats.
        tensors: the number of tensors.
        size: the file's size in bytes.
        chat_template: whether it carries ``tokenizer.chat_template``.
    """

    architecture: str
    name: str | None
    quantization: str | None
    tensors: int
    size: int
    chat_template: bool


def _gguf_module():
    """The ``gguf`` package, or a :class:`GGUFError` with the install line."""
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            "reading a .gguf model needs the gguf package, which klpo's default install leaves "
            f"out; install it with `{INSTALL}`"
        ) from None
    return gguf


def _check_file(path: Path) -> int:
    """The file's size, after checking that it exists and begins with the GGUF magic bytes."""
    if not path.exists():
        raise GGUFError(f"{path}: no such file; check the path")
    if not path.is_file():
        raise GGUFError(f"{path} is not a file; a .gguf model source is one file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(
            f"{path} is not a GGUF file: it begins with {head!r}, not the magic bytes {MAGIC!r}. "
            "Give a file llama.cpp's tools (or the gguf package) wrote, or a model directory "
            "written by save_pretrained (without the .gguf suffix)"
        )
    return size


def _truncated(path: Path, size: int, need: int) -> GGUFError:
    return GGUFError(
        f"{path} is truncated: its header and tensor table describe {need:,} bytes but the file "
        f"has {size:,}. Download or assemble it again (and compare its sha256 with the "
        "publisher's)"
    )


def _quant_name(gguf, file_type: int | None, tensor_types: list[int]) -> str | None:
    """llama.cpp's name of the file's quantisation (``MOSTLY_Q4_K_M`` -> ``Q4_K_M``)."""
    if file_type is not None:
        with contextlib.suppress(ValueError):
            name = gguf.LlamaFileType(int(file_type)).name
            name = name.removeprefix("MOSTLY_")
            return None if name in ("ALL_F32",) else name
    plain = {int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16)}
    plain.add(int(gguf.GGMLQuantizationType.BF16))
    blocks = [t for t in tensor_types if t not in plain]
    if not blocks:
        return None
    common = max(set(blocks), key=blocks.count)
    return gguf.GGMLQuantizationType(common).name


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at ``path``, checked to be whole.

    The metadata and tensor table are read with transformers' GGUF reader where it has one
    (fast: neither the vocabulary nor the tensor data is built), else with the ``gguf`` package's
    (tens of seconds on a 262,144-token vocabulary); the end of the last tensor's data must lie
    within the file.

    Raises:
        GGUFError: no such file, not a GGUF file (the magic bytes), the ``gguf`` package missing,
            a header that cannot be parsed, or a truncated file.
    """
    path = Path(path).expanduser()
    size = _check_file(path)
    gguf = _gguf_module()
    try:
        header = _read_fast(path, gguf)
    except (ImportError, AttributeError):  # a transformers without this reader
        header = None
    except Exception as err:  # the reader's own errors on a damaged header
        raise GGUFError(
            f"{path}: its GGUF header cannot be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160] if str(err) else 'no detail'}); the file is "
            "damaged or truncated: download or assemble it again"
        ) from None
    if header is None:
        header = _read_slow(gguf, path)
    metadata, types, need = header
    if need > size:
        raise _truncated(path, size, need)
    return GGUFHeader(
        architecture=str(metadata.get("general.architecture", "")),
        name=metadata.get("general.name"),
        quantization=_quant_name(gguf, metadata.get("general.file_type"), types),
        tensors=len(types),
        size=size,
        chat_template="tokenizer.chat_template" in metadata,
    )


def _read_fast(path: Path, gguf) -> tuple[dict, list[int], int]:
    """``(metadata, tensor types, bytes the file must have)``: the metadata and tensor table by
    transformers' memory-mapped reader (it walks the vocabulary without building it: a fraction of
    a second for 262,144 tokens), the bytes of each tensor by the gguf package's table of block
    sizes (``GGML_QUANT_SIZES``), from the aligned start of the data section."""
    from transformers.integrations.gguf import reader

    blob = reader._mapped(str(path))
    metadata, count, pos = reader._read_metadata(blob, str(path))
    entries, pos = reader._read_tensor_table(blob, count, pos)
    align = int(metadata.get("general.alignment", 32))  # llama.cpp's default
    start = (pos + align - 1) // align * align
    need, types = start, []
    for _name, shape, ggml_type, offset in entries:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        need = max(need, start + offset + math.prod(shape) // block * size)
        types.append(ggml_type)
    return metadata, types, need


def _read_slow(gguf, path: Path) -> tuple[dict, list[int], int]:
    """The same by the ``gguf`` package's reader (older transformers)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # a tensor past the end fails inside the memory map's slicing
        raise GGUFError(
            f"{path}: its GGUF header cannot be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160] if str(err) else 'no detail'}); the file is "
            "damaged or truncated: download or assemble it again"
        ) from None
    keys = ("general.architecture", "general.name", "general.file_type", "tokenizer.chat_template")
    metadata = {k: reader.fields[k].contents() for k in keys if k in reader.fields}
    ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    return metadata, [int(t.tensor_type) for t in reader.tensors], max(ends, default=0)


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures (llama.cpp's names) the installed transformers dequantises: the
    keys of its GGUF config table (``transformers.modeling_gguf_pytorch_utils``), and of its
    newer GGUF loader's table where it has one (``transformers.integrations.gguf``)."""
    names: set[str] = set()
    with contextlib.suppress(ImportError):
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES) - _LEGACY_NOT_ARCHITECTURES
    with contextlib.suppress(ImportError):
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    return tuple(sorted(names))


# llama.cpp's names that transformers' loader renames before it looks them up in its table.
_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
            "minimax-m2": "minimax_m2", "t5encoder": "t5"}  # fmt: skip


def check_architecture(path: Path, header: GGUFHeader) -> None:
    """:class:`GGUFError` unless transformers can dequantise ``header``'s architecture."""
    known = supported_architectures()
    arch = header.architecture
    if arch in known or _RENAMES.get(arch) in known:
        return
    raise GGUFError(
        f"{path} holds a {arch or 'nameless'!r} model, an architecture the installed "
        f"transformers cannot dequantise from GGUF; it can: {', '.join(known)}. Convert the "
        "original model with save_pretrained instead, or upgrade transformers"
    )


def gguf_problem(name: str, key: str) -> str | None:
    """Why the GGUF file ``name`` (config key ``key``) cannot be a model source, or None: the
    checks of :func:`read_header` and :func:`check_architecture`, from the header alone."""
    path = Path(name).expanduser()
    try:
        check_architecture(path, read_header(path))
    except GGUFError as err:
        return f"{key}: {err}"
    return None


# ---------------------------------------------------------------------------------------------
# The file's content digest, remembered by path, size and modification time.


def _stat_key(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino


def file_sha256(path: str | os.PathLike[str], *, remembered: bool = True) -> str:
    """The sha256 of the file at ``path`` (hex). Read once: the digest is kept in the cache by
    the file's resolved path, size, modification time and inode, so a second call does not read
    the file again while none of those change (``remembered=False``: read it anyway, and
    remember the digest anew)."""
    path = Path(path).expanduser()
    key = _stat_key(path)
    memo = _images() / "digests" / (hashlib.sha1(key[0].encode()).hexdigest() + ".json")
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(memo.read_text(encoding="utf-8"))
        if remembered and saved["stat"] == list(key[1:]):
            return str(saved["sha256"])
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    sha = digest.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only costs the next call a re-read
        from klpo._io import write_text_atomic

        write_text_atomic(memo, json.dumps({"path": key[0], "stat": list(key[1:]), "sha256": sha}))
    return sha


# ---------------------------------------------------------------------------------------------
# The image: a float32 model directory per file content.


@dataclass(frozen=True)
class GGUFImage:
    """A GGUF file's float32 model directory.

    Attributes:
        source: the ``.gguf`` file.
        path: the model directory (``<cache>/gguf/<sha256>``).
        sha256: the file's content digest.
        architecture: llama.cpp's name of the architecture.
        quantization: the file's quantisation type (``Q4_1``), or None for plain floats.
        converted: made by this call (False: found in the cache).
        seconds: how long this call took.
    """

    source: Path
    path: Path
    sha256: str
    architecture: str
    quantization: str | None
    converted: bool
    seconds: float

    def describe(self, key: str) -> str:
        """The run's line about this source: what the weights are and where they are."""
        what = (
            f"a float32 image of a {self.quantization}-quantised GGUF file"
            if self.quantization
            else "a float32 image of a GGUF file of plain floats"
        )
        how = f"dequantised now, in {self.seconds:.0f} s" if self.converted else "cached earlier"
        return (
            f"{key}: {self.source.name} ({self.architecture}): the weights are {what}, not the "
            f"model it was quantised from ({how}; {self.path})"
        )


def find_image(sha256: str) -> Path | None:
    """The complete image of the file whose content digest is ``sha256``, or None (also where
    the image's own record names another digest: a renamed or damaged directory)."""
    path = _images() / sha256
    if not _complete(path):
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads((path / IMAGE_FILE).read_text(encoding="utf-8")).get("sha256") != sha256:
            return None
    return path


def image_mismatch(path: Path, header: GGUFHeader, sha256: str) -> str | None:
    """What the complete image at ``path`` says it was made from (its ``klpo-gguf.json``), where
    that is not the file asked for (its header's architecture and name, its content digest);
    None where they agree or there is no complete image.

    A wrong digest (a damaged memo, a renamed image directory) would otherwise hand one model's
    weights to a run whose first line names another."""
    if not _complete(path):
        return None
    try:
        record = json.loads((path / IMAGE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"its {IMAGE_FILE} cannot be read ({err})"
    if not isinstance(record, dict):
        return f"its {IMAGE_FILE} is not a record"
    asked = {
        "sha256": sha256,
        "architecture": header.architecture,
        "name": header.name,
        "size": header.size,
        "tensors": header.tensors,
    }
    odd = [k for k, v in asked.items() if k in record and record[k] != v]
    if not odd:
        return None
    return "; ".join(f"{k} {record[k]!r}, not {asked[k]!r}" for k in odd)


def _complete(path: Path) -> bool:
    from klpo.train.runtime.checkpoint import model_dir_problem

    return (path / IMAGE_FILE).is_file() and model_dir_problem(path) is None


_RESOLVED: dict[tuple[str, int, int, int], GGUFImage] = {}


def forget_resolved() -> None:
    """Forget the files :func:`resolve_gguf` resolved in this process: the next call looks each
    up in the cache, as a new process does."""
    _RESOLVED.clear()


def resolve_gguf(
    name: str | os.PathLike[str],
    *,
    key: str = "model",
    log: Callable[[str], None] | None = None,
    convert: Callable[[Path, Path, GGUFHeader, str], None] | None = None,
) -> GGUFImage:
    """The float32 model directory of the GGUF file ``name``: made once (dequantised by
    transformers, with the file's tokenizer, chat template and generation config), then read
    from the cache. Within a process a second call for an unchanged file returns at once.

    Args:
        name: the ``.gguf`` file.
        key: the config key or option that names it, for messages.
        log: where to say that a conversion starts (it takes a minute or more on a 100M model).
        convert: what makes the image, ``(source, final, header, sha256)`` (default
            :func:`convert_gguf`); called only where the cache lacks it, under the file's lock.

    Raises:
        GGUFError: the file cannot be used (:func:`read_header`, :func:`check_architecture`), or
            transformers fails on it.
    """
    started = time.monotonic()
    source = Path(name).expanduser()
    if source.is_file():
        known = _RESOLVED.get(_stat_key(source))
        if known is not None and _complete(known.path):
            return replace(known, converted=False, seconds=time.monotonic() - started)
    header = read_header(source)
    stat = _stat_key(source)
    check_architecture(source, header)
    sha = file_sha256(source)
    final = _images() / sha
    odd = image_mismatch(final, header, sha)
    if odd is not None or not _complete(final):
        # A remembered digest is trusted only where it names a complete image made from this
        # file: a memo that names another file's image, or one no image has yet (a new image
        # is filed under the file's own digest, never under a memo's), is checked by reading
        # the file itself, which a conversion reads anyway.
        fresh = file_sha256(source, remembered=False)
        if fresh != sha:
            if log is not None:
                log(
                    f"{key}: the cache's remembered digest of {source.name} was wrong (it named "
                    f"the image of another file); read the file again: sha256 {fresh[:12]}…"
                )
            sha, final = fresh, _images() / fresh
            odd = image_mismatch(final, header, sha)
    if odd is not None:
        raise GGUFError(
            f"{source} ({header.architecture} {header.name!r}): klpo's cached image {final} was "
            f"made from another file ({odd}, by its {IMAGE_FILE}), so a run would train other "
            f"weights than the file's. The cache is damaged: delete {final} and run again (the "
            "file is converted anew)"
        )
    converted = False
    if not _complete(final):
        try:
            converted = _make_image(source, final, header, sha, key, log, convert or convert_gguf)
        except GGUFError:
            raise
        except Exception as err:  # a cache that cannot be written, a full disk
            problem = _write_error(source, final, header, err)
            if problem is None:
                raise
            raise problem from None
    image = GGUFImage(
        source=source,
        path=final,
        sha256=sha,
        architecture=header.architecture,
        quantization=header.quantization,
        converted=converted,
        seconds=time.monotonic() - started,
    )
    _RESOLVED[stat] = image
    return image


def _write_error(source: Path, final: Path, header: GGUFHeader, err: Exception) -> GGUFError | None:
    """The :class:`GGUFError` for a conversion that could not write its image: a full disk
    (an OSError's errno, or safetensors' own error, which carries it in its text) in the words of
    every klpo command's full-disk message, with the room the image takes; any other OSError as
    a cache that cannot be written; None for anything else (raised unchanged)."""
    from klpo.train.runtime.checkpoint import disk_full, format_size, full_disk_message

    if disk_full(err):
        need = format_size(_image_bytes(header))
        return GGUFError(
            full_disk_message(f"dequantising {source.name}", final.parent, err)
            + f" (the float32 image takes about {need}; or set KLPO_CACHE to a directory on a "
            "disk with room)"
        )
    if isinstance(err, OSError):
        return GGUFError(
            f"{source}: its float32 image cannot be written into klpo's cache {final.parent} "
            f"({type(err).__name__}: {err}); free some space there, or set KLPO_CACHE to a "
            "writable directory"
        )
    return None


def _image_bytes(header: GGUFHeader) -> float:
    """About what the float32 image of a quantised file takes on disk: 4.3 times the file
    (measured: SmolLM2's 126 MB file, 540 MB; Gemma 3's 253 MB, 1.1 GB)."""
    return 4.3 * header.size if header.quantization else 1.0 * header.size


def _sweep_stale(images: Path, sha: str) -> list[str]:
    """Remove the temporary directories of conversions killed before they finished (``kill -9``
    leaves ``.tmp-<sha256>-<pid>``, hundreds of MB, that no ``finally`` removed); the names
    removed. Called under ``sha``'s lock, where every temporary of ``sha`` is stale; another
    file's is stale when the process its name ends with no longer runs."""
    import shutil

    gone: list[str] = []
    for entry in images.glob(".*-*-*"):  # atomic_dir's .tmp-<name>-<pid> and .old-<name>-<pid>
        name, _, pid = entry.name.rpartition("-")
        if not name.startswith((".tmp-", ".old-")) or not entry.is_dir() or not pid.isdigit():
            continue
        if name[5:] != sha and (int(pid) == os.getpid() or _alive(int(pid))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            gone.append(entry.name)
    return gone


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_image(
    source: Path,
    final: Path,
    header: GGUFHeader,
    sha: str,
    key: str,
    log: Callable[[str], None] | None,
    convert: Callable[[Path, Path, GGUFHeader, str], None],
) -> bool:
    """Convert ``source`` into ``final`` by ``convert`` under the lock, unless another process
    did meanwhile; whether this call converted it."""
    from filelock import FileLock

    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if _complete(final):  # another process made it while this one waited
            return False
        gone = _sweep_stale(final.parent, final.name)
        if gone and log is not None:
            log(f"{key}: removed what killed conversions left in {final.parent}: {', '.join(gone)}")
        if log is not None:
            log(
                f"{key}: dequantising {source.name} ({header.quantization or 'floats'}, "
                f"{header.size / 1e6:.0f} MB) into a float32 model once; later runs "
                f"read it from {final}"
            )
        convert(source, final, header, sha)
    return True


def convert_gguf(source: Path, final: Path, header: GGUFHeader, sha: str) -> None:
    """Dequantise ``source`` with transformers and save the float32 model, its tokenizer, chat
    template and generation config into ``final``, atomically; transformers' progress bars only
    where stderr is a terminal."""
    with _bars_on_a_terminal_only():
        _convert(source, final, header, sha)


def _convert(source: Path, final: Path, header: GGUFHeader, sha: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from klpo._io import atomic_dir, write_text_atomic

    logging.set_verbosity_error()  # no advisory warnings
    where, file = str(source.resolve().parent), source.resolve().name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=file, dtype=torch.float32, **_dequantize_kwargs(file)
        )
    except (
        Exception
    ) as err:  # transformers and tokenizers raise many kinds on a file they cannot read
        text = " ".join(str(err).split())[:240]
        raise GGUFError(
            f"{source}: transformers {transformers.__version__} could not dequantise it "
            f"({type(err).__name__}: {text}). If the gguf package is missing, install it with "
            f"`{INSTALL}`; else convert the original model with save_pretrained"
        ) from None
    odd = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
    if odd:
        raise GGUFError(
            f"{source}: transformers kept some weights as {', '.join(odd)} rather than "
            "dequantising them to float32; klpo trains a float model only"
        )
    _drop_quantisation(model)
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        write_text_atomic(
            tmp / IMAGE_FILE,
            json.dumps(
                {
                    "source": source.name,
                    "sha256": sha,
                    "architecture": header.architecture,
                    "name": header.name,
                    "size": header.size,
                    "tensors": header.tensors,
                    "quantization": header.quantization,
                    "dtype": "float32",
                    "transformers": transformers.__version__,
                },
                indent=2,
            )
            + "\n",
        )


@contextlib.contextmanager
def _bars_on_a_terminal_only():
    """transformers' progress bars (its own, and the GGUF loader's plain ``tqdm`` over the
    tensors) only where stderr is a terminal: into a piped log each redraw is another line, some
    fifty for one conversion. The bars come back as they were afterwards."""
    import sys

    if sys.stderr.isatty():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    was_on, bar = logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda *args, **kwargs: bar(*args, **{**kwargs, "disable": True})
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_on:
            logging.enable_progress_bar()


def _dequantize_kwargs(file: str) -> dict:
    """``quantization_config`` that asks transformers' newer GGUF loader to dequantise every
    weight (where it would otherwise keep blocks for a kernel); nothing for older releases."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    import inspect

    if "dequantize" not in inspect.signature(GgufConfig).parameters:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=file, dequantize=True)}


def _drop_quantisation(model) -> None:
    """Forget that ``model`` came from a quantised file: it holds plain float32 tensors, and
    ``save_pretrained`` refuses a model that still carries a quantiser that cannot serialise."""
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = ""
