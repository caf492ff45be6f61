"""Prepared shards, mixtures, document positions, pack=false, prefetch and streaming (no network)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models.common import IGNORE_INDEX
from models.errors import ConfigError
from tests.trainer.test_tokenizer import make_hf_tokenizer
from trainer.config import DataConfig, MixtureSource
from trainer.data import (
    build_dataloader,
    feistel_permutation,
    is_validation,
    load_documents,
    tokenize_with_starts,
)
from trainer.data import windows as windows_mod
from trainer.data.prepared import prepare
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer
from trainer.prepare_data import main as prepare_main
from trainer.step import document_positions

BYTE = ByteTokenizer()


@pytest.fixture(autouse=True)
def _isolated_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep datasets' arrow cache inside the test's tmp dir and forbid Hub access."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def corpus(tmp_path: Path, name: str, num_docs: int, prefix: str = "doc") -> Path:
    """Two JSON Lines files of varied documents (one null row), sorted names = canonical order."""
    rng = np.random.default_rng(len(name) + num_docs)
    rows: list[dict[str, Any]] = [
        {"text": f"{prefix} {i}: " + " ".join(f"w{int(x)}" for x in rng.integers(0, 50, rng.integers(1, 40)))}
        for i in range(num_docs)
    ]
    rows[3] = {"text": None}
    half = num_docs // 2
    write_jsonl(tmp_path / name / "a.jsonl", rows[:half])
    write_jsonl(tmp_path / name / "b.jsonl", rows[half:])
    return tmp_path / name


def loader(cfg: DataConfig, tok: Any = BYTE, **kw: Any) -> Any:
    args: dict[str, Any] = dict(split="train", seq_len=16, global_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    args.update(kw)
    return build_dataloader(cfg, tok, **args)


def same(a: Any, b: Any) -> bool:
    pos = (a.positions is None and b.positions is None) or torch.equal(a.positions, b.positions)
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and pos


# ------------------------------------------------------------------------------ prepare


def test_prepared_shards_equal_the_in_memory_stream(tmp_path: Path) -> None:
    raw = DataConfig(source="json", path=str(corpus(tmp_path, "c", 300)), val_fraction=0.05)
    out = tmp_path / "prep"
    index = prepare(raw, str(out), num_proc=1, chunk_mb=0.004)  # ~4 KB chunks: several shards per file
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]["shards"]) > 3
    assert index["tokenizer"]["kind"] == "byte" and [f["bytes"] for f in index["files"]]
    for split in ("train", "validation"):
        tokens, starts = tokenize_with_starts(load_documents(raw, split), BYTE)
        shards = index["splits"][split]["shards"]
        flat = np.concatenate([np.fromfile(out / s["tokens"], dtype=np.uint16) for s in shards])
        assert np.array_equal(flat, tokens.numpy().astype(np.uint16)), split
        offsets = np.cumsum([0] + [s["num_tokens"] for s in shards[:-1]])
        doc_starts = np.concatenate([np.load(out / s["docs"]) + o for s, o in zip(shards, offsets)])
        assert np.array_equal(doc_starts, starts), split
    # Same windows, same sample order, same positions as the in-memory loader.
    mem, tok = loader(raw), loader(DataConfig(source="tokens", path=str(out)))
    assert mem.windows.num_windows == tok.windows.num_windows
    assert all(same(mem.next_batch(), tok.next_batch()) for _ in range(40))
    # Two worker processes write the same shards.
    par = prepare(raw, str(tmp_path / "par"), num_proc=2, chunk_mb=0.004)
    assert par["splits"] == index["splits"]
    for s in index["splits"]["train"]["shards"]:
        assert (out / s["tokens"]).read_bytes() == (tmp_path / "par" / s["tokens"]).read_bytes()


def test_prepare_is_idempotent_and_refuses_changed_inputs(tmp_path: Path, capsys: Any) -> None:
    path = corpus(tmp_path, "c", 60)
    out = tmp_path / "prep"
    argv = ["data=jsonl", f"data.path={path}", f"out={out}"]
    assert prepare_main(argv) == 0
    assert "MB/s" in capsys.readouterr().err  # the progress line
    stamp = (out / "index.json").stat().st_mtime_ns
    assert prepare_main(argv) == 0 and (out / "index.json").stat().st_mtime_ns == stamp  # no-op
    tok = make_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    assert prepare_main([*argv, f"data.tokenizer={tok}"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    with open(path / "b.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert prepare_main(argv) == 2
    err = capsys.readouterr().err
    assert "b.jsonl" in err and "new out= folder" in err
    assert (out / "index.json").stat().st_mtime_ns == stamp
    assert prepare_main([f"data.path={path}"]) == 2 and "out=DIR" in capsys.readouterr().err


def test_tokenizer_larger_than_the_model_is_refused_before_any_work(tmp_path: Path, capsys: Any) -> None:
    tok = make_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])  # vocab 300
    out = tmp_path / "never"
    code = prepare_main(["data=builtin", f"data.tokenizer={tok}", "model.vocab_size=260", f"out={out}"])
    assert code == 2 and "vocab_size=260" in capsys.readouterr().err and not out.exists()


def test_training_refuses_another_tokenizer_and_missing_index(tmp_path: Path) -> None:
    path = corpus(tmp_path, "c", 40)
    tok_path = make_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    prepare(DataConfig(source="json", path=str(path), tokenizer=tok_path), str(tmp_path / "prep"))
    with pytest.raises(ConfigError, match="data.tokenizer=.*tokenizer.json"):
        loader(DataConfig(source="tokens", path=str(tmp_path / "prep")))  # byte tokenizer
    hf = loader(
        DataConfig(source="tokens", path=str(tmp_path / "prep"), tokenizer=tok_path), HFTokenizer(tok_path)
    )
    assert hf.next_batch().inputs.max() < 300
    with pytest.raises(ConfigError, match="trainer.prepare_data"):
        loader(DataConfig(source="tokens", path=str(tmp_path)))
    (tmp_path / "prep" / "train-00000.bin").write_bytes(b"xx")
    with pytest.raises(ConfigError, match="truncated"):
        loader(
            DataConfig(source="tokens", path=str(tmp_path / "prep"), tokenizer=tok_path),
            HFTokenizer(tok_path),
        )


def test_tiny_corpus_moves_the_last_document_to_validation(tmp_path: Path) -> None:
    rows = [{"text": f"doc {i}"} for i in range(7)]  # crc32 of "0".."6" holds nothing out at 1%
    raw = DataConfig(source="json", path=str(write_jsonl(tmp_path / "t.jsonl", rows)))
    index = prepare(raw, str(tmp_path / "prep"))
    assert index["splits"]["validation"]["num_docs"] == 1 and index["splits"]["train"]["num_docs"] == 6
    val = index["splits"]["validation"]["shards"][0]
    got = np.fromfile(tmp_path / "prep" / val["tokens"], dtype=np.uint16)
    assert got.tolist() == tokenize_with_starts(load_documents(raw, "validation"), BYTE)[0].tolist()


# ---------------------------------------------------------------------- windows and order


def test_positions_restart_at_every_document_and_pack_false_pads(tmp_path: Path) -> None:
    out = tmp_path / "prep"
    prepare(DataConfig(source="json", path=str(corpus(tmp_path, "c", 120)), val_fraction=0.0), str(out))
    batch = loader(DataConfig(source="tokens", path=str(out)), seq_len=64).next_batch()
    assert batch.positions is not None
    # Restart at every BOS and at the window's first token: exactly what the tokens alone imply.
    assert torch.equal(batch.positions, document_positions(batch.inputs, BYTE.bos_id, BYTE.eos_id))
    steps = batch.positions[:, 1:] - batch.positions[:, :-1]
    assert bool(((steps == 1) | (batch.positions[:, 1:] == 0)).all())
    docs = loader(
        DataConfig(source="tokens", path=str(out), pack=False, shuffle=False), seq_len=64
    ).next_batch()
    texts = load_documents(DataConfig(source="json", path=str(tmp_path / "c"), val_fraction=0.0), "train")
    for row in range(8):
        ids = [BYTE.bos_id, *texts[row].encode()[:64], BYTE.eos_id][:65]
        n = len(ids) - 1
        assert docs.inputs[row, :n].tolist() == ids[:-1] and docs.labels[row, :n].tolist() == ids[1:]
        assert bool((docs.labels[row, n:] == IGNORE_INDEX).all()) and bool(
            (docs.inputs[row, n:] == BYTE.eos_id).all()
        )
    assert torch.equal(docs.positions[0], torch.arange(64))


def test_positions_of_long_real_documents_stay_below_seq_len(tmp_path: Path) -> None:
    """The built-in corpus's files are far longer than a window: a window from the middle of one
    starts at position 0 (not at its offset in the file), in memory, from shards and streamed."""
    seq_len = 64
    builtin = DataConfig(max_documents=24, val_fraction=0.0)
    docs = load_documents(builtin, "train")
    assert max(len(d.encode()) for d in docs) > 50 * seq_len  # real, long documents
    prepare(builtin, str(tmp_path / "prep"))
    write_jsonl(tmp_path / "raw" / "a.jsonl", [{"text": d} for d in docs])
    stream = DataConfig(source="json", path=str(tmp_path / "raw"), streaming=True, val_fraction=0.0)
    batches = {
        "memory": loader(builtin, seq_len=seq_len, global_batch_size=64).next_batch(),
        "shards": loader(
            DataConfig(source="tokens", path=str(tmp_path / "prep")), seq_len=seq_len, global_batch_size=64
        ).next_batch(),
        "stream": loader(stream, seq_len=seq_len, global_batch_size=64).next_batch(),
    }
    assert same(batches["memory"], batches["shards"])
    for name, b in batches.items():
        assert b.positions is not None and int(b.positions.max()) < seq_len, name
        assert torch.equal(b.positions, document_positions(b.inputs, BYTE.bos_id, BYTE.eos_id)), name
        mid_document = b.inputs[:, 0] != BYTE.bos_id
        assert int(mid_document.sum()) > 32, name  # most windows start inside a long file, at position 0


def test_feistel_order_is_a_bijection_and_resumes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for n in (1, 2, 7, 1000, 4097):
        perm = feistel_permutation(np.arange(n), n, seed=3)
        assert sorted(perm.tolist()) == list(range(n))
    assert not np.array_equal(feistel_permutation(np.arange(1000), 1000, 0), np.arange(1000))
    monkeypatch.setattr(windows_mod, "RANDPERM_MAX_WINDOWS", 16)  # force the O(1)-memory order
    out = tmp_path / "prep"
    prepare(DataConfig(source="json", path=str(corpus(tmp_path, "c", 200)), val_fraction=0.0), str(out))
    cfg = DataConfig(source="tokens", path=str(out))
    a = loader(cfg)
    n = a.windows.num_windows
    seen = torch.cat([a.order.window_indices(torch.arange(e * n, e * n + n)) for e in range(2)])
    assert n > 16 and sorted(seen[:n].tolist()) == list(range(n)) == sorted(seen[n:].tolist())
    assert not torch.equal(seen[:n], seen[n:]) and a.order._perm_cache == {}  # nothing held in memory
    b = loader(cfg)
    for _ in range(3):
        b.next_batch()
    c = loader(cfg, dp_rank=1, dp_size=2, global_batch_size=8)
    c.load_state_dict(b.state_dict())
    assert torch.equal(c.next_batch().inputs, b.next_batch().inputs[4:])


def mixture(tmp_path: Path) -> DataConfig:
    for name, prefix in (("web", "web"), ("code", "code")):
        raw = DataConfig(source="json", path=str(corpus(tmp_path, name, 150, prefix)), val_fraction=0.0)
        prepare(raw, str(tmp_path / f"{name}_tok"))
    srcs = [MixtureSource(str(tmp_path / "web_tok"), 0.7), MixtureSource(str(tmp_path / "code_tok"), 0.3)]
    return DataConfig(source="tokens", sources=srcs)


def test_mixture_proportions_determinism_resume_and_reshard(tmp_path: Path) -> None:
    cfg = mixture(tmp_path)
    a = loader(cfg, global_batch_size=8)
    src, _ = a.mixture.locate(torch.arange(1000))
    share = np.bincount(src, minlength=2) / 1000
    assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
    batches = [a.next_batch() for _ in range(125)]  # 1000 samples
    realised = a.pop_metrics()
    assert abs(realised["data_mix/web_tok"] - 0.7) < 0.01 and abs(realised["data_mix/code_tok"] - 0.3) < 0.01
    # Samples really come from their sources (documents start with their prefix).
    assert all(b.inputs.shape == (8, 16) for b in batches)
    again = loader(cfg, global_batch_size=8)
    assert all(same(again.next_batch(), b) for b in batches[:20])  # deterministic across runs
    resumed = [loader(cfg, global_batch_size=8, dp_rank=r, dp_size=2) for r in range(2)]
    for r in resumed:
        r.load_state_dict(again.state_dict())  # 20 steps in, now 2 dp ranks
    for t in range(20, 40):
        parts = [r.next_batch() for r in resumed]
        assert torch.equal(torch.cat([p.inputs for p in parts]), batches[t].inputs)
    other = replace(cfg, sources=[MixtureSource(cfg.sources[0].path, 0.5), cfg.sources[1]])
    with pytest.raises(ConfigError, match="data.sources"):
        loader(other).load_state_dict(again.state_dict())


def test_prefetch_gives_the_same_batches_and_reports_waiting(tmp_path: Path) -> None:
    out = tmp_path / "prep"
    prepare(DataConfig(source="json", path=str(corpus(tmp_path, "c", 200)), val_fraction=0.0), str(out))
    sync = loader(DataConfig(source="tokens", path=str(out), prefetch=0))
    ahead = loader(DataConfig(source="tokens", path=str(out), prefetch=3))
    assert all(same(sync.next_batch(), ahead.next_batch()) for _ in range(10))
    ahead.load_state_dict(sync.state_dict())  # moved: the thread restarts at the new position
    assert all(same(sync.next_batch(), ahead.next_batch()) for _ in range(5))
    ahead.reset()
    sync.reset()
    assert same(sync.next_batch(), ahead.next_batch())
    time.sleep(0.05)  # let the thread get ahead: then the step does not wait
    metrics = ahead.pop_metrics()
    assert set(metrics) == {"data_wait_s"} and metrics["data_wait_s"] >= 0
    ahead.close()


# ---------------------------------------------------------------------------- streaming


def stream_cfg(tmp_path: Path, **kw: Any) -> DataConfig:
    return DataConfig(
        source="json", path=str(corpus(tmp_path, "s", 400)), streaming=True, val_fraction=0.05, **kw
    )


@pytest.mark.parametrize("prefetch", [0, 2])
def test_streaming_resume_yields_the_same_next_batch(tmp_path: Path, prefetch: int) -> None:
    cfg = stream_cfg(tmp_path, prefetch=prefetch)
    ranks = [loader(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    straight = [[ld.next_batch() for _ in range(12)] for ld in ranks]  # crosses an epoch of each rank's part
    for r in range(2):
        first = loader(cfg, dp_rank=r, dp_size=2)
        for _ in range(5):
            first.next_batch()
        sd = first.state_dict()
        assert sd["samples_seen"] == 40 and f"stream_dp_rank{r}" in sd
        resumed = loader(cfg, dp_rank=r, dp_size=2)
        resumed.load_state_dict(json.loads(json.dumps(sd)))  # survives serialisation
        assert all(same(resumed.next_batch(), b) for b in straight[r][5:])
        first.close()
        resumed.close()
    # The two ranks read different documents; positions restart at every BOS.
    assert not torch.equal(straight[0][0].inputs, straight[1][0].inputs)
    b = straight[0][0]
    assert torch.equal(b.positions, document_positions(b.inputs, BYTE.bos_id, BYTE.eos_id))
    with pytest.raises(ConfigError, match="2 data-parallel ranks.*1"):
        loader(cfg).load_state_dict(sd)


def test_streaming_split_mixture_and_pack_false(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path)
    val = loader(cfg, split="validation", global_batch_size=2, seq_len=8)
    all_texts = set(load_documents(DataConfig(source="json", path=cfg.path, val_fraction=0.0), "train"))
    docs = loader(replace(cfg, pack=False), split="validation", global_batch_size=2, seq_len=400)
    held = docs.next_batch()
    assert bool((held.labels[:, -1] == IGNORE_INDEX).all())  # short documents are padded
    text = bytes(held.inputs[0][1 : int((held.labels[0] != IGNORE_INDEX).sum())].tolist()).decode()
    assert text in all_texts and is_validation(text, 0.05)  # held out by a hash of the text
    assert val.next_batch().inputs.shape == (2, 8)
    second = corpus(tmp_path, "s2", 100, prefix="code")
    mix = replace(cfg, path=None, sources=[MixtureSource(cfg.path, 0.7), MixtureSource(str(second), 0.3)])
    a = loader(mix)
    for _ in range(3):
        a.next_batch()
    b = loader(mix)
    b.load_state_dict(a.state_dict())
    assert same(a.next_batch(), b.next_batch())


def test_streaming_config_errors(tmp_path: Path) -> None:
    from tests.configs import make_config

    with pytest.raises(ConfigError, match="streaming"):
        make_config("data=tokens", "data.path=/x", "data.streaming=true")
    with pytest.raises(ConfigError, match="needs data.path"):
        make_config("data=jsonl")
    with pytest.raises(ConfigError, match="weight"):
        make_config("data=tokens", "data.sources=[{path: a, weight: 0}]")
